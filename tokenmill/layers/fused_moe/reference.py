"""Mixture-of-experts routing and expert computation in plain PyTorch (any device).

Routing (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; HF
`MixtralTopKRouter` / `Qwen3MoeTopKRouter`): softmax over the router logits
in float32, keep the top-k experts per token, optionally renormalise their
probabilities to sum to 1 (Mixtral always; Qwen3-MoE when
`norm_topk_prob`).

Experts: expert e maps x -> w2[e] @ (act(w1[e] x) * (w3[e] x)), with
`w13[e] = [w1[e]; w3[e]]` (gate rows first, then up rows). A token's output
is the routing-weighted sum of its top-k experts' outputs. With biases
(gpt-oss), each projection adds its expert's bias before the activation and
before the routing weight: w2[e] @ act(w13[e] x + b13[e]) + b2[e].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels import use_fused_kernels
from tokenmill.kernels.moe_activation import act_and_mul


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing.

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token (1 <= top_k <= E).
        renormalize: divide the kept probabilities by their sum.

    Returns:
        (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64), experts
        in descending probability order (torch.topk's order, as HF). On CUDA
        one Triton launch (`kernels/triton/moe_routing.py`: weights within
        about a float32 ulp, ids equal but for tied probabilities).
    """
    if use_fused_kernels(router_logits):
        from tokenmill.kernels.triton.moe_routing import topk_softmax

        return topk_softmax(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_experts_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    quantize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Expert MLPs of every (token, expert) pair, grouped by expert, summed over top-k.

    Args:
        hidden_states: [T, H].
        w13: [E, 2 * I, H], `[gate; up]` rows per expert (I may be a TP shard).
        w2: [E, H, I].
        topk_weights: [T, k] routing weights (any float dtype).
        topk_ids: [T, k] integer expert ids in [0, E).
        activation: "silu" (SwiGLU), "gelu" or "swigluoai" (`kernels.moe_activation`).
        w13_bias: [E, 2 * I] or None; w2_bias: [E, H] or None (a TP rank other
            than 0 passes None: its partial sums are all-reduced).
        quantize: W8A8 references: [rows, K] -> [rows, K], applied to each projection's input rows (the
            tokens' rows, the activated rows) before the product, e.g. an FP8 quantize-dequantize per row.

    Returns:
        [T, H] in hidden_states' dtype. Products are in the input dtype (as
        HF's per-expert loop); the weighted sum over top-k is in float32.
    """
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    # Pair p = token * k + slot; sorting pairs by expert makes each expert's rows contiguous.
    # topk_ids [[2, 0], [0, 1]] -> flat [2, 0, 0, 1] -> order [1, 2, 3, 0], counts [2, 1, 1]
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    out = torch.zeros(num_tokens * top_k, hidden_size, dtype=torch.float32, device=hidden_states.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        x = hidden_states.index_select(0, pairs // top_k)
        b13 = w13_bias[expert] if w13_bias is not None else None
        b2 = w2_bias[expert] if w2_bias is not None else None
        q = quantize or (lambda rows: rows)
        y = F.linear(q(act_and_mul(F.linear(q(x), w13[expert], b13), activation)), w2[expert], b2)
        out.index_copy_(0, pairs, y.float())
    out = out.view(num_tokens, top_k, hidden_size) * topk_weights.float().unsqueeze(-1)
    return out.sum(dim=1).to(hidden_states.dtype)
