"""The one scoped global: what the current forward pass's attention layers read.

Model code stays a plain `forward(input_ids, positions)`; attention layers
fetch the step's `AttentionMetadata` and their layer's KV cache from here.
Set only inside `set_forward_context(...)`, by the model runner.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    # kv_caches[layer_idx]: [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[torch.Tensor]
    # The backend implementation (see tokenmill/attention/backends/base.py).
    attn_backend: Any
    # With a sliding-window KV group (worker/kv_cache.py): the metadata of the sliding-window layers (their
    # block table and slot mapping; the rest as `attn_metadata`); None with one group.
    attn_metadata_swa: AttentionMetadata | None = None


_forward_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    """The current context. Raises RuntimeError outside `set_forward_context`."""
    if _forward_context is None:
        raise RuntimeError("No forward context: call the model inside set_forward_context(...).")
    return _forward_context


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, kv_caches: list[torch.Tensor], attn_backend: Any,
    attn_metadata_swa: AttentionMetadata | None = None,
) -> Iterator[None]:
    """Make the step's metadata, KV caches and backend visible to attention layers."""
    global _forward_context
    prev = _forward_context
    _forward_context = ForwardContext(attn_metadata, kv_caches, attn_backend, attn_metadata_swa)
    try:
        yield
    finally:
        _forward_context = prev
