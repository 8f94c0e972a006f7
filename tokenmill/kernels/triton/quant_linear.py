"""int4/int8 weight-only quantized linear layers on CUDA (Triton): y = x @ dequantize(w)^T (+ bias).

The weight is in tokenmill's one layout (`kernels/quant_pack.py`): W [N, K],
`qweight` int32 [N, ceil(K / p)] packed along K (p = 32 // bits values per
word, low bits first), `scales` [N, ngroups], `qzeros` uint8 [N, ngroups] or
None (zero 2^(bits-1)), `g_idx` int32 [K] or None (group k // G), and

    W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]

Three paths, picked from M (rows of x) and the device's compute capability
(`platforms.cuda.effective_capability`, so TOKENMILL_FORCE_CC70=1 takes the
cc-7.0 paths on any GPU):

All Triton GEMM paths share one inner step (`_accumulate_tile`): a
[BLOCK_N, 16 words] tile of `qweight` (64 contiguous bytes per row) is
loaded once and split by the position j of a value inside its word; the
values at shift j * bits are the K columns k0 + w * p + j, so the tile's
product is p products of K = 16 (the smallest tl.dot) with the matching
K-strided rows of x. The result is computed transposed, acc^T [BLOCK_N,
BLOCK_M] = W_tile @ x_tile^T ("swap AB"), so the dequantized weight is the
dot's A operand straight from registers and the few rows of x sit on the B
side. (The two obvious alternatives, re-loading each word once per value or
unpacking into [N, K] with tl.reshape, spill registers at these tiles:
checked with ptxas -v.)

- tiny M (GEMV, M <= GEMV_M_MAX, no act-order): `quant_gemv.quant_gemv_kernel`,
  float32 FMAs with the values turned into floats by bit operations (no
  int->float instructions), partial sums per thread reduced once after the
  K loop; K slices as in split-K below (its module docstring has the math).
- decode-sized M on cc >= 8.0 (GEMV_M_MAX < M <= DOT_M_MAX; 4-bit, no act-order,
  one group per 128-deep K tile): `quant_dot.quant_dot_kernel`, the words
  dequantized by a few packed PTX instructions into a tensor-core operand,
  K slices as in split-K below.
- small M (split-K, the rest up to SMALL_M_MAX): one program per (M tile, N tile, K slice). Decode is
  memory-bound: each program streams its slice of the packed words once
  (bits/16 of the bf16 bytes: a quarter for 4-bit, plus scales and zeros).
  The K slices write float32 partials [SPLIT_K, M, N] that a second small
  kernel sums in a fixed order (plus bias, cast); nothing is zeroed, no
  atomics, no host sync, shapes depend only on (M, N, K), so it is
  CUDA-graph safe and deterministic. cc >= 8.0: `tl.dot` on a 16-row tile
  (tensor cores; the padded rows are free when memory-bound); cc < 8.0:
  broadcast-multiply-and-sum in float32 (tl.dot there is plain FMA over the
  padded rows, wasting up to 16x the arithmetic).
- medium M (cc >= 8.0 only): the same kernel with 32-128-row tiles
  (split-K only while the output tiles cannot fill the GPU).
- batch-sized M (LARGE_M_MIN < M <= TC_M_MAX; cc >= 8.0, no act-order): `quant_gemm_tc.py`, an output-tiled
  tensor-core GEMM that unpacks the weight tile in registers (off while TC_M_MAX is 0).
- large M, and every M above small on cc < 8.0 (Triton's tl.dot has no
  tensor cores on Volta, shared/PLATFORMS.md): dequantize W into x's dtype
  with a Triton kernel, then cuBLAS (`F.linear`). The dequantized copy is a
  temporary of N * K elements.

Numerics: products are accumulated in float32 on every path. For tl.dot the
dequantized weight is rounded once to x's dtype, exactly as
`quant_pack.dequantize(..., dtype=x.dtype)`; float32 activations use IEEE
float32 dots (no TF32). float16 overflow guard: besides float32
accumulation, the cuBLAS path multiplies in float16 with a float32 result
(`torch.mm(out_dtype=float32)`, so cuBLAS' reduced-precision split-K
reductions cannot overflow), and every float16 result is clamped to
+-65504 before the cast (a sum past the float16 range saturates instead of
becoming inf and poisoning the next layer). A dequantized weight is at most
(2^bits - 1) * max|scale|, finite in float16 for any scale below 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.quant_pack import QuantTensors, pack_factor
from tokenmill.kernels.triton.quant_dot import dot_supported, quant_dot_kernel
from tokenmill.kernels.triton.quant_gemm_tc import quant_gemm_tc, tc_supported
from tokenmill.kernels.triton.quant_gemv import gemv_supported, quant_gemv_kernel, words_per_group
from tokenmill.kernels.triton.splitk import device_facts, grouped_tile, k_slice, splitk_reduce_kernel, store_tile

FP16_MAX = 65504.0

# Every launch setting below can be overridden per call with `quant_linear(plan=QuantLinearPlan(...))`;
# benchmarks/gpu/sweep_quant.py measures the grid that these defaults are picked from.
# M thresholds (rows of x). cc >= 8.0: M <= SMALL_M_MAX -> split-K GEMV-like kernel with 16-row dot tiles
# (one tile covers all of M, so every weight byte is read once per call); M <= LARGE_M_MIN -> tiled
# dequant-in-loop GEMM; above -> dequantize + cuBLAS, whose tensor-core GEMM beats a Triton kernel that
# also unpacks once the dequantization (N * K elements written and read once) is small next to the
# 2 * M * N * K FLOPs. cc < 8.0: M <= SMALL_M_MAX_CC70 -> split-K with float32 FMAs (memory-bound up to
# about 8 rows on a V100: 8 FMAs per 4-bit weight at 15.7 TFLOP/s vs 900 GB/s); above -> dequantize + cuBLAS.
# Set from the H200 sweep (benchmarks/gpu/sweep_quant.py, log in benchmarks/gpu/results/session7/sweep.log):
# split-K with 16- or 32-row dot tiles won every M <= 32, the tiled kernel at M = 64, dequantize + cuBLAS
# from M = 128 on (the tiled kernel was 1.3-3.7x slower than it there). On the cc-7.0 path (fp16) the
# GEMV kernel won at M = 1 and dequantize + cuBLAS from M = 4 on.
SMALL_M_MAX = 32
LARGE_M_MIN = 64
SMALL_M_MAX_CC70 = 1
# M <= GEMV_M_MAX (cc >= 8.0) / GEMV_M_MAX_CC70 (cc < 8.0): the FMA GEMV (`quant_gemv.py`), for weights without
# act-order. Launch settings: output rows per program, packed words per K step, warps, stages, programs wanted
# per SM (divided by the power of two of M). H200 sweep (benchmarks/gpu/results/session8/sweep2.log): one-warp
# programs of 32 rows x 16 words won at M = 1 (1.33-1.67x faster than bf16 F.linear) with ~16 programs per SM,
# and at M = 2 with ~8 (level with or ahead of split-K). From M = 2 the tensor-core GEMV below is faster on
# three of Llama-3.1-8B's four layer shapes (o: 15.0 vs the GEMV's 14.6 us; session9/visit2/sweep.log), so it
# takes M = 2 where it applies; other weights keep the GEMV up to GEMV_M_MAX_NO_DOT.
GEMV_M_MAX = 1
GEMV_M_MAX_NO_DOT = 2
GEMV_M_MAX_CC70 = 1
GEMV_BLOCK_N = 32
GEMV_BLOCK_KW = 16
GEMV_WARPS = 1
GEMV_STAGES = 1
GEMV_PROGRAMS_PER_SM = 16
# Register prefetch of the next K step in the GEMV (`quant_gemv_kernel`'s PREFETCH): off until an H200 run of
# benchmarks/gpu/gemv_probe.py shows it ahead (not yet measured; offline_bench.py --override can turn it on).
GEMV_PREFETCH = False
# GEMV_M_MAX < M <= DOT_M_MAX (cc >= 8.0; 4-bit, no act-order, group size a multiple of DOT_BLOCK_K): the
# tensor-core GEMV (`quant_dot.py`, PTX dequantization, one tl.dot per K tile). Tiles per M range: (largest M,
# block_n, warps, stages, programs per SM); block_m is M's power of two, at least 16. H200 sweep
# (benchmarks/gpu/results/session9/visit2/sweep.log, Llama-3.1-8B shapes, W4A16 g128): M = 2..16 with
# 64-wide two-warp tiles: qkv 17.7-18.3 us, o 15.0-15.3, gate_up 56.1-59.8, down 32.0-35.1; split-K took
# 1.04-1.33x as long (o 1.04-1.10x, gate_up 1.30-1.33x); against bf16 F.linear 0.83-0.92x for qkv / o and
# 0.94-1.06x for gate_up / down; M = 32 and 64: split-K / tiled took 1.03-1.12x and 1.13-1.20x as long; from
# M = 128 dequantize + cuBLAS (M = 256: 45 us vs 92 for the best tensor-core tile on qkv).
DOT_M_MAX = 64
# LARGE_M_MIN < M <= TC_M_MAX (cc >= 8.0, no act-order, group -1 or a multiple of 16): the unpacking tensor-core
# GEMM (`quant_gemm_tc.py`) instead of dequantize + cuBLAS. 0 = off: on the H200 it took 0.12-0.17x of bf16's
# speed per Llama-3.1-8B layer at M = 128..4096, slower than dequantize + cuBLAS everywhere (session 12,
# benchmarks/gpu/results/session12/visit3/large-m.log, column q4_tc). Rewritten in session 13 (its docstring),
# its best tiles reached 0.21-0.33x of bf16, still behind dequantize + cuBLAS (0.39-0.90x) at every M
# (benchmarks/gpu/results/session13/visit3/large-m-tc.log); off until `large_m_paths.py` shows it ahead.
TC_M_MAX = 0
DOT_TILES = ((32, 64, 2, 4, 8), (64, 128, 4, 3, 2))
DOT_BLOCK_K = 128


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_n, n_mask, k0, K, group_size,
                  stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
                  BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_MODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized float32 tile [BLOCK_N, BLOCK_K] of W (rows n = offs_n, columns k = k0 + arange(BLOCK_K));
    the dequantize kernel's tile (the GEMM kernels use `_accumulate_tile`, which needs no reshape).

    Reads each int32 word once: a [BLOCK_N, BLOCK_K / p] tile, contiguous along K (vector loads), unpacked
    with shifts into [BLOCK_N, BLOCK_K / p, p] and reshaped row-major (k = word * p + j, low bits first).
    Columns k >= K are finite (bits past K are zero, masked scales 0); the caller masks x there.
    GROUP_MODE 0: the whole tile lies in group k0 // group_size (group_size a multiple of BLOCK_K, or
    >= K); 1: group k // group_size per column; 2: act-order, group g_idx[k] per column.
    """
    P: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // P
    MIDPOINT: tl.constexpr = (1 << (BITS - 1)) * 1.0  # the zero point of symmetric weights
    offs_w = k0 // P + tl.arange(0, BLOCK_W)
    words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :] * stride_qk,
                    mask=n_mask[:, None] & (offs_w < tl.cdiv(K, P))[None, :], other=0)
    shifts = tl.arange(0, P) * BITS
    q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (offs_n.shape[0], BLOCK_K))
    if GROUP_MODE == 0:
        g = k0 // group_size
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_mask, other=0).to(tl.float32)[:, None]
        else:
            z = MIDPOINT
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = n_mask[:, None] & k_mask[None, :]
        if GROUP_MODE == 1:
            g = offs_k // group_size
        else:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :] * stride_zg, mask=mask, other=0).to(tl.float32)
        else:
            z = MIDPOINT
    return (q.to(tl.float32) - z) * s


