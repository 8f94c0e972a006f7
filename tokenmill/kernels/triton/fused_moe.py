"""Fused MoE on CUDA: one Triton grouped-GEMM launch per projection.

The (token, expert) pairs of a step are sorted by expert and each expert's
run is padded to a multiple of BLOCK_M (`moe_align_block_size`), so every
BLOCK_M-row tile of the sorted list belongs to exactly one expert. One
program computes a `[BLOCK_M, BLOCK_N]` output tile of that expert:

    sorted pairs  | e0 e0 e0 pad | e1 pad pad pad | e3 e3 e3 e3 | e3 pad ... |
    tiles         |   tile 0     |    tile 1      |   tile 2    |  tile 3    |
    expert of tile     0               1                3            3

Launch 1 (w13, gate and up fused): rows of A are tokens (pair // top_k),
C [T * k, 2I]. Then act(gate) * up in PyTorch. Launch 2 (w2): rows of A are
pairs, the routing weight is applied to each row, C [T * k, H]; the top-k
rows of a token are summed in float32. Expert biases (gpt-oss) are added
around the launches, not in the kernel: after launch 1 each pair's row gets
its expert's gate/up bias, after launch 2 its routing weight times its
expert's down bias. The scheme is the grouped GEMM of
MegaBlocks (Gale et al. 2022) and vLLM's fused_moe; written here from that
description. Sorting needs no host sync (the tile count is bounded statically).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.moe_activation import act_and_mul


@triton.jit
def tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs, TOP_K_DIV: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """The pairs of sorted tile pid_m (`moe_align_block_size`'s layout) and where their rows come from.

    Returns (pair_ids int64 [BLOCK_M], pair_mask [BLOCK_M] (False on padding), expert int64 (the tile's),
    a_rows [BLOCK_M]: the A row of each pair, pair // TOP_K_DIV, 0 on padding).
    """
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    pair_mask = pair_ids < num_pairs
    expert = tl.load(tile_expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = tl.where(pair_mask, pair_ids // TOP_K_DIV, 0)
    return pair_ids, pair_mask, expert, a_rows


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]
    b_ptr,  # [E, N, K] expert weights (nn.Linear layout)
    c_ptr,  # [num_pairs, N]
    topk_weights_ptr,  # [num_pairs] float32 (read when MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [max_tiles * BLOCK_M] int32; num_pairs = padding
    tile_expert_ids_ptr,  # [max_tiles] int32
    num_pairs_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    TOP_K_DIV: tl.constexpr,  # A row of pair p is p // TOP_K_DIV (top_k for w13, 1 for w2)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE_FP32: tl.constexpr,  # exact fp32 dots (no TF32) for float32 models
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Tiles past the padded total exist only because the grid is sized statically.
    if pid_m * BLOCK_M >= tl.load(num_pairs_post_padded_ptr):
        return
    pair_ids, pair_mask, expert, a_rows = tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs,
                                                     TOP_K_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    # B tile read transposed, [BLOCK_K, BLOCK_N], so C = A @ B^T as nn.Linear.
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE_FP32:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair_ids[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, expert) pairs by expert, each expert's run padded to a multiple of `block_m`.

    Pair p = token * top_k + slot. No host sync: the output sizes are upper
    bounds that depend only on shapes.

    Args:
        topk_ids: [T, top_k] integer expert ids in [0, num_experts).

    Returns:
        sorted_pair_ids: [max_tiles * block_m] int32; pair ids grouped by
            expert (stable order inside an expert), `T * top_k` marks padding.
        tile_expert_ids: [max_tiles] int32, the expert of each tile (tiles
            past the padded total repeat the last expert and are skipped).
        num_pairs_post_padded: [1] int32, the padded total.

    Example (block_m = 2): topk_ids [[2, 0], [0, 1]] -> pairs' experts
    [2, 0, 0, 1], counts [2, 1, 1] -> padded [2, 2, 2] ->
    sorted_pair_ids [1, 2, 3, 4, 0, 4], tile_expert_ids [0, 1, 2],
    num_pairs_post_padded [6].
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a device->host size sync
    tiles = (counts + block_m - 1) // block_m
    padded_ends = torch.cumsum(tiles * block_m, 0)
    padded_starts = padded_ends - tiles * block_m
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    # Rank of each sorted pair inside its expert's run: [0, 1, 0, 0] for experts [0, 0, 1, 2].
    unpadded_starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - unpadded_starts[expert_of_sorted]
    # Sum of ceil(c_e / m) over experts <= (num_pairs + (#non-empty experts) * (m - 1)) / m.
    max_tiles = max(1, (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)
    sorted_pair_ids = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[padded_starts[expert_of_sorted] + rank] = order.to(torch.int32)
    tile_ends = torch.cumsum(tiles, 0)
    tile_expert_ids = torch.searchsorted(tile_ends, torch.arange(max_tiles, device=device), right=True)
    tile_expert_ids = tile_expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_pair_ids, tile_expert_ids, padded_ends[-1:].to(torch.int32)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
                  aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k_div: int, block_m: int) -> None:
    sorted_pair_ids, tile_expert_ids, num_post = aligned
    num_pairs, n = c.shape
    block_n, block_k = 64, 32
    grid = (tile_expert_ids.numel(), triton.cdiv(n, block_n))
    grouped_gemm_kernel[grid](
        a, b, c, topk_weights if topk_weights is not None else c,
        sorted_pair_ids, tile_expert_ids, num_post,
        n, b.shape[2], num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        TOP_K_DIV=top_k_div, MUL_ROUTED_WEIGHT=topk_weights is not None, IEEE_FP32=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    block_m: int | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `fused_experts_reference`, computed with two grouped-GEMM launches.

    Args:
        hidden_states: [T, H]; w13: [E, 2I, H]; w2: [E, H, I] (same dtype,
            float16 / bfloat16 / float32, contiguous experts).
        topk_weights: [T, k]; topk_ids: [T, k] in [0, E).
        block_m: rows per tile (16 or more, a power of two); default 16 for
            small batches (decode), 64 otherwise.
        w13_bias: [E, 2I] or None; w2_bias: [E, H] or None (see the reference).

    Returns:
        [T, H] in hidden_states' dtype.
    """
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if block_m is None:
        block_m = 16 if num_pairs <= 1024 else 64
    aligned = moe_align_block_size(topk_ids, block_m, w13.shape[0])
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=hidden_states.dtype, device=hidden_states.device)
    _grouped_gemm(hidden_states, w13, gate_up, None, aligned, top_k, block_m)
    pair_experts = topk_ids.reshape(-1)  # rows of gate_up and down are pairs p = token * top_k + slot
    if w13_bias is not None:
        gate_up += w13_bias.index_select(0, pair_experts)
    inter = act_and_mul(gate_up, activation)
    down = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden_states.device)
    pair_weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(inter, w2, down, pair_weights, aligned, 1, block_m)
    if w2_bias is not None:
        down += pair_weights[:, None] * w2_bias.index_select(0, pair_experts).float()
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden_states.dtype)
