"""The method x device table and the start-up check."""

from __future__ import annotations

import pytest

from tokenmill.quantization import check_supported, kernel_for, parse_quantization_config, support_table

AWQ = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                 "version": "gemm"})
GPTQ8 = parse_quantization_config({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True})


def test_table_covers_every_method_and_device():
    rows = support_table()
    assert {(r.method, r.device) for r in rows} == {
        (m, d) for m in ("awq", "gptq", "compressed-tensors")
        for d in ("cuda cc >= 8.0", "cuda cc 7.x", "cpu", "cuda cc < 7.0")}
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
