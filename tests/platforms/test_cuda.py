"""CUDA platform rules with fake capabilities (runs on CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.platforms import cuda as cr

# What torch.cuda.get_arch_list() returns for two real wheel lines.
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


def test_auto_dtype_is_bf16_from_ampere_and_fp16_below(caplog):
    assert cr.resolve_cuda_dtype("auto", (9, 0), "NVIDIA H200") == torch.bfloat16
    assert cr.resolve_cuda_dtype("auto", (8, 0), "NVIDIA A100") == torch.bfloat16
    with caplog.at_level(logging.INFO, logger=cr.__name__):
        assert cr.resolve_cuda_dtype("auto", (7, 0), "Tesla V100") == torch.float16
    assert "float16" in caplog.text and "Tesla V100" in caplog.text and "8.0" in caplog.text


def test_bf16_on_volta_fails_with_the_fix():
    name = cr.describe_device("Tesla V100-SXM2-32GB", (7, 0))
    with pytest.raises(ValueError) as e:
        cr.resolve_cuda_dtype("bfloat16", (7, 0), name)
    assert "Tesla V100-SXM2-32GB" in str(e.value) and "--dtype float16" in str(e.value)
    with pytest.raises(ValueError):
        cr.resolve_cuda_dtype("bf16", (7, 5), "Tesla T4")


@pytest.mark.parametrize(
    "requested,dtype",
    [("half", torch.float16), ("fp16", torch.float16), ("float", torch.float32), ("BF16", torch.bfloat16)],
)
def test_dtype_aliases(requested, dtype):
    assert cr.resolve_cuda_dtype(requested, (9, 0), "H200") == dtype


def test_unknown_dtype():
    with pytest.raises(ValueError, match="Unknown dtype"):
        cr.resolve_cuda_dtype("int8", (9, 0), "H200")


@pytest.mark.parametrize(
    "cap,archs,ok",
    [
        ((7, 0), CU126_ARCHS, True),
        ((7, 0), CU128_ARCHS, False),  # CUDA 12.8+ wheels dropped Volta
        ((8, 9), ["sm_80", "sm_86"], True),  # same-major cubin runs on a newer minor
        ((8, 6), ["sm_89"], False),  # ... but not on an older minor
        ((9, 0), ["sm_80", "sm_86"], False),  # no cubin for Hopper, no PTX
        ((9, 0), ["sm_80", "compute_86"], True),  # PTX JIT-compiles forward
        ((9, 0), ["sm_90a"], True),
        ((10, 0), ["sm_90a", "sm_90"], False),  # arch-specific code never moves
        ((12, 0), CU128_ARCHS, True),
    ],
)
def test_torch_arch_support(cap, archs, ok):
    assert cr.torch_arch_supports(cap, archs) is ok


def test_missing_arch_names_the_device_and_a_build():
    with pytest.raises(ValueError) as e:
        cr.check_torch_arch_support((7, 0), "Tesla V100 (compute capability 7.0)", CU128_ARCHS, "2.11.0", "12.8")
    msg = str(e.value)
    assert "Tesla V100" in msg and "torch 2.11.0 (CUDA 12.8)" in msg and "sm_70" in msg
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu126" in msg
    cr.check_torch_arch_support((7, 0), "V100", CU126_ARCHS)  # no raise
    cr.check_torch_arch_support((7, 0), "V100", [])  # unknown build: no check


def test_force_cc70(monkeypatch):
    monkeypatch.delenv(cr.FORCE_CC70_ENV, raising=False)
    assert not cr.force_cc70_requested()
    assert cr.force_cc70_requested(True)
    monkeypatch.setenv(cr.FORCE_CC70_ENV, "1")
    assert cr.force_cc70_requested()
    assert cr.effective_capability((9, 0), True) == (7, 0)
    assert cr.effective_capability((9, 0), False) == (9, 0)
    assert cr.effective_capability((6, 1), True) == (6, 1)  # never raised
    eff = cr.effective_capability((9, 0), True)
    assert cr.resolve_cuda_dtype("auto", eff, "H200") == torch.float16
    assert cr.triton_launch_settings(eff) == {"num_stages": 1}
    assert cr.triton_launch_settings((9, 0)) == {"num_stages": 2}
    assert "simulated" in cr.describe_device("NVIDIA H200", eff, forced=True)


def test_feature_tables_give_reasons():
    v100 = cr.dtype_support((7, 0))
    assert v100["float16"] is None and "8.0" in v100["bfloat16"] and "8.9" in v100["fp8"]
    assert cr.dtype_support((8, 0))["fp8"] is not None and cr.dtype_support((8, 9))["fp8"] is None
    b = cr.attention_backend_support((7, 0), triton_available=True, flash_attn_available=True)
    assert b["TORCH_SDPA"] is None and b["TRITON_ATTN"] is None and "8.0" in b["FLASH_ATTN"]
    b = cr.attention_backend_support((9, 0), triton_available=False, flash_attn_available=False)
    assert "triton" in b["TRITON_ATTN"] and "flash_attn" in b["FLASH_ATTN"]


def test_cc70_settings_disable_flash_sdp():
    before = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled())
    try:
        torch.backends.cuda.enable_flash_sdp(True)
        cr.apply_cc70_settings((9, 0))
        assert torch.backends.cuda.flash_sdp_enabled()
        cr.apply_cc70_settings((7, 0))
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled() == before[1]
    finally:
        torch.backends.cuda.enable_flash_sdp(before[0])


def _fake_cuda(monkeypatch, name, cap, archs):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)


def test_startup_check_on_a_fake_v100(monkeypatch):
    _fake_cuda(monkeypatch, "Tesla V100-PCIE-16GB", (7, 0), CU128_ARCHS)
    with pytest.raises(ValueError, match="Tesla V100-PCIE-16GB.*cu126"):
        cr.check_visible_gpus()
    _fake_cuda(monkeypatch, "Tesla V100-PCIE-16GB", (7, 0), CU126_ARCHS)
    cr.check_visible_gpus()


def test_prepare_device_under_simulation(monkeypatch):
    _fake_cuda(monkeypatch, "NVIDIA H200", (9, 0), CU128_ARCHS)
    monkeypatch.setenv(cr.FORCE_CC70_ENV, "1")
    before = torch.backends.cuda.flash_sdp_enabled()
    try:
        assert cr.prepare_cuda_device(0) == (7, 0)
        assert not torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(before)
