"""Tiny dense HF models (written once per session) that the quantized-checkpoint writers start from."""

from __future__ import annotations

import pytest
from checkpoints import save_tiny_hf_model
from torch_threads import one_torch_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads cost more than they save (and the CPU cores are shared)."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """HF folder of a tiny random Llama (hidden 128, intermediate 256, 2 layers, vocab 160), float32."""
    return save_tiny_hf_model("llama", str(tmp_path_factory.mktemp("dense_llama")))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """HF folder of a tiny random Qwen3-MoE (layer 0 dense MLP, layer 1 4 experts of 128), float32."""
    return save_tiny_hf_model("qwen3_moe", str(tmp_path_factory.mktemp("dense_qwen3_moe")))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """HF folder of a tiny random Qwen3 (q_norm / k_norm, head_dim 32), float32."""
    return save_tiny_hf_model("qwen3", str(tmp_path_factory.mktemp("dense_qwen3")))
