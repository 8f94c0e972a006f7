"""Fixtures for front-end tests: the bundled SmolLM2 tokenizer (byte-level BPE) and a tiny model config.

`smollm2_gguf` comes from tests/conftest.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def tokenizer(smollm2_gguf):
    """SmolLM2's tokenizer from the GGUF (converted once, then from ~/.cache/tokenmill)."""
    from tokenmill.model_loader.tokenizer import load_tokenizer

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
