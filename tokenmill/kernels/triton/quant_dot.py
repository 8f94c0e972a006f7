"""int4 x 16-bit GEMM on tensor cores for decode-sized M (Triton): y = x @ dequantize(W)^T.

The weight is in tokenmill's layout (`kernels/quant_pack.py`): `qweight` int32 [N, K / 8] packed along K
(value j of word w is column 8 w + j, bits 4 j .. 4 j + 3), per-group `scales` / `qzeros` [N, ngroups].

Decode is bound by how fast the 4-bit weights become MMA operands, so the dequantization is a handful of
packed 16-bit instructions per word, written in PTX (`tl.inline_asm_elementwise` over the words, pack = 1:
one word in, its eight 16-bit values out as eight outputs; an earlier pack = 8 form over a [.., 8]
broadcast of the words assumed each thread held a word's eight slots in order, which Triton's layouts do
not promise, and gave wrong values on the H200):

    lop3(w >> 4 j, 0x000F000F, MAGIC)      two values per instruction: nibbles j and j + 4 land in the two
                                           halves' mantissas under the exponent of 128 (bf16, 0x4300) or
                                           1024 (fp16, 0x6400), i.e. the halves are 128 + q (1024 + q), exact
    fma.rn.{bf16,f16}x2(v, 1, -(MAGIC + z)) = q - z, exact (small integers)
    fma.rn.{bf16,f16}x2(., s, -0)            = (q - z) * s rounded once, as `quant_pack.dequantize` rounds

(the "magic number" int->float conversion; Marlin and FasterTransformer use the fp16 form). Joined into the
tile, each word's values sit in the nibble order 0, 2, 1, 3, 4, 6, 5, 7 (`slot_nibble`), so x is gathered in
that same order along K
(a dot product does not care about the order of K, only that both sides agree). The dequantized
[BLOCK_N, BLOCK_K] tile is the A operand of one tl.dot against x^T [BLOCK_K, BLOCK_M] ("swap AB": the few
rows of x pad the MMA's N side, 16 at least), accumulated in float32.

Grid: (M tiles x N tiles, SPLIT_K) as the split-K kernel (`splitk.grouped_tile`, `splitk.k_slice`); SPLIT_K
> 1 writes float32 partials for `splitk.splitk_reduce_kernel`. Taken for 4-bit weights without act-order
whose group size is a multiple of BLOCK_K (or -1); float32 activations and the Triton interpreter use the
same math in plain Triton (ASM False).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.splitk import grouped_tile, k_slice, store_tile

_ASM_BF16 = """{
.reg .b32 v0, v1, v2, v3, w1, w2, w3, one, nz;
mov.b32 one, 0x3F803F80;
mov.b32 nz, 0x80008000;
lop3.b32 v0, $8, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w1, $8, 4;
lop3.b32 v1, w1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w2, $8, 8;
lop3.b32 v2, w2, 0x000F000F, 0x43004300, 0xEA;
shr.u32 w3, $8, 12;
lop3.b32 v3, w3, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 v0, v0, one, $9;
fma.rn.bf16x2 v1, v1, one, $9;
fma.rn.bf16x2 v2, v2, one, $9;
fma.rn.bf16x2 v3, v3, one, $9;
fma.rn.bf16x2 v0, v0, $10, nz;
fma.rn.bf16x2 v1, v1, $10, nz;
fma.rn.bf16x2 v2, v2, $10, nz;
fma.rn.bf16x2 v3, v3, $10, nz;
mov.b32 {$0, $1}, v0;
mov.b32 {$2, $3}, v1;
mov.b32 {$4, $5}, v2;
mov.b32 {$6, $7}, v3;
}"""

_ASM_FP16 = (_ASM_BF16.replace("0x43004300", "0x64006400").replace("0x3F803F80", "0x3C003C00")
             .replace("bf16x2", "f16x2"))


@triton.jit
def _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Eight [BLOCK_N, BLOCK_KW] tensors -> [BLOCK_N, BLOCK_KW * 8], word w's eight values at columns 8 w ..
    8 w + 7 in the order o0, o4, o2, o6, o1, o5, o3, o7 (what three levels of tl.join give: the joins only
    relabel registers; `slot_nibble` says which nibble each column holds)."""
    q0 = tl.join(tl.join(o0, o1), tl.join(o2, o3))
    q1 = tl.join(tl.join(o4, o5), tl.join(o6, o7))
    return tl.reshape(tl.join(q0, q1), (BLOCK_N, BLOCK_KW * 8))


