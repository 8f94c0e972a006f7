"""Attention layer: the model-facing wrapper around the step's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.forward_context import get_forward_context


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    Args:
        num_heads: query heads on this rank.
        head_dim: size of each head.
        scale: softmax scale (usually head_dim ** -0.5).
        num_kv_heads: key/value heads on this rank (divides num_heads; GQA/MQA).
        layer_idx: index into the forward context's `kv_caches`.
        sliding_window: attend only to the last `sliding_window` positions
            (self included), as HF's sliding-window mask; None = full.
        logits_soft_cap: Gemma-2/3 soft-capping of scores; None = off.

    forward(q, k, v, sinks=None): q [num_tokens, num_heads * head_dim], k and v
    [num_tokens, num_kv_heads * head_dim], same dtype; `sinks` [num_heads]
    (gpt-oss): one learned logit per head that joins each softmax
    denominator and contributes no value, or None; returns
    [num_tokens, num_heads * head_dim]. Outside a forward context with
    metadata (e.g. a profiling run with `attn_metadata=None`) it computes
    nothing and returns zeros of the right shape.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        layer_idx: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        if ctx.attn_metadata is None:
            return torch.zeros_like(q)
        md = ctx.attn_metadata
        if self.sliding_window is not None and ctx.attn_metadata_swa is not None:
            md = ctx.attn_metadata_swa  # the sliding-window KV group's block table and slots
        out = ctx.attn_backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            md,
            scale=self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=sinks,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
