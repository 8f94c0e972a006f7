"""Top-k softmax routing of a mixture-of-experts layer in one Triton launch.

Same contract as `layers.fused_moe.reference.select_experts` (softmax over
the router logits in float32, keep the top-k, optionally renormalise them
to sum to 1), which takes ~5 PyTorch launches (cast, softmax, topk, sum,
divide). Here one program handles ROWS tokens: the row max and the sum of
exp(x - max) give the softmax denominator, then k rounds of "largest
remaining logit" pick the experts in descending order (ties: the lowest
expert id), and each weight is exp(x - max) / sum (renormalised: divided by
the sum of the k kept probabilities). Choosing on the float32 logits
rather than on the rounded probabilities keeps the logits' strict order.
exp is libdevice's expf on a GPU (as PyTorch's softmax); the weights can
differ from PyTorch's by about one float32 ulp, the ids only where two
probabilities tie. Each expert is chosen at most once per token, also when
logits are -inf (weight 0) or NaN (treated as unavailable; a token whose
logits run out gets the lowest free experts with weight 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.numerics import exp_f32, use_libdevice

_MAX_EXPERTS = 4096


@triton.jit(do_not_specialize=["num_tokens"])
def topk_softmax_kernel(
    logits_ptr,  # [T, E] any float dtype, row stride stride_t
    weights_ptr,  # [T, TOP_K] float32 out
    ids_ptr,  # [T, TOP_K] int64 out
    num_tokens,
    num_experts,
    stride_t,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    E_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_tokens
    cols = tl.arange(0, E_PAD)
    mask = row_mask[:, None] & (cols[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :], mask=mask,
                other=float("-inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    row_max = tl.where(row_mask, row_max, 0.0)
    denom = tl.sum(tl.where(mask, exp_f32(x - row_max[:, None], USE_LIBDEVICE), 0.0), axis=1)
    denom = tl.where(row_mask, denom, 1.0)  # rows past T: no 0 / 0
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    ids = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    # Chosen (and padding) columns are tracked apart from the logits: marking a chosen expert with -inf
    # would let a later round pick it again once only -inf logits are left.
    taken = (cols[None, :] >= num_experts) | (x != x)  # [ROWS, E_PAD]
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), x), axis=1)
        idx = tl.min(tl.where((x == best[:, None]) & ~taken, cols[None, :], E_PAD), axis=1)
        # No candidate (NaN logits): the lowest expert not yet chosen, with weight 0.
        first_free = tl.min(tl.where(taken, E_PAD, cols[None, :]), axis=1)
        found = idx < E_PAD
        # (A row of only NaN logits has no free expert either: clamp to a valid id, weight 0.)
        idx = tl.minimum(tl.where(found, idx, first_free), num_experts - 1)
        prob = tl.math.div_rn(exp_f32(tl.where(row_mask, best - row_max, 0.0), USE_LIBDEVICE), denom)
        prob = tl.where(found, prob, 0.0)
        weights = tl.where(slots[None, :] == j, prob[:, None], weights)
        ids = tl.where(slots[None, :] == j, idx[:, None], ids)
        taken = taken | (cols[None, :] == idx[:, None])
    if RENORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None])
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    offs = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(weights_ptr + offs, weights, mask=out_mask)
    tl.store(ids_ptr + offs, ids.to(tl.int64), mask=out_mask)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in one launch (module docstring).

    Args:
        router_logits: [T, E] float32 / float16 / bfloat16 (last dim contiguous), E <= 4096.
        top_k: experts per token, 1 <= top_k <= E.
        renormalize: divide the kept probabilities by their sum.

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64), descending probability.

    Raises:
        ValueError: top_k outside [1, E] or E past 4096.
    """
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts or num_experts > _MAX_EXPERTS:
        raise ValueError(f"Top-k routing needs 1 <= top_k <= num_experts <= {_MAX_EXPERTS}, got top_k {top_k} and "
                         f"{num_experts} experts.")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    e_pad = max(16, triton.next_power_of_2(num_experts))
    rows = max(1, min(16, 2048 // e_pad))
    topk_softmax_kernel[(triton.cdiv(num_tokens, rows),)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), RENORMALIZE=renormalize,
        USE_LIBDEVICE=use_libdevice(router_logits), E_PAD=e_pad, ROWS=rows, num_warps=4,
    )
    return weights, ids