@triton.jit
def slot_nibble(f):
    """The nibble of its word that column f % 8 of `_dequant_words`' tile holds: output k of the PTX (or of the
    plain path) is nibble k // 2 + 4 (k % 2), and `_interleave8` puts output a + 2 b + 4 c at column 4 a + 2 b
    + c, so column f holds nibble b + 2 c + 4 a with a = f // 4, b = f // 2 % 2, c = f % 2: 0 2 1 3 4 6 5 7."""
    f = f % 8
    return (f // 2) % 2 + 2 * (f % 2) + 4 * (f // 4)


@triton.jit
def _dequant_words(words, s, z, OUT_DTYPE: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_KW: tl.constexpr):
    """[BLOCK_N, BLOCK_KW * 8] values (q - z) * s in OUT_DTYPE of int32 words [BLOCK_N, BLOCK_KW], column f of
    each word's eight holding nibble `slot_nibble(f)`; s [BLOCK_N, 1] float32, z [BLOCK_N, 1] float32 (8 when
    the weight is symmetric).

    The PTX runs once per word (pack = 1: an elementwise op over the words, so it does not depend on how
    Triton lays the tensor out over threads) and returns the word's eight values as eight 16-bit outputs."""
    if ASM:
        if OUT_DTYPE == tl.bfloat16:
            magic = 128.0
        else:
            magic = 1024.0
        negc = (-(magic + z)).to(OUT_DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        sb = s.to(OUT_DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        negc2 = tl.broadcast_to(negc | (negc << 16), (BLOCK_N, BLOCK_KW))
        s2 = tl.broadcast_to(sb | (sb << 16), (BLOCK_N, BLOCK_KW))
        if OUT_DTYPE == tl.bfloat16:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _ASM_BF16_C, _CONSTRAINTS, [words, negc2, s2], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                _ASM_FP16_C, _CONSTRAINTS, [words, negc2, s2], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:  # output k is nibble k // 2 + 4 (k % 2), as the PTX's
        o0 = (((words >> 0) & 0xF).to(tl.float32) - z) * s
        o1 = (((words >> 16) & 0xF).to(tl.float32) - z) * s
        o2 = (((words >> 4) & 0xF).to(tl.float32) - z) * s
        o3 = (((words >> 20) & 0xF).to(tl.float32) - z) * s
        o4 = (((words >> 8) & 0xF).to(tl.float32) - z) * s
        o5 = (((words >> 24) & 0xF).to(tl.float32) - z) * s
        o6 = (((words >> 12) & 0xF).to(tl.float32) - z) * s
        o7 = (((words >> 28) & 0xF).to(tl.float32) - z) * s
        o0, o1, o2, o3 = o0.to(OUT_DTYPE), o1.to(OUT_DTYPE), o2.to(OUT_DTYPE), o3.to(OUT_DTYPE)
        o4, o5, o6, o7 = o4.to(OUT_DTYPE), o5.to(OUT_DTYPE), o6.to(OUT_DTYPE), o7.to(OUT_DTYPE)
    return _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N, BLOCK_KW)


_ASM_BF16_C: tl.constexpr = tl.constexpr(_ASM_BF16)
_ASM_FP16_C: tl.constexpr = tl.constexpr(_ASM_FP16)
# Eight 16-bit outputs (one word's values), then the word, the packed -(magic + z) pair and the packed scale pair.
_CONSTRAINTS: tl.constexpr = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r")


@triton.jit
def accumulate_dot_tile(acc, x_ptr, rows, row_mask, stride_xm, stride_xk, qw_ptr, s_ptr, z_ptr, offs_n64, n_mask, kt,
                        group_size, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
                        HAS_ZEROS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc^T [BLOCK_N, R] float32 += W[offs_n, columns kt * BLOCK_K ..] @ x[rows, same columns]^T.

    kt is a K-tile index (not a column); the tile's words are dequantized by `_dequant_words` (one scale
    group per tile: group_size a multiple of BLOCK_K) and x is gathered in the same nibble order. rows: int64
    row indices of x [R], any order (e.g. the fused MoE's token rows), masked by row_mask; offs_n64 / n_mask
    the output rows. Shared by `quant_dot_kernel` and the int4 fused MoE."""
    BLOCK_KW: tl.constexpr = BLOCK_K // 8
    p = tl.arange(0, BLOCK_K)
    x_col = (p // 8) * 8 + slot_nibble(p)  # column of x that dequantized slot p multiplies
    offs_w = kt * BLOCK_KW + tl.arange(0, BLOCK_KW)
    words = tl.load(qw_ptr + offs_n64[:, None] * stride_qn + offs_w[None, :] * stride_qk,
                    mask=n_mask[:, None], other=0)
    g = (kt * BLOCK_K) // group_size
    s = tl.load(s_ptr + offs_n64 * stride_sn + g * stride_sg, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_ZEROS:
        z = tl.load(z_ptr + offs_n64 * stride_zn + g * stride_zg, mask=n_mask, other=0).to(tl.float32)[:, None]
    else:
        z = tl.full((BLOCK_N, 1), 8.0, tl.float32)
    w = _dequant_words(words, s, z, x_ptr.dtype.element_ty, ASM, BLOCK_N, BLOCK_KW)
    xt = tl.load(x_ptr + rows[None, :] * stride_xm + (kt * BLOCK_K + x_col)[:, None] * stride_xk,
                 mask=row_mask[None, :], other=0.0)  # [BLOCK_K, R]
    if x_ptr.dtype.element_ty == tl.float32:
        acc += tl.dot(w, xt, input_precision="ieee")
    else:
        acc += tl.dot(w, xt)
    return acc


@triton.jit
def quant_dot_kernel(
    x_ptr,  # [M, K] float16 / bfloat16 / float32
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, ngroups]
    z_ptr,  # uint8 [N, ngroups] (read when HAS_ZEROS)
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or float32 partials [SPLIT_K, M, N] when PARTIAL
    M, N, K, group_size, k_tiles_per_split,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn, stride_zg,
    stride_os, stride_om, stride_on,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    CLAMP_FP16: tl.constexpr,
    ASM: tl.constexpr,  # the PTX dequantization (bf16/fp16 activations on CUDA); else plain Triton
    BLOCK_M: tl.constexpr,  # >= 16 (the smallest tl.dot)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 8 that divides the group size (one group per K tile)
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over the K tiles of slice program_id(1) (module docstring); K must be
    a multiple of BLOCK_K (the caller checks)."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k, k_start, k_end = k_slice(K, k_tiles_per_split, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_m = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_n64 = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(k_start, k_end):
        acc = accumulate_dot_tile(acc, x_ptr, offs_m, m_mask, stride_xm, stride_xk, qw_ptr, s_ptr, z_ptr, offs_n64,
                                  n_mask, kt, group_size, stride_qn, stride_qk, stride_sn, stride_sg, stride_zn,
                                  stride_zg, HAS_ZEROS, ASM, BLOCK_N, BLOCK_K)
    store_tile(acc, out_ptr, bias_ptr, pid_k, offs_m, offs_n64, offs_n, n_mask, n_mask[:, None] & m_mask[None, :],
               stride_os, stride_om, stride_on, HAS_BIAS, PARTIAL, CLAMP_FP16)


def dot_supported(act_order: bool, bits: int, group_size: int, in_features: int, block_k: int) -> bool:
    """Whether `quant_dot_kernel` takes a weight with K tiles of block_k: 4-bit, no g_idx, K a multiple of
    block_k, and one group per K tile (group size -1 or a multiple of block_k)."""
    return (bits == 4 and not act_order and in_features % block_k == 0
            and (group_size == -1 or group_size % block_k == 0))
