from __future__ import annotations

import pytest

from tokenmill.attention import selector


def test_cpu_default_and_explicit_torch_sdpa():
    assert selector.get_attn_backend("cpu").name == "TORCH_SDPA"
    assert selector.get_attn_backend("cuda", "torch_sdpa").name == "TORCH_SDPA"


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="TORCH_SDPA, TRITON_ATTN"):
        selector.get_attn_backend("cpu", "FLASH_XYZ")


def test_triton_refused_on_cpu():
    with pytest.raises(ValueError, match="CUDA"):
        selector.get_attn_backend("cpu", "TRITON_ATTN")


def test_cuda_falls_back_when_triton_missing(monkeypatch):
    def missing():
        raise ImportError("no triton here")

    monkeypatch.setattr(selector, "_triton_backend", missing)
    assert selector.get_attn_backend("cuda").name == "TORCH_SDPA"
    with pytest.raises(ValueError, match="TORCH_SDPA"):
        selector.get_attn_backend("cuda", "TRITON_ATTN")
