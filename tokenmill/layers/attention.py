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

    `k_scale`, `v_scale` (host floats, default 1.0): the layer's fp8 KV-cache
    scales (vLLM's names), set by `set_kv_scale` from the checkpoint's
    `k_scale` / `v_scale` / `kv_scale` tensors; an fp8 cache stores k / k_scale
    and reads q8 * k_scale (likewise v). A 16-bit cache ignores them.
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
        # Host floats, not tensors: kernels take them as launch arguments (no device read per step, and a
        # CUDA graph bakes them in; they never change after loading).
        self.k_scale = 1.0
        self.v_scale = 1.0

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
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


# Checkpoint tensor name endings that carry fp8 KV-cache scales (vLLM's names, its
# `maybe_remap_kv_scale_name`), each -> the Attention attributes it sets. `kv_scale` is the older single
# scale for both; `k_proj.output_scale` / `v_proj.output_scale` are AutoFP8's.
KV_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
    ".self_attn.k_proj.output_scale": ("k_scale",),
    ".self_attn.v_proj.output_scale": ("v_scale",),
    ".self_attn.attn.k_scale": ("k_scale",),
    ".self_attn.attn.v_scale": ("v_scale",),
}
# Scales of fp8 attention arithmetic (query, probabilities): the kernels keep queries and probabilities in
# the model dtype, so these are skipped.
UNUSED_ATTENTION_SCALES = (".self_attn.q_scale", ".self_attn.prob_scale", ".self_attn.attn.q_scale",
                           ".self_attn.attn.prob_scale")


def set_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Take a checkpoint tensor if it is an fp8 KV-cache scale (or an unused attention scale).

    name: the checkpoint name, e.g. `model.layers.3.self_attn.k_scale`; tensor: one float ([] or [1]).
    Sets that layer's `Attention.k_scale` / `v_scale` (layers on another pipeline stage are skipped).

    Returns:
        True when the tensor was a scale (taken or skipped), False for any other name.

    Raises:
        ValueError: a scale tensor with more than one element, or one that is not finite and positive.
    """
    if name.endswith(UNUSED_ATTENTION_SCALES):
        return True
    for suffix, attrs in KV_SCALE_NAMES.items():
        if not name.endswith(suffix):
            continue
        if tensor.numel() != 1:
            raise ValueError(f"KV-cache scale {name!r} must hold one number (one scale per layer), not shape "
                             f"{list(tensor.shape)}.")
        value = float(tensor.float().reshape(()))
        if not (value > 0.0 and value != float("inf")):
            raise ValueError(f"KV-cache scale {name!r} is {value}; scales must be finite and positive.")
        try:
            attn = model.get_submodule(name[: -len(suffix)] + ".self_attn.attn")
        except AttributeError:  # a layer on another pipeline stage (PPMissingLayer)
            return True
        if isinstance(attn, Attention):
            for attr in attrs:
                setattr(attn, attr, value)
        return True
    return False
