"""The fixture writers pack exactly as the tools do, where the tools' packers run on CPU.

AutoAWQ's `WQLinear_GEMM.from_linear`, AutoGPTQ's `QuantLinear.pack` and
compressed-tensors' `PackedQuantizationCompressor.compress` get the writer's
scales and zero points and must produce the writer's tensors bit for bit.
AutoGPTQ's own CPU dequantization (its `QuantLinear.forward` without the CUDA
extension) must also equal checkpoints.py's reading of GPTQModel's
dequantize_weight, act-order included (GPTQModel itself does not install on
CPU here).
"""

from __future__ import annotations

import sys

import pytest
import torch
from checkpoints import (
    _gptq_reference,
    _rtn,
    _write_awq,
    _write_compressed_tensors,
    _write_gptq,
    autoawq_packing_utils,
    tool_module,
)
from optional_deps import missing, require

require("compressed_tensors", "compressed-tensors")


@pytest.fixture
def autoawq_gemm():
    """(AutoAWQ's GEMM module, its packing_utils)."""
    utils = autoawq_packing_utils()
    if utils is None:
        missing("autoawq")
    return tool_module("awq", "modules.linear.gemm"), utils


@pytest.fixture
def autogptq():
    """(AutoGPTQ's qlinear_cuda_old, qlinear_cuda): their `pack` and CPU dequantizing forward are plain torch/numpy."""
    if sys.version_info >= (3, 12):
        pytest.skip("AutoGPTQ 0.7.1 (its last release) ships wheels up to Python 3.11 only")
    old = tool_module("auto_gptq", "nn_modules.qlinear.qlinear_cuda_old")
    if old is None:
        missing("auto-gptq")
    return old, tool_module("auto_gptq", "nn_modules.qlinear.qlinear_cuda")


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_writer_packs_like_autoawq(autoawq_gemm, group_size):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    parts = _write_awq(w, 4, group_size, False, None, torch.float16)
    _, s, z, _ = _rtn(w, 4, group_size, False, None, torch.float16)
    # AutoAWQ packs round((W + z * s) / s): give it the grid weights the checkpoint stands for.
    gemm, utils = autoawq_gemm
    dense = utils.dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"], 4,
                                                    group_size).t().float()
    linear = torch.nn.Linear(256, 64, bias=False)
    linear.weight.data = dense
    ref = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=s.t().contiguous(),
                                                 zeros=z.t().contiguous().to(torch.float16))
    assert torch.equal(ref.qweight, parts["qweight"])
    assert torch.equal(ref.qzeros, parts["qzeros"])
    assert torch.equal(ref.scales, parts["scales"])


@pytest.mark.parametrize("bits, group_size, symmetric", [(4, 128, True), (4, 32, False), (8, -1, True),
                                                         (8, -1, False)])
def test_compressed_tensors_writer_packs_like_the_compressor(bits, group_size, symmetric):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    torch.manual_seed(1)
    w = torch.randn(72, 256)  # N = 72: the zero points' packing along N ends in a partial word
    parts = _write_compressed_tensors(w, bits, group_size, symmetric, None, torch.float16)
    _, s, z, _ = _rtn(w, bits, group_size, symmetric, None, torch.float16)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="channel" if group_size == -1 else "group",
                            group_size=None if group_size == -1 else group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": w, "weight_scale": s}
    if not symmetric:
        state["weight_zero_point"] = (z.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
    ref = PackedQuantizationCompressor.compress(state, scheme)
    assert set(ref) == set(parts)
    for name in parts:
        assert torch.equal(ref[name], parts[name]), name


@pytest.mark.parametrize("bits, group_size, symmetric", [(4, 128, True), (4, 32, False), (8, 64, True),
                                                         (8, -1, False), (4, -1, True)])
def test_gptq_writer_packs_like_autogptq(autogptq, bits, group_size, symmetric):
    old, _ = autogptq
    torch.manual_seed(bits + group_size)
    w = torch.randn(64, 256)
    parts = _write_gptq(w, bits, group_size, symmetric, None, torch.float16, "gptq")
    _, s, z, g_idx = _rtn(w, bits, group_size, symmetric, None, torch.float16)
    assert bool((z > 0).all())  # AutoGPTQ's packer ORs in zero - 1 unmasked: a zero of 0 would spill
    # AutoGPTQ packs round((W + z * s) / s): give it the grid weights the checkpoint stands for.
    linear = torch.nn.Linear(256, 64, bias=False)
    linear.weight.data = _gptq_reference(parts, {"bits": bits}).float()
    ref = old.QuantLinear(bits, group_size, 256, 64, bias=False, weight_dtype=torch.float16)
    ref.pack(linear, s.float(), z.float(), g_idx)
    assert torch.equal(ref.qweight, parts["qweight"])
    assert torch.equal(ref.qzeros, parts["qzeros"])
    assert torch.equal(ref.scales, parts["scales"])


@pytest.mark.parametrize("bits, group_size, symmetric, act_order", [(4, 128, True, True), (4, 32, False, True),
                                                                    (8, 64, True, False), (8, 32, False, True),
                                                                    (4, -1, False, False)])
def test_gptq_reading_matches_autogptq_dequantization(autogptq, bits, group_size, symmetric, act_order):
    _, new = autogptq
    torch.manual_seed(7 * bits + group_size)
    w = torch.randn(64, 256)
    perm = torch.randperm(256) if act_order else None
    parts = _write_gptq(w, bits, group_size, symmetric, perm, torch.float16, "gptq")
    layer = new.QuantLinear(bits, group_size, 256, 64, bias=False, weight_dtype=torch.float16)
    layer.qweight, layer.qzeros, layer.scales, layer.g_idx = (parts["qweight"], parts["qzeros"], parts["scales"],
                                                              parts["g_idx"])
    with torch.no_grad():  # x = I: the output is the dequantized weight W^T itself (one product per element)
        dense = layer(torch.eye(256, dtype=torch.float16)).t()
    assert torch.equal(dense, _gptq_reference(parts, {"bits": bits}))
