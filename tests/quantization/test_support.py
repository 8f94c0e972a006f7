"""The method x device table and the start-up check."""

from __future__ import annotations

import pytest

from tokenmill.quantization import check_supported, kernel_for, parse_quantization_config, rows_for, support_table
from tokenmill.quantization.fp8 import quantize_at_load_config

AWQ = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                 "version": "gemm"})
GPTQ8 = parse_quantization_config({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True})
FP8_BLOCK = parse_quantization_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [128, 128]})


def test_table_covers_every_method_and_device():
    rows = support_table()
    assert {(r.method, r.device) for r in rows} == {
        (m, d) for m in ("awq", "gptq", "compressed-tensors")
        for d in ("cuda cc >= 8.0", "cuda cc 7.x", "cpu", "cuda cc < 7.0")} | {
        ("fp8", d) for d in ("cuda cc >= 8.9", "cuda cc 8.0-8.8", "cuda cc 7.x", "cpu", "cuda cc < 7.0")}
    by = {(r.method, r.device): r for r in rows}
    assert by["awq", "cpu"].bits == (4,) and by["gptq", "cpu"].bits == (4, 8)
    assert "split-K" in by["gptq", "cuda cc >= 8.0"].kernel and "cuBLAS" in by["gptq", "cuda cc >= 8.0"].kernel
    assert "float16" in by["awq", "cuda cc 7.x"].kernel
    assert "dequantized" in by["compressed-tensors", "cpu"].kernel
    assert by["gptq", "cuda cc < 7.0"].kernel.startswith("refused")


@pytest.mark.parametrize("device, cc", [("cpu", None), ("cuda", (7, 0)), ("cuda", (7, 5)), ("cuda", (8, 0)),
                                        ("cuda", (9, 0))])
def test_supported_devices(device, cc):
    for cfg in (AWQ, GPTQ8):
        check_supported(cfg, device, cc)
        kernel = kernel_for(cfg, device, cc)
        assert kernel in {r.kernel for r in support_table()}
    assert ("float16" in kernel_for(AWQ, device, cc)) == (device == "cuda" and cc < (8, 0))


@pytest.mark.parametrize("device, cc, match", [
    ("cuda", (6, 1), "awq 4-bit .*compute capability 6.1.*7.0 or newer.*--device cpu"),
    ("cuda", None, "compute capability, which is unknown"),
    ("mps", None, "not supported on device 'mps'.*CPU"),
])
def test_refusals_name_device_method_and_alternative(device, cc, match):
    with pytest.raises(ValueError, match=match):
        check_supported(AWQ, device, cc)


@pytest.mark.parametrize("cc, words", [((9, 0), "W8A8"), ((8, 9), "W8A8"), ((8, 6), "weight-only"),
                                       ((8, 0), "weight-only"), ((7, 0), "bit decoding")])
def test_fp8_rows_per_capability(cc, words):
    """W8A8 from cc 8.9 (FP8 tensor cores), weight-only on Ampere, bit decoding on cc 7.x; one row per method."""
    for cfg in (FP8_BLOCK, quantize_at_load_config()):
        assert words in kernel_for(cfg, "cuda", cc)
    assert [r.method for r in rows_for("cuda", cc)] == ["awq", "gptq", "compressed-tensors", "fp8"]
    assert "dequantized" in kernel_for(FP8_BLOCK, "cpu", None)
    with pytest.raises(ValueError, match="fp8 FP8 .*compute capability 6.1"):
        check_supported(FP8_BLOCK, "cuda", (6, 1))
