"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention over a mixed batch of prefill chunks and decodes.

    `forward` first writes the step's new keys/values into `kv_cache` at
    `attn_metadata.slot_mapping` (slot -1 is skipped), then computes causal
    attention of each new token over its request's cached + new tokens.
    `kv_cache` is in the model dtype or in fp8 (float8_e4m3fn / float8_e5m2,
    `kernels/kv_fp8.py`); every backend reads and writes both.
    """

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,  # attend to the last `sliding_window` positions (incl. self)
        logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
        # [num_heads] float32 logit per head added to each softmax denominator as exp(sink), no value (gpt-oss)
        sinks: torch.Tensor | None = None,
        # fp8 KV cache (`--kv-cache-dtype fp8*`): the layer's scales, host floats; stored k / k_scale, read
        # q8 * k_scale (likewise v). A cache in the model dtype ignores them.
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
