"""Triton kernel: MXFP4 (`*_blocks` / `*_scales`) to a dense 16/32-bit weight, on the GPU.

Whole-tensor decode (`kernels.dequantize_mxfp4` on CUDA: dense copies of
packed experts, `Mxfp4FusedMoE.expert_weights`, and the baseline of
benchmarks/gpu/mxfp4_moe.py). The MoE forward does not use it: it decodes
tile by tile inside the grouped GEMM (`triton/fused_moe_mxfp4.py`).

Format and layout: `kernels/mxfp4.py` (OCP MX v1.0; low nibble first). The
E2M1 value of code c is computed, not looked up: sign c >> 3, exponent
e = (c >> 1) & 3, mantissa m = c & 1; e == 0 gives m / 2, else
(1 + m / 2) * 2^(e - 1); times 2^(scale - 127) in float32 (built from its
bits), rounded once to the output dtype: exact for scale bytes 1-252 (the
E8M0 values 0, 2^-127, and 253-255, past float32's range times 6, do not
occur in checkpoints; 255 is MX's NaN).

Grid: (rows, byte blocks of BLOCK_B); rows = every leading index flattened.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def mxfp4_dequant_kernel(
    blocks_ptr,  # [rows, nbytes] uint8, nbytes = cols / 2
    scales_ptr,  # [rows, cols / 32] uint8
    out_ptr,  # [rows, cols]
    nbytes,
    stride_b,
    stride_s,
    stride_o,
    BLOCK_B: tl.constexpr,
):
    """Decode BLOCK_B bytes of one row: each byte holds two e2m1 values (low nibble first), times the E8M0
    scale 2^(s - 127) of its 32-value group (OCP MX spec v1.0); writes 2 * BLOCK_B outputs. Grid
    (rows, cdiv(nbytes, BLOCK_B))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = offs < nbytes
    byte = tl.load(blocks_ptr + row * stride_b + offs, mask=mask, other=0).to(tl.int32)
    s = tl.load(scales_ptr + row * stride_s + offs // 16, mask=mask, other=127).to(tl.int32)
    # 2^(s - 127) exactly: the float32 with biased exponent s and zero mantissa (s in [1, 254]).
    scale = (s << 23).to(tl.float32, bitcast=True)
    lo = byte & 0x0F
    hi = byte >> 4
    lo_v = _e2m1(lo) * scale
    hi_v = _e2m1(hi) * scale
    base = out_ptr + row * stride_o + 2 * offs
    tl.store(base, lo_v.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(base + 1, hi_v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e2m1(code):
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(code >= 8, -mag, mag)


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.mxfp4.dequantize_mxfp4` in one launch: blocks [..., G, 16] uint8, scales [..., G] uint8
    -> [..., G * 32] `dtype` (written into `out` when given, which must have that shape and dtype).

    Raises:
        ValueError: blocks and scales disagree, or `out` has the wrong shape or dtype.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree "
                         "(expected blocks [..., G, 16] and scales [..., G]).")
    shape = (*scales.shape[:-1], scales.shape[-1] * 32)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape}.")
    if out.numel() == 0:
        return out
    b = blocks.reshape(-1, scales.shape[-1] * 16)
    s = scales.reshape(-1, scales.shape[-1])
    o = out.view(-1, shape[-1])
    nbytes = b.shape[1]
    block_b = min(1024, triton.next_power_of_2(nbytes))
    mxfp4_dequant_kernel[(b.shape[0], triton.cdiv(nbytes, block_b))](
        b, s, o, nbytes, b.stride(0), s.stride(0), o.stride(0), BLOCK_B=block_b, num_warps=4)
    return out
