"""Fused MoE with MXFP4 expert weights on CUDA: grouped GEMMs that decode each expert tile in the K loop.

Same scheme as `fused_moe.py` and `fused_moe_quant.py` (`moe_align_block_size`
sorts the (token, expert) pairs by expert into BLOCK_M-row tiles of one
expert each; launch 1 computes [gate | up] = x @ w13[e]^T + b13[e] per pair,
then `moe_activation.act_and_mul` (gpt-oss's clamped SwiGLU); launch 2 the
routing-weighted rows of inter @ w2[e]^T + b2[e], summed over the top-k
slots in float32 by `fused_moe.moe_sum`, one launch). The B operand is gpt-oss's packed layout
(`kernels/mxfp4.py`): each program reads only its tile's expert's
`*_blocks` bytes (two E2M1 codes per byte, low nibble first) and `*_scales`
(one E8M0 byte per 32 values), 4.25 bits per weight, decodes a
[BLOCK_N, BLOCK_K] tile in registers to the activation dtype and feeds it to
`tl.dot`. No expert is ever materialized in 16 bits; experts no token routes
to are never read. The expert biases are added to the float32 accumulator.

Decode (`_decode_pairs`, three modes; all exact, checked bit for bit on
every byte by the tests):

- DECODE_PTX (bfloat16 on a GPU of cc >= 8.0, the H100/H200 path): inline
  PTX on 4 bytes at a time (`_E2M1X2_PTX`): prmt spreads two bytes into the
  16-bit lanes of a register, shifts and masks put each code's magnitude
  bits on bfloat16 bits 6-8 and its sign on bit 15 (the E2M1 value times
  2^-126, subnormal for e == 0), then two packed bf16x2 FMAs multiply by
  2^126 and by the E8M0 scale (a bfloat16 built from the scale byte's bits):
  about 3 instructions per value, no conversions.
- DECODE_BF16_BITS / DECODE_FP32_BITS (the interpreter, float32 and float16
  activations): the value times 2^(s - 127) built directly as the bits of a
  bfloat16 / float32 number, whose 8-bit exponent field has E8M0's bias.
  Code c = sign e1 e0 m, mag = c & 7, F = 7 (bfloat16) or 23 (float32)
  mantissa bits:

    mag >= 2, value (1 + m/2) 2^(e-1) 2^(s-127):  (mag << (F - 1)) + ((s - 1) << F)
    mag == 1, value 0.5 * 2^(s-127):              (s - 1) << F
    mag == 0:                                     0
    then the sign bit (bfloat16: (c & 8) << 12; float32: a negation)

  ((mag << (F - 1)) puts e on the exponent field's two low bits and m on the
  mantissa's top bit; adding (s - 1) << F adds s - 1 to that exponent.)
  Integer shifts, adds and selects only. All three are exact for scale
  bytes 2-252, the range the tests check (checkpoints use bytes near 127). float16 takes the
  float32 decode rounded once, as `kernels/mxfp4.py`'s decode followed by
  `.to(float16)`.

The decoded [BN, G, 16] low- and high-nibble halves are interleaved
(tl.join + reshape) into one [BLOCK_N, BLOCK_K] tile, the A operand of one
`tl.dot` from registers (acc^T = W A^T). Two K=16 dots per 32-value group
on even / odd columns of A instead were up to 8x slower on the H200. Up to 16
pairs (1-4 tokens: latency-bound) the next K tile's loads are issued before
this tile's decode and dot (PREFETCH).

cc < 8.0 (Volta, float16): the same grouped kernel for every M, one stage.
Triton lowers `tl.dot` to FMAs there (no tensor cores, shared/PLATFORMS.md)
for this kernel and for the 16-bit grouped GEMM alike, so decoding all
experts first (the path this replaced) would only add a dense write and read
of every expert per layer. Dequantize-then-cuBLAS (tensor cores on V100)
would need either the routed experts on the host (a device-to-host sync,
not CUDA-graph safe) or dense GEMMs over all E experts for every token
(E / top_k = 8x the FLOPs on gpt-oss-20b, 32x on -120b). Small M (decode) is
bound by reading the packed bytes, which this kernel does at 4.25 bits per
weight. Accumulation is float32 on every device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fused_moe import expert_activation, moe_align_block_size, moe_sum, tile_pairs
from tokenmill.kernels.triton.fused_moe_quant import GroupedQuantConfig
from tokenmill.kernels.triton.splitk import device_facts

_GROUP = 32  # values per E8M0 scale
_GROUP_BYTES = _GROUP // 2
_PREFETCH_MAX_PAIRS = 16  # up to this many (token, expert) pairs the K loop prefetches (H200 sweep)


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized output buffers (tests replace it to check that every element gets written)."""
    return torch.empty(shape, dtype=dtype, device=device)


