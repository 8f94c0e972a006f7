"""FP8 (e4m3fn) bit conversions in Triton and the dynamic activation quantization kernel.

Conversions are integer bit operations, not FP8 casts, for two reasons:
- cc < 8.9 GPUs (V100, A100) have no FP8 conversion instructions, and the weight-only GEMM must
  decode e4m3 there (`e4m3_to_f16_div256`);
- Triton 3.6's interpreter (the CPU tests) rounds float32 -> float8e4nv wrongly: it flushes
  e4m3 subnormals (|x| < 2^-6) to zero and maps 470 to NaN and 1000 to 256 (checked 2026-12-01),
  while its fp8 loads and fp8 `tl.dot` are exact (loads decode the NaN codes 0x7F / 0xFF as +-480;
  the encoder below never writes them). Encoding with bit operations
  (`f32_to_e4m3_bits`) gives the same bits on the GPU and in the interpreter, equal to torch's
  round-to-nearest-even cast (`kernels.fp8.float_to_e4m3`).

Format and scale formulas: `kernels/fp8.py` (OCP OFP8 spec, E4M3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, fp8_bits

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@triton.jit
def f32_to_e4m3_bits(x):
    """float32 x -> e4m3fn codes (uint8): round to nearest even, saturating at +-448, NaN -> 0x7F | sign.

    Normal results (|x| >= 2^-6): round float32's 23-bit mantissa to 3 bits with the usual
    add-half-ulp-minus-one-plus-lsb trick, then rebias the exponent from 127 to 7. Subnormal results
    (multiples of 2^-9): 16384 + |x| in float32 has an ulp of 2^-9, so the float adder rounds |x| to
    nearest even for us and the low bits of the sum count the 2^-9 steps (0..8; 8 is code 0x08 = 2^-6).
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 448.0)
    abits = a.to(tl.uint32, bitcast=True)
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)
    sub = (a + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000  # 0x46800000: bits of 16384.0
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_to_f16_div256(bits):
    """e4m3fn codes (uint8) -> float16 holding value / 256, exactly (NaN codes -> NaN).

    Shifting the 7 magnitude bits up by 7 puts e4m3's exponent field in float16's and its mantissa
    in float16's top mantissa bits; float16's exponent bias is 15 instead of 7, so every normal and
    subnormal code reads as its value times 2^-8. Callers fold the 256 into the scale (exact).
    """
    b = bits.to(tl.uint16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    h = tl.where((b & 0x7F) == 0x7F, h | 0x7E00, h)
    return h.to(tl.float16, bitcast=True)


@triton.jit
def quantize_fp8_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    q_ptr,  # uint8 [M, K] (the bits of the float8_e4m3fn output)
    s_ptr,  # float32 [M, num_groups] scales out (dynamic), or the static scale [1] (STATIC)
    K, group_size, num_groups,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sg,
    STATIC: tl.constexpr,  # divide by the one scale at s_ptr instead of computing scales
    LOOP: tl.constexpr,  # group_size > BLOCK_K: one group per program, two passes over it in BLOCK_K chunks
    GROUPS: tl.constexpr,  # groups per program when not LOOP (one [GROUPS, BLOCK_K] tile, one pass)
    BLOCK_K: tl.constexpr,
):
    """Scales of x's row m over runs of `group_size` along K (amax / 448, floored at MIN_SCALE) and the
    e4m3 codes of x / scale, clamped to +-448; grid (M, cdiv(num_groups, GROUPS))."""
    m = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GROUPS
    x_row = x_ptr + m * stride_xm
    q_row = q_ptr + m * stride_qm
    if LOOP:
        k_lo = g0 * group_size
        k_hi = tl.minimum(k_lo + group_size, K)
        if STATIC:
            scale = tl.load(s_ptr)
        else:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_row + offs * stride_xk, mask=offs < k_hi, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), _FP8_MAX), _MIN_SCALE)
            tl.store(s_ptr + m * stride_sm + g0 * stride_sg, scale)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            mask = offs < k_hi
            x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + offs * stride_qk, f32_to_e4m3_bits(tl.div_rn(x, scale)), mask=mask)
    else:
        groups = g0 + tl.arange(0, GROUPS)
        j = tl.arange(0, BLOCK_K)
        offs = groups[:, None] * group_size + j[None, :]
        mask = (groups < num_groups)[:, None] & (j < group_size)[None, :] & (offs < K)
        x = tl.load(x_row + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(s_ptr)
            q = f32_to_e4m3_bits(tl.div_rn(x, scale))
        else:
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), _FP8_MAX), _MIN_SCALE)
            tl.store(s_ptr + m * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)
            q = f32_to_e4m3_bits(tl.div_rn(x, scale[:, None]))
        tl.store(q_row + offs * stride_qk, q, mask=mask)


def quantize_fp8_triton(x: torch.Tensor, group_size: int | None = None,
                        scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of activations in one launch (CUDA, or CPU under TRITON_INTERPRET=1).

    Args:
        x: [M, K] float16 / bfloat16 / float32, any strides.
        group_size: None = per token (one scale per row); G = per token-group (one per row and run of G along K,
            DeepSeek-V3's 1x128 with G = 128; a last run may be shorter).
        scale: a static per-tensor scale (float32 [] or [1]): quantize with it, compute nothing.

    Returns:
        (q [M, K] float8_e4m3fn, scale float32): [M, 1] per token, [M, ceil(K / G)] per group, the given
        scale as [1] when static. Bit-equal to `kernels.fp8.quantize_fp8_per_row` / `quantize_fp8_per_group`
        / `quantize_fp8_per_tensor`.

    Raises:
        ValueError: x is not 2-D, or group_size is not positive.
    """
    if x.dim() != 2:
        raise ValueError(f"Activations to quantize must be [M, K], not {tuple(x.shape)}.")
    if group_size is not None and group_size <= 0:
        raise ValueError(f"The FP8 activation group size must be positive, not {group_size}.")
    m, k = x.shape
    g = max(k, 1) if group_size is None else group_size
    num_groups = triton.cdiv(k, g) if group_size is not None else 1
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    static = scale is not None
    s = (scale.float().reshape(1) if static
         else torch.empty(m, num_groups, dtype=torch.float32, device=x.device))
    if m == 0 or num_groups == 0:
        if not static:
            s.fill_(MIN_SCALE)
        return q, s
    loop = g > 1024
    block_k = 1024 if loop else triton.next_power_of_2(g)
    groups = 1 if loop else max(1, min(triton.next_power_of_2(num_groups), 2048 // block_k))
    qb = fp8_bits(q)
    quantize_fp8_kernel[(m, triton.cdiv(num_groups, groups))](
        x, qb, s, k, g, num_groups,
        x.stride(0), x.stride(1), qb.stride(0), qb.stride(1),
        0 if static else s.stride(0), 0 if static else s.stride(1),
        STATIC=static, LOOP=loop, GROUPS=groups, BLOCK_K=block_k, num_warps=4,
    )
    return q, s