@triton.jit
def _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, g, g_mask, stride_sn, stride_sg, stride_zn, stride_zg,
                  BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, PER_COLUMN: tl.constexpr):
    """float32 scales and zero points of rows offs_n in group g: [BLOCK_N, 1] for a scalar g, or
    [BLOCK_N, len(g)] for a vector g (PER_COLUMN); zero 2^(BITS-1) without zero points."""
    if PER_COLUMN:
        mask = n_mask[:, None] & g_mask[None, :]
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg, mask=mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :] * stride_zg, mask=mask, other=0)
        else:
            z = tl.full((1, 1), 1 << (BITS - 1), tl.int32)
    else:
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_mask, other=0)[:, None]
        else:
            z = tl.full((1, 1), 1 << (BITS - 1), tl.int32)
    return s.to(tl.float32), z.to(tl.float32)


@triton.jit
def _accumulate_tile(acc, x_ptr, rows, row_mask, stride_xm, stride_xk, qw_ptr, s_ptr, z_ptr, g_ptr, offs_n, n_mask,
                     k0, K, group_size, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
                     BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_MODE: tl.constexpr, USE_DOT: tl.constexpr,
                     IEEE_FP32: tl.constexpr, BLOCK_K: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc^T [BLOCK_N, R] += W[offs_n, k0:k0+BLOCK_K] @ x[rows, k0:k0+BLOCK_K]^T, W dequantized in registers.

    The [BLOCK_N, BLOCK_K / p] tile of packed words is loaded once (contiguous along K: vector loads) and
    split by the position j of a value inside its word: the values at shift j * BITS are the K columns
    k0 + w * p + j (w = 0 .. BLOCK_K / p - 1), so the product is p smaller products, each with the
    matching K-strided rows of x (x is tiny next to W and comes from L1/L2). No reshape, no re-read.
    The dequantized weight is the dot's A operand, straight from registers; x^T the B operand.
    GROUP_MODE 0: one group for the whole tile (k0 // group_size); 1: group (k0 + w * p) // group_size,
    the same for every j because group_size is a multiple of p; 2: act-order, g_idx[k] per column.
    ONE_DOT (with USE_DOT): instead unpack the words into a [BLOCK_N, BLOCK_K] tile (tl.reshape, k = word * p
    + j) and issue one tl.dot with K = BLOCK_K (fewer, larger MMAs; more registers).
    """
    P: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // P
    offs_w = k0 // P + tl.arange(0, BLOCK_W)
    words = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :] * stride_qk,
                    mask=n_mask[:, None] & (offs_w < tl.cdiv(K, P))[None, :], other=0)
    if ONE_DOT and USE_DOT:
        shifts = tl.arange(0, P) * BITS
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), (offs_n.shape[0], BLOCK_K))
        offs_kk = k0 + tl.arange(0, BLOCK_K)
        kk_mask = offs_kk < K
        if GROUP_MODE == 0:
            s1, z1 = _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, k0 // group_size, n_mask,
                                   stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, False)
        elif GROUP_MODE == 1:
            s1, z1 = _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, offs_kk // group_size, kk_mask,
                                   stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, True)
        else:
            gk = tl.load(g_ptr + offs_kk, mask=kk_mask, other=0)
            s1, z1 = _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, gk, kk_mask,
                                   stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, True)
        w1 = (q.to(tl.float32) - z1) * s1  # [BLOCK_N, BLOCK_K]
        xk = tl.load(x_ptr + rows[None, :] * stride_xm + offs_kk[:, None] * stride_xk,
                     mask=kk_mask[:, None] & row_mask[None, :], other=0.0)  # [BLOCK_K, R]
        if IEEE_FP32:
            acc += tl.dot(w1, xk, input_precision="ieee")
        else:
            acc += tl.dot(w1.to(xk.dtype), xk)
    else:
        if GROUP_MODE == 0:
            s, z = _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, k0 // group_size, n_mask,
                                 stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, False)
        elif GROUP_MODE == 1:
            s, z = _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, (offs_w * P) // group_size, offs_w * P < K,
                                 stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, True)
        for j in tl.static_range(P):
            offs_k = offs_w * P + j
            k_mask = offs_k < K
            if GROUP_MODE == 2:
                g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
                s, z = _scales_zeros(s_ptr, z_ptr, offs_n, n_mask, g, k_mask,
                                     stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, True)
            w = (((words >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32) - z) * s  # [BLOCK_N, BLOCK_W]
            if USE_DOT:
                xt = tl.load(x_ptr + rows[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                             mask=k_mask[:, None] & row_mask[None, :], other=0.0)  # [BLOCK_W, R]
                if IEEE_FP32:
                    acc += tl.dot(w, xt, input_precision="ieee")
                else:
                    acc += tl.dot(w.to(xt.dtype), xt)
            else:
                x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [R, BLOCK_W]
                acc += tl.sum(w[:, None, :] * x.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def quant_matmul_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    qw_ptr,  # int32 [N, ceil(K / p)]
    s_ptr,  # [N, ngroups]
    z_ptr,  # uint8 [N, ngroups] (read when HAS_ZEROS)
    g_ptr,  # int32 [K] (read when GROUP_MODE == 2)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or float32 partials [SPLIT_K, M, N] when PARTIAL
    M, N, K, group_size, k_tiles_per_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_os, stride_om, stride_on,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,  # tl.dot (tensor cores on cc >= 8.0) or float32 broadcast-multiply-sum
    IEEE_FP32: tl.constexpr,  # exact float32 dots for float32 activations
    PARTIAL: tl.constexpr,  # write float32 partials of this K slice (split-K)
    CLAMP_FP16: tl.constexpr,
    ONE_DOT: tl.constexpr,  # `_accumulate_tile`'s single-dot variant
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over K tiles [k_start, k_end) of slice program_id(1).

    Computed transposed, acc^T [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @ x_tile^T: the dequantized
    weight tile stays in registers as the dot's A operand (no transpose of the big tile) and the few rows
    of x go to the B side ("swap AB" for small M).
    """
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k, k_start, k_end = k_slice(K, k_tiles_per_split, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    offs_m = offs_m.to(tl.int64)  # row offsets of x / out may pass 2^31 elements at large M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(k_start, k_end):
        acc = _accumulate_tile(acc, x_ptr, offs_m, m_mask, stride_xm, stride_xk, qw_ptr, s_ptr, z_ptr, g_ptr,
                               offs_n, n_mask, kt * BLOCK_K, K, group_size, stride_qn, stride_qk, stride_sn, stride_sg,
                               stride_zn, stride_zg, BITS, HAS_ZEROS, GROUP_MODE, USE_DOT, IEEE_FP32, BLOCK_K,
                               ONE_DOT)
    store_tile(acc, out_ptr, bias_ptr, pid_k, offs_m, offs_n, offs_n, n_mask, n_mask[:, None] & m_mask[None, :],
                stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL, CLAMP_FP16)


@triton.jit
def dequantize_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, group_size,
                      stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg,
                      stride_ze, stride_zn, stride_zg, stride_ge, stride_oe, stride_on, stride_ok,
                      BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_MODE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, n, k] = (q - z) * s in out's dtype (float32 product, one rounding), one [BLOCK_N, BLOCK_K] tile."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w = _dequant_tile(qw_ptr + e * stride_qe, s_ptr + e * stride_se, z_ptr + e * stride_ze, g_ptr + e * stride_ge,
                      offs_n, n_mask, pid_k * BLOCK_K, K, group_size,
                      stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, GROUP_MODE,
                      BLOCK_K)
    ptrs = out_ptr + e * stride_oe + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


# ---------------------------------------------------------------------------------------------------------
# Host side


def check_quant_tensors(w: QuantTensors, experts: bool = False) -> None:
    """Raise ValueError (one sentence) when `w`'s tensors disagree with its bits / group size / in_features.

    experts: `w` carries a leading expert dim E.
    """
    p = pack_factor(w.bits)
    k = w.in_features
    lead = 1 if experts else 0
    if w.qweight.dim() != 2 + lead or w.qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 with {2 + lead} dims, not {w.qweight.dtype} {tuple(w.qweight.shape)}.")
    if w.qweight.shape[-1] != -(-k // p):
        raise ValueError(f"qweight has {w.qweight.shape[-1]} words per row; {k} {w.bits}-bit inputs need {-(-k // p)}.")
    g = k if w.group_size == -1 else w.group_size
    if g <= 0:
        raise ValueError(f"group_size must be positive or -1, not {w.group_size}.")
    ngroups = -(-k // g)
    if w.g_idx is None and tuple(w.scales.shape) != (*w.qweight.shape[:-1], ngroups):
        raise ValueError(f"scales has shape {tuple(w.scales.shape)}; expected {(*w.qweight.shape[:-1], ngroups)}.")
    if w.g_idx is not None and (w.scales.shape[:-1] != w.qweight.shape[:-1] or w.g_idx.shape[-1] != k):
        raise ValueError(f"act-order scales {tuple(w.scales.shape)} / g_idx {tuple(w.g_idx.shape)} do not fit "
                         f"qweight {tuple(w.qweight.shape)} with {k} inputs.")
    if w.qzeros is not None and w.qzeros.shape != w.scales.shape:
        raise ValueError(f"qzeros has shape {tuple(w.qzeros.shape)}; it must match scales {tuple(w.scales.shape)}.")


def kernel_groups(w: QuantTensors, block_k: int, packed_groups: bool = True) -> tuple[int, int, torch.Tensor | None]:
    """(GROUP_MODE, group size, g_idx) that the kernels read for `w` with K tiles of `block_k`.

    0: one group per K tile (group size a multiple of block_k, or one group over K); 1: group per packed
    word, `_accumulate_tile` (needs the group size to be a multiple of p) or per column, `_dequant_tile`
    (packed_groups False); 2: a g_idx gather, `w.g_idx`, or k // G built here for a group size that is
    not a multiple of p (no checkpoint format writes one; the tensor is made per call).
    """
    if w.g_idx is not None:
        return 2, max(w.group_size, 1), w.g_idx
    k = w.in_features
    g = k if w.group_size == -1 else w.group_size
    if g >= k or g % block_k == 0:
        return 0, g, None
    if not packed_groups or g % pack_factor(w.bits) == 0:
        return 1, g, None
    lead = w.qweight.shape[:-2]
    g_idx = (torch.arange(k, device=w.qweight.device, dtype=torch.int32) // g).expand(*lead, k)
    return 2, g, g_idx


@dataclass(frozen=True)
class QuantLinearPlan:
    """How `quant_linear` computes one call, and its launch settings.

    path: "gemv" (`quant_gemv_kernel`), "dot" (`quant_dot_kernel`), "splitk" / "tiled" (`quant_matmul_kernel`),
    "tc" (`quant_gemm_tc`, its own tiles), "cublas" (dequantize + F.linear). block_k is in K columns (for "gemv" BLOCK_KW = block_k // p packed words); split_k the number
    of K slices (float32 partials + `splitk_reduce_kernel` when > 1); use_dot False: float32 FMAs instead of
    tl.dot in `quant_matmul_kernel`. Pass one to `quant_linear(plan=...)` to override the planner (sweeps).
    """

    path: str
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    split_k: int = 0  # 0: from the programs wanted per SM (`finish_plan`)
    use_dot: bool = True
    num_warps: int = 4
    num_stages: int = 1
    one_dot: bool = False  # tiled/splitk: unpack the tile to [BLOCK_N, BLOCK_K] and issue one tl.dot
    prefetch: bool = False  # gemv: load each K step's words one step ahead (`quant_gemv_kernel`'s PREFETCH)


def block_k_for(bits: int) -> int:
    """K tile of the GEMM kernels: 16 packed words (p = 32 // bits values each) per row, so each of the p
    per-position dots of `_accumulate_tile` has K = 16 (the smallest tl.dot) and a row of the word tile
    is 64 contiguous bytes; 128 for 4-bit (one tile per group of the common group size 128), 64 for 8-bit."""
    return 16 * pack_factor(bits)


def plan_quant_linear(m: int, n: int, w: QuantTensors, capability: tuple[int, int], num_sms: int,
                      small_m_max: int | None = None, large_m_min: int | None = None,
                      split_k: int | None = None, gemv_m_max: int | None = None) -> QuantLinearPlan:
    """Pick the path and tiles for x [m, K] @ W^T [K, n] on a device of `capability` with `num_sms` SMs.

    small_m_max / large_m_min / gemv_m_max override the M thresholds (tests reach every path on tiny
    shapes); split_k forces the number of K slices of the Triton paths.

    M <= gemv_m_max (default GEMV_M_MAX, GEMV_M_MAX_CC70 on cc < 8.0): the GEMV kernel, GEMV_BLOCK_N rows x
    GEMV_BLOCK_KW words per step, K split until there are ~GEMV_PROGRAMS_PER_SM programs per SM. Then, on
    cc >= 8.0 up to DOT_M_MAX for weights `quant_dot.dot_supported` takes: the tensor-core GEMV with the
    DOT_TILES tile of M's range.

    BLOCK_K is `block_k_for(bits)` everywhere (128 for 4-bit, 64 for 8-bit). Tiles (H200-class,
    cc >= 8.0): small M uses 16-row (the smallest tl.dot) x 64 output tiles and splits K until there are
    ~4 programs per SM, so decode streams the weights from every SM (a 4096-wide layer has only 64 N
    tiles for 132 SMs). Medium M uses 32/64/128-row tiles by M and 128-wide N tiles (the dequantized
    weight tile is reused by all rows of the tile; 128 x 128 tiles are the usual sweet spot of Triton
    GEMMs on Ampere/Hopper), splitting K only while the output tiles are fewer than 2 per SM. cc < 8.0
    (no cp.async: one stage): BLOCK_M = next power of two of M (<= 8), BLOCK_N 64 (32 for BLOCK_M 8), the
    float32 [BLOCK_N, BLOCK_M, 16] per-position product at most 4K elements (32 registers per thread).
    Register use was checked with ptxas -v (sm_90a, sm_70): no spills for these tiles.
    """
    cc70 = tuple(capability) < (8, 0)
    small = small_m_max if small_m_max is not None else (SMALL_M_MAX_CC70 if cc70 else SMALL_M_MAX)
    large = large_m_min if large_m_min is not None else (SMALL_M_MAX_CC70 if cc70 else LARGE_M_MIN)
    k = w.in_features
    dot_ok = not cc70 and dot_supported(w.g_idx is not None, w.bits, w.group_size, k, DOT_BLOCK_K)
    # The GEMV keeps M = 2 for the weights the tensor-core GEMV does not take (8-bit, small groups).
    gemv = gemv_m_max if gemv_m_max is not None else (GEMV_M_MAX_CC70 if cc70 else
                                                      GEMV_M_MAX if dot_ok else GEMV_M_MAX_NO_DOT)
    if m <= gemv and gemv_supported(w.g_idx is not None, w.bits, w.group_size):
        bm = triton.next_power_of_2(m)
        return finish_plan(QuantLinearPlan("gemv", bm, GEMV_BLOCK_N, GEMV_BLOCK_KW * pack_factor(w.bits), 0, False,
                                           GEMV_WARPS, 1 if cc70 else GEMV_STAGES, prefetch=GEMV_PREFETCH),
                           m, n, k, num_sms, split_k,
                           programs_per_sm=max(1, GEMV_PROGRAMS_PER_SM // bm))
    if dot_ok and m <= DOT_M_MAX:
        _, bn, warps, stages, per_sm = next(t for t in DOT_TILES if m <= t[0])
        return finish_plan(QuantLinearPlan("dot", max(16, triton.next_power_of_2(m)), bn, DOT_BLOCK_K, 0, True, warps,
                                           stages), m, n, k, num_sms, split_k, programs_per_sm=per_sm)
    if m > small and (m > large or cc70):
        if m <= TC_M_MAX and tc_supported(w, capability):
            return QuantLinearPlan("tc")
        return QuantLinearPlan("cublas")
    if m <= small and cc70:
        bm, bk = min(triton.next_power_of_2(m), 8), block_k_for(w.bits)
        bn = 64 if bm <= 4 else 32
        use_dot, warps, stages, path = False, 4, 1, "splitk"
    elif m <= small:
        bm, bn, bk = (16 if m <= 16 else 32), 128, block_k_for(w.bits)
        use_dot, warps, stages, path = True, 4, 3, "splitk"
    else:
        bm = 32 if m <= 32 else 64 if m <= 128 else 128
        bn, bk = 128, block_k_for(w.bits)
        use_dot, warps, stages, path = True, 4 if bm <= 64 else 8, 3, "tiled"
    if cc70:
        stages = 1
    return finish_plan(QuantLinearPlan(path, bm, bn, bk, 0, use_dot, warps, stages), m, n, k, num_sms, split_k)


def finish_plan(plan: QuantLinearPlan, m: int, n: int, k: int, num_sms: int,
                split_k: int | None = None, programs_per_sm: int | None = None) -> QuantLinearPlan:
    """`plan` with its split_k set: `split_k` if given, else plan.split_k if > 0, else from the programs wanted
    per SM (`programs_per_sm`, default 4 split-K / 2 tiled / GEMV_PROGRAMS_PER_SM); clamped to the K tiles
    and made even (no empty slice). The "cublas" and "tc" paths are returned as is."""
    if plan.path in ("cublas", "tc"):
        return plan
    path, bm, bn, bk = plan.path, plan.block_m, plan.block_n, plan.block_k
    if split_k is None and plan.split_k > 0:
        split_k = plan.split_k
    k_tiles = triton.cdiv(k, bk)
    tiles = (1 if path == "gemv" else triton.cdiv(m, bm)) * triton.cdiv(n, bn)
    if split_k is None:
        # Programs wanted: ~4 per SM for the memory-bound small-M kernel (enough loads in flight to
        # stream HBM), ~2 per SM for the tiled GEMM (whose extra K slices cost float32 partial traffic),
        # GEMV_PROGRAMS_PER_SM for the GEMV (small programs, low registers).
        if programs_per_sm is None:
            programs_per_sm = {"splitk": 4, "dot": 4, "tiled": 2}.get(path, GEMV_PROGRAMS_PER_SM)
        target = programs_per_sm * num_sms
        split_k = max(1, min(target // tiles, k_tiles // 2 if k_tiles >= 4 else 1))
    split_k = max(1, min(split_k, k_tiles))
    # Even K slices; recompute the count so that no slice is empty.
    per = triton.cdiv(k_tiles, split_k)
    split_k = triton.cdiv(k_tiles, per)
    return QuantLinearPlan(path, bm, bn, bk, split_k, plan.use_dot, plan.num_warps, plan.num_stages,
                           plan.one_dot, plan.prefetch)


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized output buffers (tests replace it to check that every element gets written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _launch_matmul(x: torch.Tensor, w: QuantTensors, bias: torch.Tensor | None, plan: QuantLinearPlan) -> torch.Tensor:
    m, k = x.shape
    n = w.qweight.shape[0]
    mode, gsize, g_idx = kernel_groups(w, plan.block_k)
    k_tiles = triton.cdiv(k, plan.block_k)
    per = triton.cdiv(k_tiles, plan.split_k)
    partial = plan.split_k > 1
    out = _new_output((m, n), x.dtype, x.device)
    target = _new_output((plan.split_k, m, n), torch.float32, x.device) if partial else out
    clamp = x.dtype == torch.float16
    qz = w.qzeros if w.qzeros is not None else w.scales
    if plan.path == "gemv":
        if plan.block_m < m:
            raise ValueError(f"The GEMV plan's block_m {plan.block_m} is below M = {m}.")
        if mode == 2:
            raise ValueError("The GEMV kernel takes no act-order (g_idx) weight; plan another path.")
        p = pack_factor(w.bits)
        block_kw = plan.block_k // p
        wpg = words_per_group(w.bits, w.group_size, k)
        quant_gemv_kernel[(triton.cdiv(n, plan.block_n), plan.split_k)](
            x, w.qweight, w.scales, qz, bias if bias is not None else w.scales, target,
            m, n, k, triton.cdiv(k, p), wpg, per * block_kw,
            x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0),
            w.scales.stride(1), qz.stride(0), qz.stride(1),
            target.stride(0) if partial else 0, target.stride(-2), target.stride(-1),
            BITS=w.bits, HAS_ZEROS=w.qzeros is not None, ONE_GROUP=wpg % block_kw == 0,
            EVEN_K=k % (block_kw * p) == 0, HAS_BIAS=bias is not None,
            PARTIAL=partial, CLAMP_FP16=clamp, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_KW=block_kw,
            ASM=x.is_cuda, PREFETCH=plan.prefetch,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )
    elif plan.path == "dot":
        if not dot_supported(w.g_idx is not None, w.bits, w.group_size, k, plan.block_k):
            raise ValueError(f"The tensor-core GEMV takes 4-bit weights without act-order whose K and group size "
                             f"are multiples of block_k {plan.block_k}; plan another path.")
        quant_dot_kernel[(triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n), plan.split_k)](
            x, w.qweight, w.scales, qz, bias if bias is not None else w.scales, target,
            m, n, k, k if w.group_size == -1 else w.group_size, per,
            x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0),
            w.scales.stride(1), qz.stride(0), qz.stride(1),
            target.stride(0) if partial else 0, target.stride(-2), target.stride(-1),
            HAS_ZEROS=w.qzeros is not None, HAS_BIAS=bias is not None, PARTIAL=partial, CLAMP_FP16=clamp,
            ASM=x.is_cuda and x.dtype in (torch.float16, torch.bfloat16), BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8, num_warps=plan.num_warps,
            num_stages=plan.num_stages,
        )
    else:
        quant_matmul_kernel[(triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n), plan.split_k)](
            x, w.qweight, w.scales, qz, g_idx if g_idx is not None else w.qweight,
            bias if bias is not None else w.scales, target,
            m, n, k, gsize, per,
            x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0),
            w.scales.stride(1), qz.stride(0), qz.stride(1),
            target.stride(0) if partial else 0, target.stride(-2), target.stride(-1),
            BITS=w.bits, HAS_ZEROS=w.qzeros is not None, GROUP_MODE=mode, HAS_BIAS=bias is not None,
            USE_DOT=plan.use_dot, IEEE_FP32=x.dtype == torch.float32, PARTIAL=partial, CLAMP_FP16=clamp,
            ONE_DOT=plan.one_dot, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )
    if partial:
        block = 1024
        splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            target, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=plan.split_k, HAS_BIAS=bias is not None, CLAMP_FP16=clamp, ROUND=0, BLOCK=block, num_warps=4,
        )
    return out


def _cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype != torch.float16:
        return F.linear(x, weight, bias)
    # float16: multiply in fp16 on the tensor cores, accumulate and return float32, clamp, then cast.
    if x.is_cuda:
        y = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:
        y = x.float() @ weight.float().t()
    if bias is not None:
        y += bias.float()
    return y.clamp_(-FP16_MAX, FP16_MAX).to(torch.float16)


def quant_linear(x: torch.Tensor, w: QuantTensors, bias: torch.Tensor | None = None, *,
                 small_m_max: int | None = None, large_m_min: int | None = None, split_k: int | None = None,
                 capability: tuple[int, int] | None = None, gemv_m_max: int | None = None,
                 plan: QuantLinearPlan | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias), W = dequantize(w) [N, K] (module docstring for the paths and numerics).

    Args:
        x: [M, K] (or [..., K], flattened) float16 / bfloat16 / float32, any strides (CUDA, or CPU
            under TRITON_INTERPRET=1).
        w: int4/int8 weight in the `quant_pack` layout, no expert dim; its tensors may be strided
            views (TP shards: sliced qweight / group columns, sliced g_idx).
        bias: [N] or None.
        small_m_max, large_m_min: override the M thresholds (`SMALL_M_MAX`, `LARGE_M_MIN`; tests).
        split_k: force the K slices of the Triton paths (tests).
        capability: plan for this compute capability instead of the device's effective one (tests).
        gemv_m_max: override `GEMV_M_MAX` (tests).
        plan: use these launch settings instead of `plan_quant_linear`'s (sweeps); split_k 0 is filled in
            by `finish_plan`, a "gemv" plan needs block_m >= M.

    Returns:
        [M, N] (or [..., N]) in x's dtype; every element written.

    Raises:
        ValueError: x's last dim is not w.in_features, bias is not [N], or w's tensors disagree with its
            bits / groups.
    """
    check_quant_tensors(w)
    if x.dim() < 1 or x.shape[-1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}], not {tuple(x.shape)}.")
    n = w.qweight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], not {tuple(bias.shape)}.")
    lead = x.shape[:-1]
    x = x.reshape(-1, w.in_features)
    m = x.shape[0]
    if m == 0:
        return torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    cap, sms = device_facts(x.device)
    if plan is None:
        plan = plan_quant_linear(m, n, w, capability or cap, sms, small_m_max, large_m_min, split_k, gemv_m_max)
    else:
        plan = finish_plan(plan, m, n, w.in_features, sms, split_k)
    if plan.path == "tc" and x.dtype != torch.float32:  # float32 x (IEEE dots) keeps dequantize + cuBLAS
        y = quant_gemm_tc(x, w, bias.to(x.dtype) if bias is not None else None)
    elif plan.path in ("cublas", "tc"):
        y = _cublas_linear(x, dequantize_weight(w, x.dtype), bias.to(x.dtype) if bias is not None else None)
    else:
        y = _launch_matmul(x, w, bias, plan)
    return y.reshape(*lead, n)


def dequantize_weight(w: QuantTensors, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of `w` in `dtype`: [N, K], or [E, N, K] with a leading expert dim (Triton).

    Same values as `quant_pack.dequantize(..., dtype=dtype)`: (q - z) * s formed in float32, rounded once.
    """
    experts = w.qweight.dim() == 3
    check_quant_tensors(w, experts)
    qw, s, z, g = w.qweight, w.scales, w.qzeros, w.g_idx
    if not experts:
        qw, s = qw.unsqueeze(0), s.unsqueeze(0)
        z = z.unsqueeze(0) if z is not None else None
        g = g.unsqueeze(0) if g is not None else None
    e, n, _ = qw.shape
    k = w.in_features
    out = _new_output((e, n, k), dtype, qw.device)
    block_n, block_k = 32, 64
    mode, gsize, _ = kernel_groups(w, block_k, packed_groups=False)
    zz = z if z is not None else s
    gg = g if g is not None else qw
    if e and n and k:
        dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k), e)](
            qw, s, zz, gg, out, n, k, gsize,
            qw.stride(0), qw.stride(1), qw.stride(2), s.stride(0), s.stride(1), s.stride(2),
            zz.stride(0), zz.stride(1), zz.stride(2), gg.stride(0) if g is not None else 0,
            out.stride(0), out.stride(1), out.stride(2),
            BITS=w.bits, HAS_ZEROS=z is not None, GROUP_MODE=mode, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    return out if experts else out[0]