# PTX of DECODE_PTX (bfloat16 on cc >= 8.0): 4 bytes ($4) and their 4 bfloat16 scales ($5, $6) -> the low
# nibbles' values ($0, $1) and the high nibbles' ($2, $3), two bfloat16 per register. prmt spreads two bytes
# into the two 16-bit lanes; shifts and masks put the code's 3 magnitude bits on bfloat16 bits 6-8 (exponent
# e on the exponent field's low bits, m on the mantissa's top bit) and its sign on bit 15: a bfloat16 equal to
# the E2M1 value times 2^-126 (subnormal for e == 0); times 2^126 (0x7E80) and times the scale, both exact.
_E2M1X2_PTX = tl.constexpr("""
{
.reg .b32 x, y, z, k, nz;
mov.b32 k, 0x7E807E80;
mov.b32 nz, 0x80008000;
prmt.b32 x, $4, 0, 0x4140;
shl.b32 y, x, 6;
and.b32 y, y, 0x01C001C0;
shl.b32 z, x, 12;
and.b32 z, z, 0x80008000;
or.b32 y, y, z;
fma.rn.bf16x2 y, y, k, nz;
fma.rn.bf16x2 $0, y, $5, nz;
shl.b32 y, x, 2;
and.b32 y, y, 0x01C001C0;
shl.b32 z, x, 8;
and.b32 z, z, 0x80008000;
or.b32 y, y, z;
fma.rn.bf16x2 y, y, k, nz;
fma.rn.bf16x2 $2, y, $5, nz;
prmt.b32 x, $4, 0, 0x4342;
shl.b32 y, x, 6;
and.b32 y, y, 0x01C001C0;
shl.b32 z, x, 12;
and.b32 z, z, 0x80008000;
or.b32 y, y, z;
fma.rn.bf16x2 y, y, k, nz;
fma.rn.bf16x2 $1, y, $6, nz;
shl.b32 y, x, 2;
and.b32 y, y, 0x01C001C0;
shl.b32 z, x, 8;
and.b32 z, z, 0x80008000;
or.b32 y, y, z;
fma.rn.bf16x2 y, y, k, nz;
fma.rn.bf16x2 $3, y, $6, nz;
}
""")

DECODE_BF16_BITS, DECODE_FP32_BITS, DECODE_PTX = 0, 1, 2  # `_decode_pairs` modes


