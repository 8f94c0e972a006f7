"""MXFP4 fused MoE (`kernels/triton/fused_moe_mxfp4.py`) vs decode-then-`fused_experts_reference`.

CPU: the Triton interpreter, float32 / float16, tiny shapes (its bfloat16
tl.dot is wrong, see test_quant_linear.py; the bfloat16 decode is checked
bit for bit on its own). GPU: gpt-oss-20b's expert sizes, bfloat16 and the
cc-7.0 float16 settings.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenmill.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tokenmill.kernels.triton import fused_moe_mxfp4 as mx
from tokenmill.kernels.triton.fused_moe_quant import GroupedQuantConfig
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers start as NaN, so an element the kernels skip fails the comparison."""
    monkeypatch.setattr(mx, "_new_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


@triton.jit
def _decode_kernel(b_ptr, s_ptr, lo_ptr, hi_ptr, DECODE: tl.constexpr):
    n = tl.arange(0, 16)
    j = tl.arange(0, 32)
    byte = tl.load(b_ptr + n[:, None] * 32 + j[None, :])
    s = tl.load(s_ptr + n[:, None] * 2 + j[None, :] // 16)
    lo, hi = mx._decode_pairs(byte, s, DECODE)
    tl.store(lo_ptr + n[:, None] * 32 + j[None, :], lo.to(lo_ptr.dtype.element_ty))
    tl.store(hi_ptr + n[:, None] * 32 + j[None, :], hi.to(hi_ptr.dtype.element_ty))


@pytest.mark.parametrize("mode", [mx.DECODE_BF16_BITS, mx.DECODE_FP32_BITS, mx.DECODE_PTX])
def test_decode_is_exact_for_every_byte_and_scale(mode):
    """Each decode (bit-built bfloat16 / float32, the bf16x2 PTX on a GPU) equals kernels/mxfp4.py's table
    decode for all 256 bytes and scale bytes 2-252."""
    if mode == mx.DECODE_PTX and not CUDA:
        pytest.skip("inline PTX runs on a GPU only (not in the interpreter)")
    blocks = torch.arange(512).remainder(256).to(torch.uint8).view(16, 2, 16)
    scales = torch.linspace(2, 252, 32).round().to(torch.uint8).view(16, 2)
    dtype = torch.float32 if mode == mx.DECODE_FP32_BITS else torch.bfloat16
    lo, hi = (torch.full((16, 32), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
    _decode_kernel[(1,)](blocks.to(DEV), scales.to(DEV), lo, hi, DECODE=mode)
    ref = dequantize_mxfp4(blocks, scales, torch.float32).view(16, 64)
    torch.testing.assert_close(lo.cpu().float(), ref[:, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(hi.cpu().float(), ref[:, 1::2], rtol=0, atol=0)


def _experts(num_experts, hidden, inter, dtype, bias, seed=0, device=DEV):
    """Packed experts from random dense ones (quantize_mxfp4), plus biases (or None)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    (b13, s13), (b2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    packed = (b13.view(num_experts, 2 * inter, hidden // 32, 16), s13,
              b2.view(num_experts, hidden, inter // 32, 16), s2)
    packed = tuple(t.to(device) for t in packed)
    biases = (None, None)
    if bias:
        biases = (torch.randn(num_experts, 2 * inter, generator=g).to(device, dtype),
                  torch.randn(num_experts, hidden, generator=g).to(device, dtype))
    return packed, biases


def _reference(x, packed, biases, weights, ids, activation):
    """Decode every expert to x's dtype, then the float32 PyTorch reference."""
    w13 = dequantize_mxfp4(packed[0], packed[1], x.dtype).float()
    w2 = dequantize_mxfp4(packed[2], packed[3], x.dtype).float()
    b13, b2 = (None if b is None else b.float() for b in biases)
    return fused_experts_reference(x.float(), w13, w2, weights, ids, activation, b13, b2)


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,block_m,dtype,bias,activation", [
    (1, 64, 32, 4, 2, None, torch.float32, True, "swigluoai"),  # one decode token: most experts empty
    (13, 160, 96, 5, 3, 16, torch.float32, True, "swigluoai"),  # N and K not multiples of the 64-wide tiles
    (40, 64, 32, 4, 2, 16, torch.float16, False, "silu"),  # several tiles per expert, no biases
    (9, 96, 64, 3, 1, 32, torch.float16, True, "swigluoai"),  # top-1
])
def test_matches_reference_on_decoded_experts(nan_outputs, num_tokens, hidden, inter, num_experts, top_k, block_m,
                                              dtype, bias, activation):
    packed, biases = _experts(num_experts, hidden, inter, dtype, bias)
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(num_tokens, hidden, generator=g)).to(DEV, dtype)  # pushes gate/up past the +-7 clamp
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g).to(DEV), top_k, top_k > 1)
    config = GroupedQuantConfig(block_n=64) if hidden == 160 else None  # N = 160: 2.5 tiles of 64
    out = mx.fused_experts_mxfp4_triton(x, *packed, weights, ids, activation, *biases, block_m=block_m,
                                        config=config)
    ref = _reference(x, packed, biases, weights, ids, activation)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_cc70_settings_match_reference(nan_outputs, monkeypatch):
    """The cc-7.0 launch (float16, 32 x 32 weight tiles, BLOCK_M 32 past 512 pairs, one stage, no prefetch)."""
    monkeypatch.setattr(mx, "device_facts", lambda device: ((7, 0), 80))
    packed, biases = _experts(4, 96, 64, torch.float16, True, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 96, generator=g).to(DEV, torch.float16)
    weights, ids = select_experts(torch.randn(3, 4, generator=g).to(DEV), 2, True)
    out = mx.fused_experts_mxfp4_triton(x, *packed, weights, ids, "swigluoai", *biases)
    ref = _reference(x, packed, biases, weights, ids, "swigluoai")
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_bad_shapes_are_refused():
    (b13, s13, b2, s2), _ = _experts(2, 64, 32, torch.float32, False)
    x = torch.zeros(1, 64, device=DEV)
    weights, ids = torch.ones(1, 1, device=DEV), torch.zeros(1, 1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="do not fit hidden size 96"):
        mx.fused_experts_mxfp4_triton(torch.zeros(1, 96, device=DEV), b13, s13, b2, s2, weights, ids)
    with pytest.raises(ValueError, match="must be blocks"):
        mx.fused_experts_mxfp4_triton(x, b13, s13[:, :, :1], b2, s2, weights, ids)
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.fused_experts_mxfp4_triton(x, b13, s13, b2, s2, weights, ids, config=GroupedQuantConfig(block_k=48))


@pytest.mark.gpu
@pytest.mark.parametrize("cc70", [False, True], ids=["bf16", "cc70-fp16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 300, 2048])
def test_gpt_oss_20b_expert_sizes_on_gpu(monkeypatch, nan_outputs, cc70, num_tokens):
    """gpt-oss-20b's experts (E 32, top-4, H = I = 2880) with random codes and realistic scales: bfloat16
    with the cc-9.0 tiles, float16 with the cc-7.0 settings (as TOKENMILL_FORCE_CC70=1 picks them)."""
    if cc70:
        monkeypatch.setattr(mx, "device_facts", lambda device: ((7, 0), 80))
    dtype = torch.float16 if cc70 else torch.bfloat16
    e, h, i, k = 32, 2880, 2880, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    b13 = torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=g, device="cuda", dtype=torch.uint8)
    b2 = torch.randint(0, 256, (e, h, i // 32, 16), generator=g, device="cuda", dtype=torch.uint8)
    s13 = torch.randint(117, 122, (e, 2 * i, h // 32), generator=g, device="cuda", dtype=torch.uint8)
    s2 = torch.randint(117, 122, (e, h, i // 32), generator=g, device="cuda", dtype=torch.uint8)
    biases = (torch.randn(e, 2 * i, generator=g, device="cuda").to(dtype),
              torch.randn(e, h, generator=g, device="cuda").to(dtype))
    x = torch.randn(num_tokens, h, generator=g, device="cuda").to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, e, generator=g, device="cuda"), k, True)
    out = mx.fused_experts_mxfp4_triton(x, b13, s13, b2, s2, weights, ids, "swigluoai", *biases)
    ref = _reference(x, (b13, s13, b2, s2), biases, weights, ids, "swigluoai")
    assert out.dtype == dtype and not out.isnan().any()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 5e-3)
