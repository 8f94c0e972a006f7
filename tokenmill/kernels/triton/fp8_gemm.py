"""FP8 linear layers on CUDA: y = x @ W^T (+ bias) with W = q * scale stored in e4m3fn (`kernels/fp8.py`).

Three ways, picked by `fp8_linear_triton` from the weight's scheme, the device's effective compute
capability (`platforms.cuda.effective_capability`: TOKENMILL_FORCE_CC70=1 takes the cc-7.0 paths on
any GPU) and M:

- W8A8, cc >= 8.9 (FP8 tensor cores). x is quantized per token (one launch,
  `fp8_quant.quantize_fp8_triton`; static per-tensor when the checkpoint gives `input_scale`), then
  * M <= FP8_GEMV_M_MAX (0: off by default, slower than the split-K GEMM on the H200, see below), per-tensor /
    per-channel weights (`fp8_gemv.gemv_supported`): the FMA GEMV (`fp8_gemv.py`: e4m3 codes of x and W decoded
    exactly to float32, float32 FMAs, the scales once).
  * M <= SMALL_M_MAX (decode): the Triton split-K GEMM below with fp8 `tl.dot` (H200, in CUDA graphs with the
    weights from HBM, Llama-3.1-8B's four linears at M = 1..16: 103-106 us per layer against 149-152 for
    `_scaled_mm` and 128-139 for bf16 F.linear; benchmarks/gpu/results/session9/visit2/fp8k.log).
  * larger M, per-tensor / per-channel weights, bfloat16 x, K and N multiples of 16: `torch._scaled_mm` with
    row-wise scales (scale_a [M, 1] and scale_b [1, N] float32, contiguous; W^T column-major, i.e. W
    [N, K] row-major; bfloat16 out; PyTorch's aten/src/ATen/native/cuda/ScaledBlas.cpp lists these
    rules). y = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k].
  * otherwise (other shapes, float16/float32 x) the Triton GEMM below with fp8 `tl.dot`, the scales
    applied to the float32 accumulator once at the end.
  * 128x128 block weights (DeepSeek-V3 / Qwen3-FP8): x quantized per token-group of 128 along K, then
    the Triton GEMM with K tiles inside one block: acc += dot(q_x tile, q_w tile) * s_x[m, kb] * s_w[nb, kb]
    (the float32 promotion of every 128-deep partial product, DeepSeek-V3 report §3.3.2).
- W8A16 (weight-only), any capability: the GEMM loads the weight's uint8 bits, decodes them to
  float16 with integer ops (`fp8_quant.e4m3_to_f16_div256`; no FP8 instruction, so it compiles for
  sm_70) and multiplies in x's dtype; scales as above (the x256 of the decode folded in). M <=
  FP8_GEMV_M_MAX: the FMA GEMV as above (x itself, widened to float32). Small M: split-K over 16-row tiles (cc < 8.0: float32 multiply-and-sum instead of `tl.dot`, which has no
  tensor cores there; shared/PLATFORMS.md); medium M (cc >= 8.0): tiled; large M, and M above small
  on cc < 8.0: dequantize once (`dequantize_fp8_triton`) + cuBLAS.

Accumulation: fp8 dots run with `max_num_imprecise_acc=BLOCK_K`: on sm_90 Triton otherwise lets the
fp8 wgmma accumulate the whole K loop in its reduced-precision (~14-bit) accumulator; capped, every
BLOCK_K-deep (128) partial product is added into float32 (DeepSeek-V3's promotion interval). `_scaled_mm`
(per-tensor / per-channel weights, M > SMALL_M_MAX) runs with fast accumulation (SCALED_MM_FAST_ACCUM), as
vLLM's CUTLASS sm90 FP8 kernels for these scales do (their FP8FastAccum schedules): no promotion inside the
K loop, ~10% more end-to-end throughput on the H200 (below). Block-scaled weights never take `_scaled_mm`.

Split-K writes float32 partials [SPLIT_K, M, N] that `splitk.splitk_reduce_kernel` sums in a fixed order
(+ bias, cast): no atomics, deterministic, no host sync. float16 outputs saturate at +-65504.
Products are accumulated in float32 everywhere.

Interpreter (TRITON_INTERPRET=1, CPU tests): every Triton path here runs (its fp8 loads and fp8 dots
are exact; encoding uses bit operations, see fp8_quant.py). Its bfloat16 `tl.dot` is wrong (Triton 3.6 with
NumPy 2.4, 2026-12-01: errors of 1e10 on 16x16 products), so there bfloat16 x is multiplied as exact
float32 dots (the same products; on the GPU bfloat16 tensor-core dots). GPU-only: `torch._scaled_mm` on CUDA,
and the compiled fp8 `tl.dot` (needs cc >= 8.9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.fp8 import Fp8Weight, fp8_bits, weight_scheme
from tokenmill.kernels.triton.fp8_gemv import fp8_gemv, gemv_supported
from tokenmill.kernels.triton.fp8_quant import e4m3_to_f16_div256, quantize_fp8_triton
from tokenmill.kernels.triton.numerics import round_code, round_to, use_libdevice
from tokenmill.kernels.triton.splitk import device_facts, grouped_tile, k_slice, splitk_reduce_kernel

FP16_MAX = 65504.0
SMALL_M_MAX = 16  # split-K 16-row tiles up to here (cc >= 8.0)
LARGE_M_MIN = 1024  # W8A16 above this: dequantize + cuBLAS
# torch._scaled_mm's use_fast_accum (W8A8 above SMALL_M_MAX). True since session 12 on the H200
# (benchmarks/gpu/results/session12/visit2): per Llama-3.1-8B layer at M = 512 / 1024 / 4096, 203.7 / 381.5 /
# 1486.1 us against 216.5 / 412.3 / 1620.4 with promotion (bf16 F.linear: 301.3 / 580.2 / 2528.6;
# `python benchmarks/gpu/large_m_paths.py`); offline (1000 prompts, the FP8 checkpoint) 12,009 output tok/s
# against 10,862. False promotes every 128-deep partial sum to float32.
SCALED_MM_FAST_ACCUM = True
SMALL_M_MAX_CC70 = 8  # cc < 8.0: float32 FMAs up to here, dequantize + cuBLAS above
# M <= FP8_GEMV_M_MAX (every capability; per-tensor / per-channel weights that `fp8_gemv.gemv_supported` takes):
# the FMA GEMV (`fp8_gemv.py`). Tiles by M's power of two: (block_n, words per step, warps, prefetch), chosen
# from the sm_90 SASS of the K loop (fp8_gemv's docstring): M = 1 runs 2.9 instructions per weight byte, M = 2 4.1 (8 rows
# of W per thread, so decoding x costs little per weight), both well under the ~7 an H200 issues per byte read
# at 4.8 TB/s (132 SMs x 4 warp instructions per clock x 32 lanes at 1.98 GHz); M = 4 needs 7.4 (the tile is
# register-bound at 4 rows of W per thread) and stays on the tl.dot GEMM. Programs: ~FP8_GEMV_WARPS_PER_SM
# warps per SM, so 132 x 12 x 4 KB of weight loads are in flight (more than HBM's ~5 MB bandwidth-delay
# product); K is split until then (at least two steps per slice).
# Off (0) since its H200 run (session 10, `python benchmarks/gpu/fp8_gemm.py --graphs --sweep-gemv`,
# benchmarks/gpu/results/session10/visit2/fp8gemv-graphs.log): per Llama-3.1-8B layer at M = 1 the planned
# tiles took 142.4 us and the best of 13 configurations 109.6, against 102.1 for the split-K tl.dot GEMM and
# 131.2 for bf16 (floor 45.4); end to end, TPOT 5.24 ms with it against 3.97 without. Pass gemv_m_max to use it.
FP8_GEMV_M_MAX = 0
FP8_GEMV_TILES = {1: (64, 16, 1, False), 2: (128, 16, 2, False), 4: (64, 16, 2, False)}
FP8_GEMV_WARPS_PER_SM = 12

# Scale modes of the GEMM kernel (A = activations, B = weight).
A_NONE, A_TENSOR, A_ROW, A_GROUP = 0, 1, 2, 3
B_TENSOR, B_ROW, B_BLOCK = 1, 2, 3
_B_MODE = {"tensor": B_TENSOR, "channel": B_ROW, "block": B_BLOCK}


@triton.jit
def fp8_matmul_kernel(
    a_ptr,  # [M, K]: float8_e4m3fn when A_FP8, else float16 / bfloat16 / float32
    b_ptr,  # [N, K]: float8_e4m3fn when A_FP8, else its uint8 bits
    a_scale_ptr,  # float32: [1] (A_TENSOR), [M, *] (A_ROW, A_GROUP)
    b_scale_ptr,  # float32: [1] (B_TENSOR), [N] (B_ROW), [ceil(N / SBN), ceil(K / SBK)] (B_BLOCK)
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N], or float32 partials [SPLIT_K, M, N] when PARTIAL
    M, N, K, k_tiles_per_split, scale_block_n, scale_block_k,
    stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_asg, stride_bsn, stride_bsk,
    stride_os, stride_om, stride_on,
    A_FP8: tl.constexpr,
    A_SCALE: tl.constexpr,
    B_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,  # tl.dot, or float32 broadcast-multiply-sum (cc < 8.0, tiny M)
    IEEE_FP32: tl.constexpr,  # exact float32 dots (no TF32): float32 x, and bfloat16 x in the interpreter
    PARTIAL: tl.constexpr,
    CLAMP_FP16: tl.constexpr,
    ROUND: tl.constexpr,  # numerics.round_code of out's dtype: round to nearest even by bit ops
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides scale_block_k when a scale varies along K
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile (of one K slice when PARTIAL) of out = (A * a_scale) @ (B * b_scale)^T (+ bias):
    FP8 dots (A_FP8, W8A8) or B's e4m3 bits decoded to float16 in the kernel (weight-only), scales applied per
    K tile in float32 (block scales) or once at the end (tensor / row scales). Grid (tiles, SPLIT_K).
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k, k_start, k_end = k_slice(K, k_tiles_per_split, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(k_start, k_end):
        k0 = kt * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        b_mask = k_mask[:, None] & n_mask[None, :]
        if A_FP8:
            # sm_90's fp8 wgmma keeps ~14 bits of its running sum (Triton's default there lets it run over the
            # whole K loop): cap it at one K tile, so every BLOCK_K-deep partial product is added in float32.
            part = tl.dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), max_num_imprecise_acc=BLOCK_K)
        else:
            w = e4m3_to_f16_div256(tl.load(b_ptrs, mask=b_mask, other=0))
            if USE_DOT:
                if IEEE_FP32:
                    part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(a, w.to(tl.float32).to(a.dtype))  # exact; via float32 as the GPU does
            else:
                part = tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        if A_SCALE == 3:
            sa = tl.load(a_scale_ptr + offs_m * stride_asm + (k0 // scale_block_k) * stride_asg, mask=m_mask, other=0.0)
            part = part * sa[:, None]
        if B_SCALE == 3:
            sb = tl.load(b_scale_ptr + (offs_n // scale_block_n) * stride_bsn + (k0 // scale_block_k) * stride_bsk,
                         mask=n_mask, other=0.0)
            part = part * sb[None, :]
        acc += part
    # Scales constant along K, applied once (linear, so split-K partials may carry them).
    if not A_FP8:
        acc = acc * 256.0  # e4m3_to_f16_div256 decoded value / 256
    if A_SCALE == 1:
        acc = acc * tl.load(a_scale_ptr)
    if A_SCALE == 2:
        acc = acc * tl.load(a_scale_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)[:, None]
    if B_SCALE == 1:
        acc = acc * tl.load(b_scale_ptr)
    if B_SCALE == 2:
        acc = acc * tl.load(b_scale_ptr + offs_n * stride_bsn, mask=n_mask, other=0.0)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc,
                 mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if CLAMP_FP16:
            acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
                 round_to(acc, ROUND).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_dequantize_kernel(b_ptr, scale_ptr, out_ptr, N, K, scale_block_n, scale_block_k,
                          stride_bn, stride_bk, stride_sn, stride_sk, stride_on, stride_ok,
                          B_SCALE: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = e4m3(b[n, k]) * scale (tensor / row / block), float32 product rounded once to out's dtype."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    bits = tl.load(b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk, mask=mask, other=0)
    w = e4m3_to_f16_div256(bits).to(tl.float32) * 256.0
    if B_SCALE == 1:
        w = w * tl.load(scale_ptr)
    if B_SCALE == 2:
        w = w * tl.load(scale_ptr + offs_n * stride_sn, mask=offs_n < N, other=0.0)[:, None]
    if B_SCALE == 3:
        w = w * tl.load(scale_ptr + (offs_n // scale_block_n)[:, None] * stride_sn
                        + (offs_k // scale_block_k)[None, :] * stride_sk, mask=mask, other=0.0)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok, round_to(w, ROUND).to(out_ptr.dtype.element_ty),
             mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Host side


@dataclass(frozen=True)
class Fp8GemmPlan:
    """How one FP8 GEMM runs: `path` "scaled_mm" | "triton" | "gemv" | "cublas", and the Triton launch settings.

    "gemv" (`fp8_gemv.fp8_gemv`): block_m is BLOCK_M (1, 2 or 4), block_k the K columns per step (4 per word),
    prefetch its PREFETCH.
    """

    path: str
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    split_k: int = 1
    use_dot: bool = True
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False


def block_k_for_scales(scale_block_k: int | None, preferred: int) -> int:
    """Largest power of two <= preferred dividing scale_block_k (one scale per K tile), at least 16.

    Raises:
        ValueError: scale_block_k has no power-of-two divisor >= 16.
    """
    if scale_block_k is None:
        return preferred
    bk = preferred
    while bk > 16 and scale_block_k % bk:
        bk //= 2
    if scale_block_k % bk:
        raise ValueError(f"FP8 block scales along K need a block size that is a multiple of 16, not {scale_block_k}.")
    return bk


def plan_fp8_gemm(m: int, n: int, k: int, w8a8: bool, capability: tuple[int, int], num_sms: int,
                  scale_block_k: int | None = None, small_m_max: int | None = None,
                  large_m_min: int | None = None, split_k: int | None = None,
                  gemv_m_max: int | None = None) -> Fp8GemmPlan:
    """Tiles for x [m, k] @ W^T [k, n] (W8A8 fp8 dots, or W8A16 decode-in-loop) on a device of `capability`.

    scale_block_k: the K extent of a scale block when scales vary along K (block weights, token groups).
    small_m_max / large_m_min / gemv_m_max / split_k override the thresholds and the K slices (tests); pass
    gemv_m_max=0 for weights `fp8_gemv.gemv_supported` does not take.
    M <= gemv_m_max (default FP8_GEMV_M_MAX), no scale_block_k, K a multiple of 4: the FMA GEMV with
    FP8_GEMV_TILES[M's power of two], K split until ~FP8_GEMV_WARPS_PER_SM warps per SM (any capability).
    H200-class tiles: small M 16 x 64 x 128 split along K until ~4 programs per SM (decode streams the
    weight from every SM); medium M 32/64-row tiles; large M 128 x 128 (fp8: 128-deep K tiles, one scale
    block each). cc < 8.0 (W8A16 only, one stage, no cp.async): BLOCK_M = next power of two of M <= 8,
    and the float32 [BLOCK_M, BLOCK_K, BLOCK_N] product kept at 8K elements.
    """
    cc70 = tuple(capability) < (8, 0)
    small = small_m_max if small_m_max is not None else (SMALL_M_MAX_CC70 if cc70 else SMALL_M_MAX)
    large = large_m_min if large_m_min is not None else (SMALL_M_MAX_CC70 if cc70 else LARGE_M_MIN)
    gemv = FP8_GEMV_M_MAX if gemv_m_max is None else gemv_m_max  # 0 by default: off
    if 0 < m <= min(gemv, 4) and scale_block_k is None and k % 4 == 0:
        bm = triton.next_power_of_2(m)
        bn, kw, warps, prefetch = FP8_GEMV_TILES[bm]
        programs = max(1, FP8_GEMV_WARPS_PER_SM // warps) * num_sms
        split = choose_split_k(k, 4 * kw, triton.cdiv(n, bn), split_k, programs)
        return Fp8GemmPlan("gemv", bm, bn, 4 * kw, split, False, warps, 1, prefetch)
    if not w8a8 and m > small and (m > large or cc70):
        return Fp8GemmPlan("cublas")
    use_dot, warps, stages = True, 4, 3
    if m <= small and cc70:
        bm, bn = min(triton.next_power_of_2(max(m, 1)), 8), 64
        bk = block_k_for_scales(scale_block_k, max(16, 8192 // (bm * bn)) if bm > 1 else 128)
        use_dot, stages = False, 1
    elif m <= small:
        bm, bn, bk = 16, 64, block_k_for_scales(scale_block_k, 128)
    else:
        bm = 32 if m <= 32 else 64 if m <= 64 else 128
        bn, bk = 128, block_k_for_scales(scale_block_k, 128 if w8a8 else 64)
        warps = 8 if bm == 128 else 4
    tiles = triton.cdiv(max(m, 1), bm) * triton.cdiv(max(n, 1), bn)
    split_k = choose_split_k(k, bk, tiles, split_k, (4 if m <= small else 1) * num_sms)
    return Fp8GemmPlan("triton", bm, bn, bk, split_k, use_dot, warps, stages)


def choose_split_k(k: int, bk: int, tiles: int, split_k: int | None, programs: int) -> int:
    """K slices: `split_k` if given, else enough for `programs` programs over `tiles` output tiles while every
    slice keeps at least two K tiles of bk; clamped to the K tiles and evened out (no empty slice)."""
    k_tiles = max(1, triton.cdiv(k, bk))
    if split_k is None:
        split_k = max(1, min(programs // tiles, k_tiles // 2 if k_tiles >= 4 else 1))
    split_k = max(1, min(split_k, k_tiles))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split_k))


def _scale_args(scale: torch.Tensor, mode: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, stride over rows, stride over K groups) of a scale for the kernel's modes."""
    if mode == A_NONE:
        return scale, 0, 0
    if mode in (A_TENSOR, B_TENSOR):
        return scale.reshape(1), 0, 0
    if mode in (A_ROW, B_ROW):
        s = scale.reshape(-1)
        return s, s.stride(0), 0
    return scale, scale.stride(0), scale.stride(1)


def _launch(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor | None, a_mode: int, b_scale: torch.Tensor,
            b_mode: int, scale_block: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype,
            plan: Fp8GemmPlan) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    a_fp8 = a.dtype == torch.float8_e4m3fn
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    k_tiles = max(1, triton.cdiv(k, plan.block_k))
    per = triton.cdiv(k_tiles, plan.split_k)
    partial = plan.split_k > 1
    target = torch.empty(plan.split_k, m, n, dtype=torch.float32, device=a.device) if partial else out
    sa, sam, sag = _scale_args(a_scale if a_scale is not None else b_scale, a_mode)
    sb, sbn, sbk = _scale_args(b_scale, b_mode)
    clamp = out_dtype == torch.float16
    grid = (triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n), plan.split_k)
    fp8_matmul_kernel[grid](
        a, b, sa, sb, bias if bias is not None else sb, target,
        m, n, k, per, scale_block[0], scale_block[1],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), sam, sag, sbn, sbk,
        target.stride(0) if partial else 0, target.stride(-2), target.stride(-1),
        A_FP8=a_fp8, A_SCALE=a_mode, B_SCALE=b_mode, HAS_BIAS=bias is not None, USE_DOT=plan.use_dot,
        IEEE_FP32=a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and not use_libdevice(a)), PARTIAL=partial, CLAMP_FP16=clamp,
        ROUND=round_code(out_dtype), BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if partial:
        block = 1024
        splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            target, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=plan.split_k, HAS_BIAS=bias is not None, CLAMP_FP16=clamp,
            ROUND=round_code(out_dtype), BLOCK=block, num_warps=4,
        )
    return out


