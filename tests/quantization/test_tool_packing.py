"""The fixture writers pack exactly as the tools do, where the tools' packers run on CPU.

AutoAWQ's `WQLinear_GEMM.from_linear` and compressed-tensors'
`PackedQuantizationCompressor.compress` get the writer's scales and zero
points and must produce the writer's tensors bit for bit. (GPTQ: see
references.py for the one-off check against AutoGPTQ.)
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import _rtn, _write_awq, _write_compressed_tensors
from optional_deps import missing, require
from references import autoawq_packing_utils, tool_module

require("compressed_tensors", "compressed-tensors")


@pytest.fixture
def autoawq_gemm():
    """(AutoAWQ's GEMM module, its packing_utils)."""
    utils = autoawq_packing_utils()
    if utils is None:
        missing("autoawq")
    return tool_module("awq", "modules.linear.gemm"), utils


@pytest.mark.parametrize("group_size", [32, 128])
def test_awq_writer_packs_like_autoawq(autoawq_gemm, group_size):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    parts = _write_awq(w, 4, group_size, False, None, torch.float16)
    _, s, z, _ = _rtn(w, 4, group_size, False, None, torch.float16)
    # AutoAWQ packs round((W + z * s) / s): give it the grid weights the checkpoint stands for.
    gemm, utils = autoawq_gemm
    dense = utils.dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"], 4, group_size).t().float()
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

