"""FP8 (e4m3) GEMV for a few rows of x on CUDA (Triton, no tl.dot): y[m, n] = sum_k x[m, k] W[n, k] * scales.

Decode multiplies 1-4 rows of x by every weight: the kernel must stream the weight's bytes at HBM speed with
few instructions per byte. A 16-row `tl.dot` tile (the split-K GEMM in fp8_gemm.py) spends most of its
tensor-core work on padding rows and issues its fp8 operands through shared memory; here every thread loads
16-byte vectors of the weight as int32 words (four e4m3 codes each, code j of word w = column 4 w + j)
straight into registers, turns each code into a float32 and multiplies it into a float32 partial sum with
one FMA per row of x.

Decoding a word (`decode_e4m3_word`):
- HW_CVT (cc >= 8.9): PTX `cvt.rn.f16x2.e4m3x2` turns two codes into two float16 in one instruction, and
  `cvt.f32.f16` widens each (exact: e4m3 values need 4 significant bits and exponents 2^-9..2^8).
- otherwise (cc < 8.9, which has no FP8 conversion, and the Triton interpreter): integer operations build
  the same float16x2 pairs, each float16 holding value / 256 (`fp8_quant.e4m3_to_f16_div256`'s bit move,
  done for two codes of a word at once: codes 0 and 2 with shifts by 8 and 7, codes 1 and 3 by 0 and 1),
  then `cvt.f32.f16`; the 1 / 256 per decoded operand is multiplied back once at the end (exact). NaN codes
  (0x7F, 0xFF: never written by the quantizers) read as +-480 here instead of NaN.

Math: W8A8 (A_FP8): x is the e4m3 codes of the per-token (or static per-tensor) quantization
(`fp8_quant.quantize_fp8_triton`), loaded as words and decoded like the weight; products of two e4m3 values
are exact in float32 and summed in float32, and the scales multiply the sum once: y = s_x[m] s_w[n] sum_k
q_x[m, k] q_w[n, k] (+ bias). That is the tensor-core path's formula, without its ~14-bit accumulation inside
an MMA, so its references and tolerances hold. W8A16: y = s_w[n] sum_k x[m, k] q_w[n, k] with x (float16,
bfloat16 or float32) widened to float32. Per-tensor and per-channel weight scales; 128x128 block-scaled
weights stay on the tl.dot GEMM (`gemv_supported`).

Grid: (cdiv(N, BLOCK_N), SPLIT_K); program (i, s) takes output rows i * BLOCK_N .. and the s-th slice of
`words_per_split` words of K. SPLIT_K > 1 writes float32 partials [SPLIT_K, M, N] (scales applied, linear)
for `splitk.splitk_reduce_kernel` (fixed order: deterministic, CUDA-graph safe); SPLIT_K = 1 finishes in the
kernel (+ bias, float16 saturated at +-65504, rounded once to out's dtype, `numerics.round_to`). Each row of x
has its own [BLOCK_N, BLOCK_KW] float32 accumulator (BLOCK_M 1, 2 or 4 of them, written out, so every tensor
keeps the weight tile's layout: no layout conversions), reduced across the tile once, after the K loop. Rows of
W past N and of x past M read the last valid row instead of being masked (their sums are never stored), so the
weight loads carry no masks when K divides into steps (EVEN_K). PREFETCH loads each step's words one step
ahead (more bytes in flight per warp, at the cost of registers and register moves; off in the plan until a
GPU sweep says otherwise: benchmarks/gpu/fp8_gemm.py --sweep-gemv).

SASS, sm_90: 2.87 instructions per value at M = 1 (W8A8, the planned BLOCK_N 64 x BLOCK_KW 16 words, one warp,
EVEN_K, no prefetch; Triton 3.6, cuobjdump of the K loop: per weight value 1 FFMA, 1 HADD2.F32 (the widening),
0.5 F2FP.F16.E4M3 (the pair conversion), and 0.37 for decoding x (amortized over a thread's 8 rows of W), the
16-byte loads, their addresses and the loop). M = 2 (BLOCK_N 128, two warps): 4.07; weight-only bfloat16 x,
M = 1: 3.00; 128-row tiles at M = 1: 2.76. Integer decoding (sm_80, M = 1): 4.76. The PTX conversion plus
widening (1.5 per value) is the floor for exact float32 operands on sm_90: every float32 operand needs one
instruction to produce its register, and an e4m3 code's sign and magnitude need different shifts to become
one without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.numerics import round_code, round_to
from tokenmill.kernels.triton.splitk import splitk_reduce_kernel


@triton.jit
def _f16_pair_to_f32(pairs):
    """(low, high) float16 halves of uint32 `pairs` widened to float32 (exact)."""
    lo = pairs.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (pairs >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def decode_e4m3_word(words, HW_CVT: tl.constexpr):
    """The four e4m3 codes of every int32 word (code j in bits 8j .. 8j + 7) as float32 (v0, v1, v2, v3):
    exact values (HW_CVT, PTX FP8 conversion, cc >= 8.9) or values / 256 (integer operations, any device and
    the Triton interpreter; module docstring)."""
    if HW_CVT:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(
            """
            {
            .reg .b16 lo, hi, a, b, c, d;
            .reg .b32 p, q;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p, lo;
            cvt.rn.f16x2.e4m3x2 q, hi;
            mov.b32 {a, b}, p;
            mov.b32 {c, d}, q;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            cvt.f32.f16 $2, c;
            cvt.f32.f16 $3, d;
            }
            """,
            "=r,=r,=r,=r,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
            pack=1)
    else:
        # e4m3 s.eeee.mmm -> float16 s.0eeee.mmm0000000 (value / 256): sign up 8 bits, magnitude up 7.
        u = words.to(tl.uint32, bitcast=True)
        even = ((u << 8) & 0x80008000) | ((u << 7) & 0x3F803F80)  # codes 0 (low half) and 2 (high half)
        odd = (u & 0x80008000) | ((u >> 1) & 0x3F803F80)  # codes 1 and 3
        v0, v2 = _f16_pair_to_f32(even)
        v1, v3 = _f16_pair_to_f32(odd)
    return v0, v1, v2, v3


@triton.jit
def _x_columns(x_ptr, row, offs_w, mask, stride_xm, stride_xk, A_FP8: tl.constexpr, HW_CVT: tl.constexpr,
               EVEN_K: tl.constexpr):
    """float32 x[row, 4 w + j] for j = 0..3 at the words offs_w [BLOCK_KW]: decoded from int32 words of e4m3
    codes (A_FP8) or loaded and widened; words outside `mask` read as zero (unless EVEN_K)."""
    row_ptr = x_ptr + row * stride_xm  # M * K < 2^31: int32 offsets
    if A_FP8:
        if EVEN_K:
            xw = tl.load(row_ptr + offs_w * stride_xk)
        else:
            xw = tl.load(row_ptr + offs_w * stride_xk, mask=mask, other=0)
        x0, x1, x2, x3 = decode_e4m3_word(xw, HW_CVT)
    else:
        base = row_ptr + offs_w * (4 * stride_xk)
        if EVEN_K:
            x0 = tl.load(base).to(tl.float32)
            x1 = tl.load(base + stride_xk).to(tl.float32)
            x2 = tl.load(base + 2 * stride_xk).to(tl.float32)
            x3 = tl.load(base + 3 * stride_xk).to(tl.float32)
        else:
            x0 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            x1 = tl.load(base + stride_xk, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(base + 2 * stride_xk, mask=mask, other=0.0).to(tl.float32)
            x3 = tl.load(base + 3 * stride_xk, mask=mask, other=0.0).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _load_words(w_rows_ptr, w0, w_end, stride_wk, BLOCK_KW: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_KW] weight words w0 .. w0 + BLOCK_KW - 1 of the rows at w_rows_ptr [BLOCK_N, 1]; words
    at or past w_end read as zero (unless EVEN_K, where none is)."""
    offs_w = w0 + tl.arange(0, BLOCK_KW)
    if EVEN_K:
        return tl.load(w_rows_ptr + offs_w[None, :] * stride_wk)
    return tl.load(w_rows_ptr + offs_w[None, :] * stride_wk, mask=(offs_w < w_end)[None, :], other=0)


