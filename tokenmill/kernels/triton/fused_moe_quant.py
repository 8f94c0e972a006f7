"""Fused MoE with int4/int8 expert weights on CUDA: grouped GEMMs that dequantize each expert tile in the K loop.

Same scheme as `fused_moe.py` (its `moe_align_block_size` sorts the
(token, expert) pairs by expert into BLOCK_M-row tiles of one expert each;
launch 1 computes [gate | up] = x @ w13[e]^T per pair, then act(gate) * up;
launch 2 computes the routing-weighted rows of inter @ w2[e]^T, summed over
the top-k slots in float32). The difference is the B operand: each program
loads its expert's packed int32 words, scales, zero points and g_idx (the
`quant_pack` layout with a leading expert dim) and dequantizes a
[BLOCK_N, BLOCK_K] tile in registers (`quant_linear._accumulate_tile`:
W[n, k] = (q - z[n, g(k)]) * s[n, g(k)], float32, rounded once to the
activation dtype) before `tl.dot`, so the weights are read at bits/16 of
their 16-bit size and never materialized.

cc < 8.0 (Volta): the same grouped `tl.dot` kernel, which Triton lowers to
FMAs there (no tensor cores, shared/PLATFORMS.md). It stays correct and
reads only the packed bytes. The alternative, dequantize-then-cuBLAS, would
either materialize every expert in 16 bits per layer (for Qwen3-30B-A3B's
w13, 128 x 1536 x 2048 x 2 bytes = 0.8 GB of temporary and traffic per
layer) or only the routed ones, which needs the routed set on the host (a
sync, not CUDA-graph safe). Accumulation is float32 on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.quant_pack import QuantTensors
from tokenmill.kernels.triton.fused_moe import expert_activation, moe_align_block_size, moe_sum, tile_pairs
from tokenmill.kernels.triton import quant_linear as _ql
from tokenmill.kernels.triton.quant_linear import _accumulate_tile, block_k_for, check_quant_tensors, kernel_groups
from tokenmill.kernels.triton.quant_dot import accumulate_dot_tile, dot_supported
from tokenmill.kernels.triton.splitk import device_facts


@triton.jit
def grouped_quant_gemm_kernel(
    a_ptr,  # [num_a_rows, K]
    qw_ptr,  # int32 [E, N, ceil(K / p)]
    s_ptr,  # [E, N, ngroups]
    z_ptr,  # uint8 [E, N, ngroups] (read when HAS_ZEROS)
    g_ptr,  # int32 [E, K] (read when GROUP_MODE == 2)
    c_ptr,  # [num_pairs, N]
    topk_weights_ptr,  # [num_pairs] float32 (read when MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [max_tiles * BLOCK_M] int32; num_pairs = padding
    tile_expert_ids_ptr,  # [max_tiles] int32
    num_pairs_post_padded_ptr,  # [1] int32
    N, K, num_pairs, group_size,
    stride_am, stride_ak,
    stride_qe, stride_qn, stride_qk, stride_se, stride_sn, stride_sg, stride_ze, stride_zn, stride_zg, stride_ge,
    stride_cm, stride_cn,
    TOP_K_DIV: tl.constexpr,  # A row of pair p is p // TOP_K_DIV (top_k for w13, 1 for w2)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    CLAMP_FP16: tl.constexpr,
    ONE_DOT: tl.constexpr,  # quant_linear._accumulate_tile's single-dot variant
    PTX_DEQ: tl.constexpr,  # quant_dot.accumulate_dot_tile (4-bit, one group per K tile): packed 16-bit dequant
    ASM: tl.constexpr,  # with PTX_DEQ: the PTX dequantization (16-bit activations on CUDA), else plain Triton
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of one expert: rows are the tile's (token, expert) pairs (sorted by
    `fused_moe.moe_align_block_size`), C[pair] = A[pair // TOP_K_DIV] @ dequantize(W[expert])^T, the expert's
    int4/int8 weights (`quant_pack` layout) dequantized tile by tile inside the K loop, float32 accumulation,
    optionally times the pair's routing weight. Grid (tiles, cdiv(N, BLOCK_N)); tiles past the padded total return.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Tiles past the padded total exist only because the grid is sized statically.
    if pid_m * BLOCK_M >= tl.load(num_pairs_post_padded_ptr):
        return
    pair_ids, pair_mask, expert, a_rows = tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs,
                                                     TOP_K_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    qw_e = qw_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    z_e = z_ptr + expert * stride_ze
    g_e = g_ptr + expert * stride_ge
    # Transposed: acc^T [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @ a_tile^T (the dequantized tile is the
    # dot's A operand, straight from registers; quant_linear's kernel does the same).
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if PTX_DEQ:
            acc = accumulate_dot_tile(acc, a_ptr, a_rows.to(tl.int64), pair_mask, stride_am, stride_ak, qw_e, s_e, z_e,
                                      offs_n.to(tl.int64), n_mask, kt, group_size, stride_qn, stride_qk, stride_sn,
                                      stride_sg, stride_zn, stride_zg, HAS_ZEROS, ASM, BLOCK_N, BLOCK_K)
        else:
            acc = _accumulate_tile(acc, a_ptr, a_rows, pair_mask, stride_am, stride_ak, qw_e, s_e, z_e, g_e, offs_n,
                                   n_mask, kt * BLOCK_K, K, group_size, stride_qn, stride_qk, stride_sn, stride_sg,
                                   stride_zn, stride_zg, BITS, HAS_ZEROS, GROUP_MODE, True, IEEE_FP32, BLOCK_K,
                                   ONE_DOT)
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        acc = acc * rw[None, :]
    if CLAMP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    c_ptrs = c_ptr + pair_ids[None, :] * stride_cm + offs_n[:, None] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & pair_mask[None, :])


# The fused MoE's PTX dequantization tile (`quant_dot.accumulate_dot_tile`) by default where it applies.
PTX_DEQ_DEFAULT = False


@dataclass(frozen=True)
class GroupedQuantConfig:
    """Launch settings of `grouped_quant_gemm_kernel` (0 / None: the default picked per call).

    block_k is in K columns (a multiple of 16 * p: each per-position dot needs K >= 16); one_dot: one tl.dot
    per K tile on the unpacked [BLOCK_N, BLOCK_K] tile instead of p dots of BLOCK_K / p.
    """

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 4
    num_stages: int = 0
    one_dot: bool = False
    # The PTX dequantization tile; None: the default PTX_DEQ_DEFAULT (off until an H200 run has checked and timed it).
    ptx_deq: bool | None = None


def _grouped_quant_gemm(a: torch.Tensor, w: QuantTensors, c: torch.Tensor, topk_weights: torch.Tensor | None,
                        aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k_div: int, block_m: int,
                        num_stages: int, config: GroupedQuantConfig | None = None) -> None:
    sorted_pair_ids, tile_expert_ids, num_post = aligned
    num_pairs, n = c.shape
    cfg = config or GroupedQuantConfig()
    # BLOCK_K: 16 packed words (quant_linear.block_k_for). BLOCK_N 64 as the 16-bit kernel, 32 for a few
    # pairs (decode): T = 1, top-8 of Qwen3-30B-A3B has 8 tiles x 1536 / 64 = 192 programs for 132 SMs,
    # too few to keep HBM busy; 32-wide tiles double them.
    block_n = cfg.block_n or (32 if num_pairs <= 64 else 64)
    block_k = cfg.block_k or block_k_for(w.bits)
    mode, gsize, g_idx = kernel_groups(w, block_k)
    qz = w.qzeros if w.qzeros is not None else w.scales
    gi = g_idx if g_idx is not None else w.qweight
    ptx = cfg.ptx_deq
    if ptx is None:
        ptx = PTX_DEQ_DEFAULT and device_facts(a.device)[0] >= (8, 0) and dot_supported(
            w.g_idx is not None, w.bits, w.group_size, w.in_features, block_k)
    elif ptx and not dot_supported(w.g_idx is not None, w.bits, w.group_size, w.in_features, block_k):
        raise ValueError(f"ptx_deq needs 4-bit experts without act-order whose K and group size are multiples of "
                         f"block_k {block_k}.")
    grid = (tile_expert_ids.numel(), triton.cdiv(n, block_n))
    grouped_quant_gemm_kernel[grid](
        a, w.qweight, w.scales, qz, gi, c, topk_weights if topk_weights is not None else c,
        sorted_pair_ids, tile_expert_ids, num_post,
        n, w.in_features, num_pairs, gsize,
        a.stride(0), a.stride(1),
        w.qweight.stride(0), w.qweight.stride(1), w.qweight.stride(2),
        w.scales.stride(0), w.scales.stride(1), w.scales.stride(2),
        qz.stride(0), qz.stride(1), qz.stride(2), gi.stride(0) if g_idx is not None else 0,
        c.stride(0), c.stride(1),
        TOP_K_DIV=top_k_div, MUL_ROUTED_WEIGHT=topk_weights is not None, BITS=w.bits,
        HAS_ZEROS=w.qzeros is not None, GROUP_MODE=mode, IEEE_FP32=a.dtype == torch.float32,
        CLAMP_FP16=c.dtype == torch.float16, ONE_DOT=cfg.one_dot, PTX_DEQ=ptx,
        ASM=a.is_cuda and a.dtype in (torch.float16, torch.bfloat16), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages or num_stages,
    )


def fused_experts_quant_triton(
    hidden_states: torch.Tensor,
    w13: QuantTensors,
    w2: QuantTensors,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    block_m: int | None = None,
    config: GroupedQuantConfig | None = None,
) -> torch.Tensor:
    """Same contract as `fused_experts_triton` / `fused_experts_reference`, with quantized expert weights.

    Args:
        hidden_states: [T, H] float16 / bfloat16 / float32.
        w13: `QuantTensors` with a leading expert dim: logical [E, 2I, H] (`[gate; up]` rows),
            qweight int32 [E, 2I, ceil(H / p)], scales / qzeros [E, 2I, ngroups], g_idx [E, H] or None.
        w2: logical [E, H, I]: qweight [E, H, ceil(I / p)], scales / qzeros [E, H, ngroups], g_idx [E, I].
        topk_weights: [T, k] routing weights; topk_ids: [T, k] expert ids in [0, E).
        activation: "silu" or "gelu" (`moe_activation.act_and_mul`).
        block_m: rows per tile (16 or more, a power of two); default 16 for up to 1024 pairs (decode:
            most tiles hold one or two pairs), 64 otherwise (the expert tile is reused by more rows).
        config: launch settings of both grouped GEMMs (`GroupedQuantConfig`; its block_m, when set, wins
            over `block_m`); None: the defaults (sweeps: benchmarks/gpu/sweep_quant.py).

    Returns:
        [T, H] in hidden_states' dtype: sum_j topk_weights[t, j] * w2[e] @ act_and_mul(w13[e] @ x[t]),
        e = topk_ids[t, j], with W = quant_pack.dequantize(...) in hidden_states' dtype.

    Raises:
        ValueError: the weights' shapes disagree with each other, with H, or with their bits / groups.
    """
    check_quant_tensors(w13, experts=True)
    check_quant_tensors(w2, experts=True)
    num_tokens, hidden_size = hidden_states.shape
    num_experts, two_inter = w13.qweight.shape[:2]
    if w13.in_features != hidden_size or w2.qweight.shape[:2] != (num_experts, hidden_size) \
            or 2 * w2.in_features != two_inter:
        raise ValueError(f"Quantized expert weights w13 [E={num_experts}, {two_inter}, {w13.in_features}] and "
                         f"w2 [{w2.qweight.shape[0]}, {w2.qweight.shape[1]}, {w2.in_features}] do not fit hidden "
                         f"size {hidden_size} (w13 must be [E, 2I, H], w2 [E, H, I]).")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if config is not None and config.block_m:
        block_m = config.block_m
    if block_m is None:
        block_m = 16 if num_pairs <= 1024 else 32 if num_pairs <= 4096 else 64  # H200 sweep: T=256 x top-8 best at 32
    cap, _ = device_facts(hidden_states.device)
    num_stages = 1 if tuple(cap) < (8, 0) else 2
    aligned = moe_align_block_size(topk_ids, block_m, num_experts)
    gate_up = _ql._new_output((num_pairs, two_inter), hidden_states.dtype, hidden_states.device)
    _grouped_quant_gemm(hidden_states, w13, gate_up, None, aligned, top_k, block_m, num_stages, config)
    inter = expert_activation(gate_up, activation)
    down = _ql._new_output((num_pairs, hidden_size), torch.float32, hidden_states.device)
    _grouped_quant_gemm(inter, w2, down, topk_weights.reshape(-1).float().contiguous(), aligned, 1, block_m,
                        num_stages, config)
    return moe_sum(down, top_k, hidden_states.dtype)  # float32 sum, one rounding, float16 clamped
