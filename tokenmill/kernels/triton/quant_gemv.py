"""int4/int8 GEMV for a few rows of x on CUDA (Triton, no tl.dot): y[m, n] = sum_k x[m, k] W[n, k].

Decode multiplies 1-16 rows of x by every weight, so the kernel must stream the packed words at HBM
speed while spending only a few instructions per 4-bit value. The weight is in tokenmill's layout
(`kernels/quant_pack.py`): `qweight` int32 [N, ceil(K / p)] packed along K (p = 32 // bits values per
word, low bits first), per-group `scales` / `qzeros` [N, ngroups], group k // G.

Per value, no int->float conversion instruction (I2F issues at a fraction of the FMA rate): the value's
bits are shifted into the top of a float32 mantissa and OR-ed with the bit pattern of 1.0
(0x3F800000), giving v = 1 + q / 2^bits exactly (the classic "magic number" conversion; Marlin and
FasterTransformer do the same in fp16 with 1024 + q). So one value costs a shift, a mask-or and an FMA
per row of x. The group's scale and zero point come in once per word and row:

    sum_j (q_j - z) s x_j = s 2^bits (t - c xs),  t = sum_j v_j x_j,  xs = sum_j x_j,  c = 1 + z / 2^bits

(j over the p values of a word, which all lie in one group because every group size is a multiple of p).
t stays near the magnitude of xs (v in [1, 2)), so the difference keeps float32 accuracy. Partial sums stay
per thread ([BLOCK_M, BLOCK_N, BLOCK_KW] float32) and are reduced across the tile once, after the K loop.

Grid: (cdiv(N, BLOCK_N), SPLIT_K); program (i, s) takes output rows i * BLOCK_N .. and the s-th slice of
`words_per_split` packed words. SPLIT_K > 1 writes float32 partials [SPLIT_K, M, N] for
`splitk.splitk_reduce_kernel` (fixed order: deterministic, CUDA-graph safe); SPLIT_K = 1 finishes in the
kernel (+ bias, float16 saturated at +-65504, cast). Act-order (g_idx) weights are not taken here (the
caller routes them to the tl.dot paths).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.splitk import store_tile


@triton.jit
def _unit_mantissa(words, J: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """float32 1 + q / 2^BITS of value J of every int32 word (q = bits J*BITS .. J*BITS + BITS - 1): the value
    moved to mantissa bits 23 - BITS .. 22 under the exponent of 1.0; exact for every q.

    The mask-and-or is one `lop3` (PTX ISA, "lop3": any 3-input bitwise function; 0xEA = (a & b) | c), written
    out because ptxas splits (a & imm1) | imm2 into two instructions (a LOP3 takes one immediate).
    """
    SHIFT: tl.constexpr = 23 - BITS - J * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << (23 - BITS)
    if SHIFT >= 0:
        moved = words << SHIFT
    else:
        moved = words >> (-SHIFT)
    if ASM:
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [moved, tl.full(moved.shape, MASK, tl.int32),
                                          tl.full(moved.shape, 0x3F800000, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # the Triton interpreter has no inline PTX
        bits = (moved & MASK) | 0x3F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group_scale(s_ptr, z_ptr, offs_n64, n_mask, offs_w, w_mask, w0, words_per_group,
                 stride_sn, stride_sg, stride_zn, stride_zg, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 ONE_GROUP: tl.constexpr):
    """(s * 2^BITS, c = 1 + z / 2^BITS) of the tile's words as float32 [BLOCK_N, 1] (ONE_GROUP: the tile's one
    group) or [BLOCK_N, BLOCK_KW] (group per word); c of symmetric weights (z = 2^(BITS-1)) is 1.5."""
    SCALE_UP: tl.constexpr = (1 << BITS) * 1.0
    if ONE_GROUP:
        g = w0 // words_per_group
        s = tl.load(s_ptr + offs_n64 * stride_sn + g * stride_sg, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n64 * stride_zn + g * stride_zg, mask=n_mask, other=0).to(tl.float32)[:, None]
    else:
        g = offs_w // words_per_group
        gm = n_mask[:, None] & w_mask[None, :]
        s = tl.load(s_ptr + offs_n64[:, None] * stride_sn + g[None, :] * stride_sg, mask=gm, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n64[:, None] * stride_zn + g[None, :] * stride_zg, mask=gm, other=0).to(tl.float32)
    if HAS_ZEROS:
        c = 1.0 + z / SCALE_UP
    else:
        c = tl.full((1, 1), 1.5, tl.float32)
    return s * SCALE_UP, c


@triton.jit
def quant_gemv_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    qw_ptr,  # int32 [N, ceil(K / p)]
    s_ptr,  # [N, ngroups]
    z_ptr,  # uint8 [N, ngroups] (read when HAS_ZEROS)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or float32 partials [SPLIT_K, M, N] when PARTIAL
    M, N, K, kw_total, words_per_group, words_per_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_os, stride_om, stride_on,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ONE_GROUP: tl.constexpr,  # every BLOCK_KW-word tile lies inside one group (words_per_group % BLOCK_KW == 0)
    EVEN_K: tl.constexpr,  # kw_total and words_per_split are multiples of BLOCK_KW and K == kw_total * p: no K masks
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    CLAMP_FP16: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x (a power of two >= M): the weights are read once for all of them
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # packed words per row per step (BLOCK_KW * p columns of K)
    ASM: tl.constexpr = True,  # inline PTX (False under the Triton interpreter)
    PREFETCH: tl.constexpr = False,  # load each step's words one step ahead (more bytes in flight per warp)
):
    """out[m, n] (+)= sum over the K slice of program_id(1) of x[m, k] W[n, k] (module docstring).

    words_per_split must be a multiple of BLOCK_KW; ONE_GROUP needs BLOCK_KW to divide words_per_group (then
    no tile straddles a group). Masked rows, columns past N and words past K read as zero.
    """
    P: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    w_start = pid_k * words_per_split
    w_end = tl.minimum(w_start + words_per_split, kw_total)
    if BLOCK_M == 1:
        # One row: 2-D tiles only (the words' layout is the only layout; x comes in as its column slice).
        acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KW), dtype=tl.float32)
    if PREFETCH:
        w_ptrs = qw_ptr + offs_n64[:, None] * stride_qn + (w_start + tl.arange(0, BLOCK_KW))[None, :] * stride_qk
        # The first step's words; each step then issues the next step's loads before its own arithmetic.
        if EVEN_K:
            nxt = tl.load(w_ptrs, mask=n_mask[:, None] & (w_start < w_end), other=0)
        else:
            nxt = tl.load(w_ptrs, mask=n_mask[:, None] & ((w_start + tl.arange(0, BLOCK_KW)) < w_end)[None, :],
                          other=0)
    for w0 in range(w_start, w_end, BLOCK_KW):
        offs_w = w0 + tl.arange(0, BLOCK_KW)
        if EVEN_K:
            w_mask = tl.full((BLOCK_KW,), 1, tl.int1)
        else:
            w_mask = offs_w < w_end
        if PREFETCH:
            words = nxt
            w_ptrs += BLOCK_KW * stride_qk
            if EVEN_K:  # a scalar mask keeps the loads vectorized; the last step loads nothing
                nxt = tl.load(w_ptrs, mask=n_mask[:, None] & (w0 + BLOCK_KW < w_end), other=0)
            else:
                nxt = tl.load(w_ptrs, mask=n_mask[:, None] & ((offs_w + BLOCK_KW) < w_end)[None, :], other=0)
        else:  # the addresses as before PREFETCH existed (the measured default kernel)
            words = tl.load(qw_ptr + offs_n64[:, None] * stride_qn + offs_w[None, :] * stride_qk,
                            mask=n_mask[:, None] & w_mask[None, :], other=0)
        s, c = _group_scale(s_ptr, z_ptr, offs_n64, n_mask, offs_w, w_mask, w0, words_per_group,
                            stride_sn, stride_sg, stride_zn, stride_zg, BITS, HAS_ZEROS, ONE_GROUP)
        if BLOCK_M == 1:
            t = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
            xs = tl.zeros((BLOCK_KW,), dtype=tl.float32)
            for j in tl.static_range(P):
                offs_k = offs_w * P + j
                if EVEN_K:
                    xj = tl.load(x_ptr + offs_k * stride_xk).to(tl.float32)
                else:
                    xj = tl.load(x_ptr + offs_k * stride_xk, mask=w_mask & (offs_k < K), other=0.0).to(tl.float32)
                xs += xj
                t += _unit_mantissa(words, j, BITS, ASM) * xj[None, :]
            acc += s * (t - c * xs[None, :])
        else:
            t = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_KW), dtype=tl.float32)
            xs = tl.zeros((BLOCK_M, BLOCK_KW), dtype=tl.float32)
            for j in tl.static_range(P):
                offs_k = offs_w * P + j
                xj = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                             mask=row_mask[:, None] & (w_mask & (offs_k < K))[None, :], other=0.0).to(tl.float32)
                xs += xj
                t += _unit_mantissa(words, j, BITS, ASM)[None, :, :] * xj[:, None, :]
            acc += s[None, :, :] * (t - c[None, :, :] * xs[:, None, :])
    if BLOCK_M == 1:
        out_t = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        out_t = tl.trans(tl.sum(acc, axis=2))  # [BLOCK_N, BLOCK_M]
    store_tile(out_t, out_ptr, bias_ptr, pid_k, rows, offs_n64, offs_n, n_mask,
               n_mask[:, None] & row_mask[None, :], stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL, CLAMP_FP16)


def gemv_supported(act_order: bool, bits: int, group_size: int) -> bool:
    """Whether `quant_gemv_kernel` takes a weight: no g_idx (act_order False), and a group size (in K
    columns) that is -1 or a multiple of the values per word, 32 // bits (true of every checkpoint format
    tokenmill reads)."""
    return not act_order and (group_size == -1 or group_size % (32 // bits) == 0)


def words_per_group(bits: int, group_size: int, in_features: int) -> int:
    """Packed int32 words per scale group: group_size (K columns) // (32 // bits), or all ceil(in_features /
    (32 // bits)) words of a row for group_size -1."""
    p = 32 // bits
    return triton.cdiv(in_features, p) if group_size == -1 else group_size // p
