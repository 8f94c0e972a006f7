"""Session-wide fixtures shared by every test package."""

from __future__ import annotations

import os

import pytest


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