@triton.jit
def _fma_row(acc, v0, v1, v2, v3, x_ptr, row, offs_w, mask, stride_xm, stride_xk, A_FP8: tl.constexpr,
             HW_CVT: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_KW] + the products of the decoded weight words (v0..v3) with row `row` of x: one
    float32 FMA per value."""
    x0, x1, x2, x3 = _x_columns(x_ptr, row, offs_w, mask, stride_xm, stride_xk, A_FP8, HW_CVT, EVEN_K)
    acc += v0 * x0[None, :]
    acc += v1 * x1[None, :]
    acc += v2 * x2[None, :]
    acc += v3 * x3[None, :]
    return acc


@triton.jit
def _store_row(acc, row, M, offs_n, n_mask, x_scale_ptr, w_scale, bias_ptr, out_ptr, pid_k, stride_xs,
               stride_os, stride_om, stride_on, A_FP8: tl.constexpr, A_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
               PARTIAL: tl.constexpr, CLAMP_FP16: tl.constexpr, ROUND: tl.constexpr, HW_CVT: tl.constexpr):
    """Reduce acc [BLOCK_N, BLOCK_KW] over K, scale it and store it as out[row, offs_n] (row < M only): the
    float32 partial of K slice pid_k (PARTIAL), else + bias, float16-saturated and rounded to out's dtype."""
    y = tl.sum(acc, axis=1) * w_scale
    if not HW_CVT:
        y = y * (65536.0 if A_FP8 else 256.0)  # the integer decode's 1 / 256 per decoded operand
    if A_SCALE == 1:
        y = y * tl.load(x_scale_ptr)
    if A_SCALE == 2:
        y = y * tl.load(x_scale_ptr + row * stride_xs)
    mask = n_mask & (row < M)
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + row * stride_om + offs_n * stride_on, y, mask=mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if CLAMP_FP16:
            y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
        tl.store(out_ptr + row * stride_om + offs_n * stride_on, round_to(y, ROUND).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def fp8_gemv_kernel(
    x_ptr,  # A_FP8: int32 [M, K / 4] words of e4m3 codes; else [M, K] float16 / bfloat16 / float32
    w_ptr,  # int32 [N, K / 4]: words of the weight's e4m3 codes
    x_scale_ptr,  # float32 [1] (A_SCALE 1) or [M] (A_SCALE 2)
    w_scale_ptr,  # float32 [1] (B_SCALE 1) or [N] (B_SCALE 2)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or float32 partials [SPLIT_K, M, N] when PARTIAL
    M, N, kw_total, words_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws, stride_os, stride_om, stride_on,
    A_FP8: tl.constexpr,
    A_SCALE: tl.constexpr,  # 0 none (W8A16), 1 per-tensor, 2 per row of x
    B_SCALE: tl.constexpr,  # 1 per-tensor, 2 per row of W
    EVEN_K: tl.constexpr,  # kw_total and words_per_split are multiples of BLOCK_KW: no K masks
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    CLAMP_FP16: tl.constexpr,
    ROUND: tl.constexpr,  # numerics.round_code of out's dtype (not PARTIAL)
    BLOCK_M: tl.constexpr,  # 1, 2 or 4 (>= M): rows of x, each weight word is loaded and decoded once for all
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # words (4 K columns each) per row per step
    HW_CVT: tl.constexpr,  # PTX FP8 conversion (cc >= 8.9); False: integer decode (cc < 8.9, interpreter)
    PREFETCH: tl.constexpr = False,  # load the next step's weight words before decoding this step's
):
    """out[m, n] (+)= scales * sum over the K slice of program_id(1) of x[m, k] W[n, k] (module docstring).

    words_per_split must be a multiple of BLOCK_KW. Words past kw_total read as zero; stride_xk / stride_wk
    count words (A_FP8 x, W) or elements (16/32-bit x). Each row of x has its own [BLOCK_N, BLOCK_KW]
    accumulator (BLOCK_M of them, written out: one 2-D layout, no layout conversions).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    # Rows of W past N and rows of x past M read row N - 1 / M - 1 (their sums are not stored): no masks, no
    # zeroing of the load registers.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    r1 = tl.minimum(1, M - 1)
    r2 = tl.minimum(2, M - 1)
    r3 = tl.minimum(3, M - 1)
    w_start = pid_k * words_per_split
    w_end = tl.minimum(w_start + words_per_split, kw_total)
    acc0 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    w_rows_ptr = w_ptr + w_rows[:, None] * stride_wn
    if PREFETCH:
        words_next = _load_words(w_rows_ptr, w_start, w_end, stride_wk, BLOCK_KW, EVEN_K)
    for w0 in range(w_start, w_end, BLOCK_KW):
        offs_w = w0 + tl.arange(0, BLOCK_KW)
        w_mask = offs_w < w_end
        if PREFETCH:
            # This step's words came one step ahead; load the next step's before using them (the last step
            # re-reads its own words when EVEN_K: in bounds and cached, so no mask is needed).
            words = words_next
            ahead = tl.minimum(w0 + BLOCK_KW, w_end - BLOCK_KW) if EVEN_K else w0 + BLOCK_KW
            words_next = _load_words(w_rows_ptr, ahead, w_end, stride_wk, BLOCK_KW, EVEN_K)
        else:
            words = _load_words(w_rows_ptr, w0, w_end, stride_wk, BLOCK_KW, EVEN_K)
        v0, v1, v2, v3 = decode_e4m3_word(words, HW_CVT)
        acc0 = _fma_row(acc0, v0, v1, v2, v3, x_ptr, 0, offs_w, w_mask, stride_xm, stride_xk, A_FP8, HW_CVT, EVEN_K)
        if BLOCK_M > 1:
            acc1 = _fma_row(acc1, v0, v1, v2, v3, x_ptr, r1, offs_w, w_mask, stride_xm, stride_xk, A_FP8, HW_CVT,
                            EVEN_K)
        if BLOCK_M > 2:
            acc2 = _fma_row(acc2, v0, v1, v2, v3, x_ptr, r2, offs_w, w_mask, stride_xm, stride_xk, A_FP8, HW_CVT,
                            EVEN_K)
            acc3 = _fma_row(acc3, v0, v1, v2, v3, x_ptr, r3, offs_w, w_mask, stride_xm, stride_xk, A_FP8, HW_CVT,
                            EVEN_K)
    if B_SCALE == 1:
        w_scale = tl.load(w_scale_ptr)
    else:
        w_scale = tl.load(w_scale_ptr + offs_n64 * stride_ws, mask=n_mask, other=0.0)
    _store_row(acc0, 0, M, offs_n64, n_mask, x_scale_ptr, w_scale, bias_ptr, out_ptr, pid_k, stride_xs, stride_os,
               stride_om, stride_on, A_FP8, A_SCALE, HAS_BIAS, PARTIAL, CLAMP_FP16, ROUND, HW_CVT)
    if BLOCK_M > 1:
        _store_row(acc1, 1, M, offs_n64, n_mask, x_scale_ptr, w_scale, bias_ptr, out_ptr, pid_k, stride_xs,
                   stride_os, stride_om, stride_on, A_FP8, A_SCALE, HAS_BIAS, PARTIAL, CLAMP_FP16, ROUND, HW_CVT)
    if BLOCK_M > 2:
        _store_row(acc2, 2, M, offs_n64, n_mask, x_scale_ptr, w_scale, bias_ptr, out_ptr, pid_k, stride_xs,
                   stride_os, stride_om, stride_on, A_FP8, A_SCALE, HAS_BIAS, PARTIAL, CLAMP_FP16, ROUND, HW_CVT)
        _store_row(acc3, 3, M, offs_n64, n_mask, x_scale_ptr, w_scale, bias_ptr, out_ptr, pid_k, stride_xs,
                   stride_os, stride_om, stride_on, A_FP8, A_SCALE, HAS_BIAS, PARTIAL, CLAMP_FP16, ROUND, HW_CVT)


def gemv_supported(weight: torch.Tensor, block_size: tuple[int, int] | None) -> bool:
    """Whether `fp8_gemv_kernel` takes an FP8 weight [N, K] (e4m3 or its uint8 bits): per-tensor or per-channel
    scales (block_size None), and rows that read as int32 words: K a multiple of 4, unit stride along K, row
    stride and storage offset multiples of 4 bytes (true of every checkpoint tokenmill loads)."""
    if block_size is not None or weight.dim() != 2:
        return False
    k = weight.shape[1]
    return (k % 4 == 0 and k > 0 and weight.stride(1) == 1 and weight.stride(0) % 4 == 0
            and weight.storage_offset() % 4 == 0)


def as_words(codes: torch.Tensor) -> torch.Tensor:
    """int32 [R, K / 4] view of e4m3 codes [R, K] (float8_e4m3fn or uint8) whose rows `gemv_supported`
    takes; word w holds columns 4 w .. 4 w + 3, low byte first (little-endian, as CUDA and x86 store it)."""
    return codes.view(torch.uint8).view(torch.int32)


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized output buffers (tests replace it to check that every element gets written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None,
             bias: torch.Tensor | None, out_dtype: torch.dtype, block_m: int, block_n: int, block_k: int,
             split_k: int, num_warps: int, hw_cvt: bool, prefetch: bool = False) -> torch.Tensor:
    """y [M, N] = (x_scale * x) @ (w_scale * weight)^T (+ bias) through `fp8_gemv_kernel` (+ the split-K sum).

    Args:
        x: [M, K]: e4m3 codes (float8_e4m3fn, unit stride along K, row stride a multiple of 4) for W8A8, or
            float16 / bfloat16 / float32 (any strides) for W8A16.
        weight: [N, K] e4m3 codes that `gemv_supported` takes; w_scale: float32 [] / [1] or [N] / [N, 1].
        x_scale: float32 [1] (static) or [M, 1] / [M] (per token) with e4m3 x; None with 16/32-bit x.
        bias: [N] or None. out_dtype: float16 / bfloat16 / float32.
        block_m: 1, 2 or 4, at least M. block_k: K columns per step (a multiple of 4). split_k: K slices.
        hw_cvt: decode with the PTX FP8 conversion (CUDA cc >= 8.9, compiled; not in the interpreter).
        prefetch: load each step's weight words one step ahead (the kernel's PREFETCH).

    Raises:
        ValueError: block_m is below M or not 1, 2 or 4, or the weight's layout does not fit (`gemv_supported`).
    """
    m, k = x.shape
    n = weight.shape[0]
    if block_m not in (1, 2, 4) or block_m < m:
        raise ValueError(f"The FP8 GEMV takes block_m 1, 2 or 4 and at least M = {m}, not {block_m}.")
    if not gemv_supported(weight, None) or weight.shape[1] != k:
        raise ValueError("The FP8 GEMV needs a [N, K] weight with K a multiple of 4 and rows of whole int32 words.")
    a_fp8 = x.dtype in (torch.float8_e4m3fn, torch.uint8)
    out = _new_output((m, n), out_dtype, x.device)
    if m == 0 or n == 0:
        return out
    block_kw = block_k // 4
    kw_total = k // 4
    per = triton.cdiv(triton.cdiv(kw_total, block_kw), split_k) * block_kw
    partial = split_k > 1
    target = _new_output((split_k, m, n), torch.float32, x.device) if partial else out
    xa = as_words(x) if a_fp8 else x
    ws = w_scale.float().reshape(-1)
    xs = x_scale.float().reshape(-1) if x_scale is not None else ws
    a_mode = 0 if x_scale is None else 1 if xs.numel() == 1 else 2
    clamp = out_dtype == torch.float16
    fp8_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        xa, as_words(weight), xs, ws, bias if bias is not None else ws, target,
        m, n, kw_total, per,
        xa.stride(0), xa.stride(1), weight.stride(0) // 4, 1, xs.stride(0), ws.stride(0) if ws.numel() > 1 else 0,
        target.stride(0) if partial else 0, target.stride(-2), target.stride(-1),
        A_FP8=a_fp8, A_SCALE=a_mode, B_SCALE=2 if ws.numel() > 1 else 1, EVEN_K=kw_total % block_kw == 0,
        HAS_BIAS=bias is not None, PARTIAL=partial, CLAMP_FP16=clamp, ROUND=round_code(out_dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, HW_CVT=hw_cvt, PREFETCH=prefetch,
        num_warps=num_warps, num_stages=1,
    )
    if partial:
        block = 1024
        splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            target, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=split_k, HAS_BIAS=bias is not None, CLAMP_FP16=clamp,
            ROUND=round_code(out_dtype), BLOCK=block, num_warps=4,
        )
    return out
