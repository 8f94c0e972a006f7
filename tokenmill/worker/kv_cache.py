"""KV cache shape, size and allocation (the physical side of PagedAttention).

One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values), in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this tensor-parallel rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers: 2 (K and V) * block_size * heads * head_dim * dtype size * layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem * self.num_layers


def kv_cache_spec(hf_config: Any, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> KVCacheSpec:
    """Read layer count, KV heads and head size from a transformers config.

    Multimodal configs (e.g. Gemma 3) are read through their text config.
    KV heads are split over tensor-parallel ranks (replicated when fewer
    heads than ranks, as vLLM).
    """
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = cfg.num_attention_heads
    total_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return KVCacheSpec(cfg.num_hidden_layers, max(1, total_kv // tp_size), head_dim, block_size, dtype)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """Zeroed caches, one per layer. Zeros (not `empty`) matter: attention reads
    whole blocks and masks the unused slots, and NaN garbage there would leak
    through `0 * NaN` in the softmax-weighted sum."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