@triton.jit
def _decode_pairs(byte, s, DECODE: tl.constexpr):
    """E2M1 pairs times 2^(s - 127) (module docstring): byte uint8 [..., J] (two codes each, low nibble
    first), s uint8 E8M0 bytes broadcastable to it -> (lo, hi), each [..., J]: the values of the low and the
    high nibbles (K columns 2j and 2j + 1), bfloat16 (DECODE_BF16_BITS, DECODE_PTX) or float32."""
    if DECODE == 2:
        s_bf = (tl.broadcast_to(s, byte.shape).to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # 2^(s - 127)
        lo_v, hi_v = tl.inline_asm_elementwise(_E2M1X2_PTX, "=r,=r,=r,=r,r,r,r", [byte, s_bf],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    elif DECODE == 0:
        byte = byte.to(tl.int32)
        sbits = (s.to(tl.int32) - 1) << 7
        lo, hi = byte & 0x0F, byte >> 4
        lo_m, hi_m = lo & 7, hi & 7
        lo_b = tl.where(lo_m >= 2, (lo_m << 6) + sbits, tl.where(lo_m == 1, sbits, 0)) | ((lo & 8) << 12)
        hi_b = tl.where(hi_m >= 2, (hi_m << 6) + sbits, tl.where(hi_m == 1, sbits, 0)) | ((hi & 8) << 12)
        lo_v = lo_b.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi_v = hi_b.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        byte = byte.to(tl.int32)
        sbits = (s.to(tl.int32) - 1) << 23
        lo, hi = byte & 0x0F, byte >> 4
        lo_m, hi_m = lo & 7, hi & 7
        lo_b = tl.where(lo_m >= 2, (lo_m << 22) + sbits, tl.where(lo_m == 1, sbits, 0))
        hi_b = tl.where(hi_m >= 2, (hi_m << 22) + sbits, tl.where(hi_m == 1, sbits, 0))
        lo_v = lo_b.to(tl.float32, bitcast=True)
        hi_v = hi_b.to(tl.float32, bitcast=True)
        lo_v = tl.where(lo >= 8, -lo_v, lo_v)
        hi_v = tl.where(hi >= 8, -hi_v, hi_v)
    return lo_v, hi_v


@triton.jit
def _load_tile(w_ptrs, s_ptrs, a_ptr, a_rows, pair_mask, n_mask, offs_g, offs_k, g0, K, stride_am, stride_ak,
               G: tl.constexpr):
    """The K tile starting at scale group g0 (masked past K): bytes uint8 [BN, G, 16], scales uint8 [BN, G, 1],
    A^T [G * 32, BM]."""
    g_mask = n_mask[:, None, None] & ((g0 + offs_g) * 32 < K)[None, :, None]
    byte = tl.load(w_ptrs + g0 * 16, mask=g_mask, other=0)
    s = tl.load(s_ptrs + g0, mask=g_mask, other=127)
    kk = g0 * 32 + offs_k
    a_t = tl.load(a_ptr + a_rows[None, :] * stride_am + kk[:, None] * stride_ak,
                  mask=(kk < K)[:, None] & pair_mask[None, :], other=0.0)
    return byte, s, a_t


@triton.jit
def _decode_dot(acc, byte, s, a_t, DECODE: tl.constexpr, IEEE_FP32: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """acc^T [BN, BM] += decode(byte, s) [BN, BLOCK_K] @ a_t [BLOCK_K, BM]."""
    lo, hi = _decode_pairs(byte, s, DECODE)
    # [BN, G, 16] x 2 -> [BN, G, 16, 2] -> [BN, BLOCK_K]: element 2j is byte j's low nibble.
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    if IEEE_FP32:
        return tl.dot(w, a_t, acc, input_precision="ieee")
    return tl.dot(w.to(a_t.dtype), a_t, acc)


@triton.jit
def grouped_mxfp4_gemm_kernel(
    a_ptr,  # [num_a_rows, K]
    wb_ptr,  # uint8 [E, N, K / 2]: `*_blocks` [E, N, K / 32, 16] with contiguous last two dims
    ws_ptr,  # uint8 [E, N, K / 32]: `*_scales`
    bias_ptr,  # [E, N] (read when HAS_BIAS)
    c_ptr,  # [num_pairs, N]
    topk_weights_ptr,  # [num_pairs] float32 (read when MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [max_tiles * BLOCK_M] int32; num_pairs = padding
    tile_expert_ids_ptr,  # [max_tiles] int32
    num_pairs_post_padded_ptr,  # [1] int32
    N, K, num_pairs,
    stride_am, stride_ak, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_cm, stride_cn,
    TOP_K_DIV: tl.constexpr,  # A row of pair p is p // TOP_K_DIV (top_k for w13, 1 for w2)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DECODE: tl.constexpr,  # `_decode_pairs` mode
    PREFETCH: tl.constexpr,  # issue the next K tile's loads before this tile's decode and dot
    IEEE_FP32: tl.constexpr,
    CLAMP_FP16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of 32
):
    """One [BLOCK_M, BLOCK_N] output tile of one expert: rows are the tile's (token, expert) pairs (sorted by
    `fused_moe.moe_align_block_size`), C[pair] = (A[pair // TOP_K_DIV] @ W[expert]^T + bias[expert]) (times
    the pair's routing weight when MUL_ROUTED_WEIGHT), W decoded from MXFP4 tile by tile inside the K loop,
    float32 accumulation. Grid (tiles, cdiv(N, BLOCK_N)); tiles past the padded total return.
    """
    G: tl.constexpr = BLOCK_K // 32
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Tiles past the padded total exist only because the grid is sized statically.
    if pid_m * BLOCK_M >= tl.load(num_pairs_post_padded_ptr):
        return
    pair_ids, pair_mask, expert, a_rows = tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs,
                                                     TOP_K_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_j = tl.arange(0, 16)
    offs_g = tl.arange(0, G)
    offs_k = tl.arange(0, BLOCK_K)
    # [BN, G, 16] byte pointers and [BN, G, 1] scale pointers of the K tile at group g0.
    w_ptrs = (wb_ptr + expert * stride_we + offs_n[:, None, None] * stride_wn + offs_g[None, :, None] * 16
              + offs_j[None, None, :])
    s_ptrs = ws_ptr + expert * stride_se + offs_n[:, None, None] * stride_sn + offs_g[None, :, None]
    # Transposed: acc^T [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @ a_tile^T (the decoded tile is the
    # dot's A operand, straight from registers; the quantized kernels do the same).
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PREFETCH:
        # Loads of K tile kt + 1 are issued before tile kt is decoded and multiplied, so their latency
        # overlaps that work (Triton does not pipeline loads whose values are decoded in registers).
        byte, s, a_t = _load_tile(w_ptrs, s_ptrs, a_ptr, a_rows, pair_mask, n_mask, offs_g, offs_k, 0, K, stride_am,
                                  stride_ak, G)
        for kt in range(0, tl.cdiv(K, BLOCK_K)):
            nxt = _load_tile(w_ptrs, s_ptrs, a_ptr, a_rows, pair_mask, n_mask, offs_g, offs_k, (kt + 1) * G, K,
                             stride_am, stride_ak, G)
            acc = _decode_dot(acc, byte, s, a_t, DECODE, IEEE_FP32, BLOCK_N, BLOCK_K)
            byte, s, a_t = nxt
    else:
        for kt in range(0, tl.cdiv(K, BLOCK_K)):
            byte, s, a_t = _load_tile(w_ptrs, s_ptrs, a_ptr, a_rows, pair_mask, n_mask, offs_g, offs_k, kt * G, K,
                                      stride_am, stride_ak, G)
            acc = _decode_dot(acc, byte, s, a_t, DECODE, IEEE_FP32, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        b = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += b[:, None]
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        acc = acc * rw[None, :]
    if CLAMP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    c_ptrs = c_ptr + pair_ids[None, :] * stride_cm + offs_n[:, None] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & pair_mask[None, :])


def _grouped_mxfp4_gemm(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                        c: torch.Tensor, topk_weights: torch.Tensor | None,
                        aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k_div: int, block_m: int,
                        cc70: bool, cfg: GroupedQuantConfig) -> None:
    sorted_pair_ids, tile_expert_ids, num_post = aligned
    num_pairs, n = c.shape
    k = scales.shape[2] * _GROUP
    # cc 9.0: 64 x 64 weight tiles at every M (H200 sweep at gpt-oss-20b's shapes, benchmarks/gpu/mxfp4_moe.py:
    # best or within 2% of it from 16 to 4096 tokens); up to 16 pairs (1-4 tokens) 64 x 128 with the next K
    # tile's loads issued before this one's decode (latency-bound there: 8% faster at 1 token; slower from 16
    # tokens on, where more programs hide the latency). cc 7.0 (FMA dots, float32 decode): 32 x 32, the
    # largest that compile without register spills at BLOCK_M 16 and 32 (sm_70 ptxas -v).
    prefetch = not cc70 and num_pairs <= _PREFETCH_MAX_PAIRS
    block_n = cfg.block_n or (32 if cc70 else 64)
    block_k = cfg.block_k or (32 if cc70 else 128 if prefetch else 64)
    num_stages = cfg.num_stages or (1 if cc70 else 3)
    if a.dtype != torch.bfloat16:
        decode = DECODE_FP32_BITS
    else:  # the PTX needs a compiled kernel (not the interpreter) and bf16x2 FMAs (cc 8.0)
        decode = DECODE_PTX if a.is_cuda and not cc70 else DECODE_BF16_BITS
    grid = (tile_expert_ids.numel(), triton.cdiv(n, block_n))
    grouped_mxfp4_gemm_kernel[grid](
        a, blocks, scales, bias if bias is not None else c, c, topk_weights if topk_weights is not None else c,
        sorted_pair_ids, tile_expert_ids, num_post,
        n, k, num_pairs,
        a.stride(0), a.stride(1), blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        bias.stride(0) if bias is not None else 0, c.stride(0), c.stride(1),
        TOP_K_DIV=top_k_div, MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_BIAS=bias is not None,
        DECODE=decode, PREFETCH=prefetch, IEEE_FP32=a.dtype == torch.float32,
        CLAMP_FP16=c.dtype == torch.float16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=num_stages,
    )


def _check_packed(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4
            or blocks.shape[-1] != _GROUP_BYTES or blocks.shape[:3] != scales.shape):
        raise ValueError(f"MXFP4 {name} must be blocks [E, N, K / 32, 16] and scales [E, N, K / 32] uint8, got "
                         f"blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}.")
    if blocks.stride(3) != 1 or blocks.stride(2) != _GROUP_BYTES or scales.stride(2) != 1:
        raise ValueError(f"MXFP4 {name} blocks and scales must be contiguous along K (call .contiguous()).")


def fused_experts_mxfp4_triton(
    hidden_states: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "swigluoai",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    block_m: int | None = None,
    config: GroupedQuantConfig | None = None,
) -> torch.Tensor:
    """`fused_experts_reference` with MXFP4 expert weights decoded inside the grouped GEMMs.

    Args:
        hidden_states: [T, H] bfloat16 / float16 / float32.
        w13_blocks: [E, 2I, H / 32, 16] uint8, w13_scales: [E, 2I, H / 32] uint8 (`[gate; up]` rows,
            `kernels/mxfp4.py` layout); w2_blocks: [E, H, I / 32, 16], w2_scales: [E, H, I / 32].
        topk_weights: [T, k] routing weights; topk_ids: [T, k] expert ids in [0, E).
        activation: `moe_activation.act_and_mul`'s name ("swigluoai" for gpt-oss).
        w13_bias: [E, 2I] or None; w2_bias: [E, H] or None (added once per pair, before the routing weight).
        block_m: rows per tile (16 or more, a power of two); default 16 up to 512 pairs (decode), 64 up to
            2048, 128 beyond (32 beyond 512 on cc 7.0).
        config: launch settings (`fused_moe_quant.GroupedQuantConfig`; block_k a multiple of 32; one_dot
            is not used); None: the defaults.

    Returns:
        [T, H] in hidden_states' dtype: sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]),
        e = topk_ids[t, j], W = `mxfp4.dequantize_mxfp4(blocks, scales)` in hidden_states' dtype.

    Raises:
        ValueError: the packed tensors' shapes disagree with each other or with H, or are not contiguous along K.
    """
    _check_packed(w13_blocks, w13_scales, "w13")
    _check_packed(w2_blocks, w2_scales, "w2")
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_inter = w13_blocks.shape[:2]
    if (w13_scales.shape[2] * _GROUP != hidden_size or w2_blocks.shape[:2] != (num_experts, hidden_size)
            or 2 * w2_scales.shape[2] * _GROUP != two_inter):
        raise ValueError(f"MXFP4 experts w13 [E={num_experts}, {two_inter}, {w13_scales.shape[2] * _GROUP}] and w2 "
                         f"[{w2_blocks.shape[0]}, {w2_blocks.shape[1]}, {w2_scales.shape[2] * _GROUP}] do not fit "
                         f"hidden size {hidden_size} (w13 must be [E, 2I, H], w2 [E, H, I]).")
    cfg = config or GroupedQuantConfig()
    if cfg.block_k % _GROUP:
        raise ValueError(f"block_k ({cfg.block_k}) must be a multiple of {_GROUP} for MXFP4.")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if cfg.block_m:
        block_m = cfg.block_m
    cap, _ = device_facts(hidden_states.device)
    cc70 = tuple(cap) < (8, 0)
    if block_m is None:  # H200 sweep: 16 up to 64 tokens x top-4, 64 at 256 tokens, 128 from 1024
        block_m = 16 if num_pairs <= 512 else 32 if cc70 else 64 if num_pairs <= 2048 else 128
    aligned = moe_align_block_size(topk_ids, block_m, num_experts)
    gate_up = _new_output((num_pairs, two_inter), hidden_states.dtype, hidden_states.device)
    _grouped_mxfp4_gemm(hidden_states, w13_blocks, w13_scales, w13_bias, gate_up, None, aligned, top_k, block_m,
                        cc70, cfg)
    inter = expert_activation(gate_up, activation)
    down = _new_output((num_pairs, hidden_size), torch.float32, hidden_states.device)
    _grouped_mxfp4_gemm(inter, w2_blocks, w2_scales, w2_bias, down, topk_weights.reshape(-1).float().contiguous(),
                        aligned, 1, block_m, cc70, cfg)
    return moe_sum(down, top_k, hidden_states.dtype)  # float32 sum, one rounding, float16 clamped