def dequantize_fp8_triton(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight of `w` in `dtype` (Triton; equal to `kernels.fp8.dequantize_fp8_weight`).

    Raises:
        ValueError: the scale does not fit the weight (`kernels.fp8.weight_scheme`).
    """
    mode = _B_MODE[weight_scheme(w)]
    bits = fp8_bits(w.weight)
    n, k = bits.shape
    out = torch.empty(n, k, dtype=dtype, device=bits.device)
    s, ssn, ssk = _scale_args(w.scale.float(), mode)
    bn_s, bk_s = w.block_size or (1, 1)
    if n and k:
        fp8_dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 64))](
            bits, s, out, n, k, bn_s, bk_s, bits.stride(0), bits.stride(1), ssn, ssk, out.stride(0), out.stride(1),
            B_SCALE=mode, ROUND=round_code(dtype), BLOCK_N=32, BLOCK_K=64, num_warps=4,
        )
    return out


def _cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != torch.float16:
        return F.linear(x, weight, bias)
    # float16: float32 result (cuBLAS' reduced-precision reductions cannot overflow), clamp, cast.
    y = torch.mm(x, weight.t(), out_dtype=torch.float32) if x.is_cuda else x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)


def scaled_mm_supported(x: torch.Tensor, w: Fp8Weight, capability: tuple[int, int]) -> bool:
    """True when `torch._scaled_mm` (row-wise) takes this W8A8 product: CUDA cc >= 8.9, bfloat16 x,
    per-tensor / per-channel weight [N, K] row-major, K and N multiples of 16."""
    n, k = w.weight.shape
    return (x.is_cuda and tuple(capability) >= (8, 9) and x.dtype == torch.bfloat16 and w.block_size is None
            and k % 16 == 0 and n % 16 == 0 and w.weight.dtype == torch.float8_e4m3fn
            and w.weight.stride() == (k, 1))


def scaled_mm_rowwise(xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [M, N] = (x_scale * xq) @ (w.scale * w.weight)^T (+ bias) through `torch._scaled_mm`, row-wise scales.

    xq [M, K] float8_e4m3fn row-major; x_scale float32 [M, 1] or [1] (static, expanded); w per-tensor or
    per-channel. W^T is passed as the column-major view of W [N, K]; scale_b is the weight scale as a
    contiguous [1, N] float32 row (a per-tensor scale repeated). bias must be in out_dtype to be fused.
    """
    m = xq.shape[0]
    n = w.weight.shape[0]
    sa = x_scale.float().reshape(-1, 1)
    if sa.shape[0] != m:
        sa = sa.expand(m, 1).contiguous()
    sb = w.scale.float().reshape(1, -1)
    if sb.shape[1] != n:
        sb = sb.expand(1, n)
    sb = sb.contiguous()
    fuse = bias is None or bias.dtype == out_dtype
    y = torch._scaled_mm(xq, w.weight.t(), scale_a=sa, scale_b=sb, bias=bias if fuse else None, out_dtype=out_dtype,
                         use_fast_accum=SCALED_MM_FAST_ACCUM)
    return y if fuse else (y.float() + bias.float()).to(out_dtype)


def fp8_linear_triton(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                      quantize_activations: bool = True, *, capability: tuple[int, int] | None = None,
                      use_scaled_mm: bool = True, small_m_max: int | None = None, large_m_min: int | None = None,
                      split_k: int | None = None, gemv_m_max: int | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for an FP8 weight (module docstring for the paths), CUDA or the interpreter.

    Args:
        x: [M, K] float16 / bfloat16 / float32, any strides.
        w: FP8 weight [N, K] with per-tensor, per-channel or block scales (`kernels.fp8.Fp8Weight`).
        bias: [N] or None.
        quantize_activations: W8A8 (x quantized per token, per token-group for blocks, or with
            w.input_scale) where the capability has FP8 arithmetic (>= 8.9); False, or cc < 8.9: W8A16.
        capability: plan for this capability instead of the device's effective one (tests).
        use_scaled_mm: allow `torch._scaled_mm` (False: the Triton W8A8 GEMM; tests, benchmarks).
        small_m_max, large_m_min, split_k, gemv_m_max: override the plan's thresholds / K slices (tests,
            benchmarks; gemv_m_max=0 keeps M <= FP8_GEMV_M_MAX off the GEMV).

    Returns:
        [M, N] in x's dtype. Numerically `kernels.fp8.fp8_linear_reference(x, w, bias, W8A8?)` up to
        float32 summation order.

    Raises:
        ValueError: x is not [M, K], or the weight's scale / block size does not fit it.
    """
    scheme = weight_scheme(w)
    n, k = w.weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for an FP8 weight [{n}, {k}], not {tuple(x.shape)}.")
    cap, sms = device_facts(x.device)
    cap = capability or cap
    w8a8 = quantize_activations and tuple(cap) >= (8, 9)
    m = x.shape[0]
    block = w.block_size
    gemv = gemv_m_max if gemv_supported(w.weight, block) else 0
    hw_cvt = tuple(cap) >= (8, 9) and use_libdevice(x)  # the GEMV's PTX FP8 conversion (compiled, cc >= 8.9)
    if w8a8:
        if w.input_scale is not None:
            xq, xs = quantize_fp8_triton(x, scale=w.input_scale)
            a_mode = A_TENSOR
        elif block is not None:
            xq, xs = quantize_fp8_triton(x, group_size=block[1])
            a_mode = A_GROUP
        else:
            xq, xs = quantize_fp8_triton(x)
            a_mode = A_ROW
        small = small_m_max if small_m_max is not None else SMALL_M_MAX  # the plan's own threshold
        if use_scaled_mm and m > small and scaled_mm_supported(x, w, cap):
            return scaled_mm_rowwise(xq, xs, w, bias, x.dtype)
        plan = plan_fp8_gemm(m, n, k, True, cap, sms, block[1] if block else None, small_m_max, large_m_min, split_k,
                             gemv)
        if plan.path == "gemv":
            return fp8_gemv(xq, w.weight, w.scale, xs, bias, x.dtype, plan.block_m, plan.block_n, plan.block_k,
                            plan.split_k, plan.num_warps, hw_cvt, plan.prefetch)
        return _launch(xq, w.weight, xs, a_mode, w.scale.float(), _B_MODE[scheme], block or (1, k), bias, x.dtype, plan)
    plan = plan_fp8_gemm(m, n, k, False, cap, sms, block[1] if block else None, small_m_max, large_m_min, split_k,
                         gemv)
    if plan.path == "cublas":
        return _cublas_linear(x, dequantize_fp8_triton(w, x.dtype), bias)
    if plan.path == "gemv":
        return fp8_gemv(x, w.weight, w.scale, None, bias, x.dtype, plan.block_m, plan.block_n, plan.block_k,
                        plan.split_k, plan.num_warps, hw_cvt, plan.prefetch)
    return _launch(x, fp8_bits(w.weight), None, A_NONE, w.scale.float(), _B_MODE[scheme], block or (1, k), bias,
                   x.dtype, plan)
