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
    num_layers: int  # on this pipeline stage
    num_kv_heads: int  # on this tensor-parallel rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    first_layer: int = 0  # global index of this stage's first layer (pipeline parallelism)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers: 2 (K and V) * block_size * heads * head_dim * dtype size * layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem * self.num_layers


def kv_cache_spec(hf_config: Any, block_size: int, dtype: torch.dtype, tp_size: int | None = None) -> KVCacheSpec:
    """Read layer count, KV heads and head size from a transformers config.

    Multimodal configs (e.g. Gemma 3) are read through their text config.
    KV heads are split over tensor-parallel ranks as the attention layers
    split them (`distributed.partition.head_partition`: whole KV-head groups,
    possibly uneven, replicated when fewer heads than ranks); layers over
    pipeline stages. Rank and stage come from `distributed.parallel_state`;
    `tp_size` overrides the size (rank 0's share).
    """
    from tokenmill.distributed import parallel_state as ps
    from tokenmill.distributed.partition import head_partition, pp_layer_range

    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_heads = cfg.num_attention_heads
    total_kv = getattr(cfg, "num_key_value_heads", None) or num_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_size is None else 0
    tp = ps.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    num_kv = head_partition(num_heads, total_kv, tp, tp_rank).num_kv_heads
    start, end = pp_layer_range(cfg.num_hidden_layers, ps.get_pp_rank(), ps.get_pp_world_size())
    return KVCacheSpec(end - start, num_kv, head_dim, block_size, dtype, first_layer=start)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """Zeroed caches, one per layer of this stage (list indexed by global layer index). Zeros (not `empty`) matter: attention reads
    whole blocks and masks the unused slots, and NaN garbage there would leak
    through `0 * NaN` in the softmax-weighted sum."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    # Layers of earlier pipeline stages get empty placeholders so `kv_caches[layer_idx]` stays global.
    placeholders = [torch.empty(0, dtype=spec.dtype, device=device) for _ in range(spec.first_layer)]
    return placeholders + [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
