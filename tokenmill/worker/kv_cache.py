"""KV cache shape, size and allocation (the physical side of PagedAttention).

One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values), in the model dtype.

The one size formula (`kv_bytes_per_block`) and the one "does a
max_model_len sequence fit" check (`check_max_model_len_fits`) live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.dtypes import dtype_bytes


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype | str) -> int:
    """Bytes of one KV block over `num_layers` layers, for the layout [2, num_blocks, block_size, num_kv_heads,
    head_dim] per layer: 2 (K and V) * block_size * num_kv_heads * head_dim * bytes(dtype) * num_layers.

    dtype: a torch dtype or a name (`dtypes.dtype_bytes`; fp8 is 1 byte). Raises ValueError on an unknown name.
    """
    return 2 * block_size * num_kv_heads * head_dim * dtype_bytes(dtype) * num_layers


def check_max_model_len_fits(num_blocks: int, block_size: int, max_model_len: int,
                             memory_hint: str | None = None) -> None:
    """Raise when one `max_model_len` sequence cannot fit in a KV cache of `num_blocks` blocks.

    memory_hint: what would give the KV cache more memory here (`tokenmill.config.kv_memory_hint`);
    default names every such flag.

    Raises:
        ValueError: with the largest max_model_len that fits (num_blocks * block_size) and the flags that help.
    """
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        raise ValueError(
            f"The KV cache holds {num_blocks} blocks x {block_size} tokens = {capacity} tokens, fewer than one "
            f"sequence of max_model_len={max_model_len} needs. The largest max_model_len that fits is {capacity}; "
            f"pass --max-model-len {capacity}, or "
            + (memory_hint or "give the KV cache more memory (--kv-cache-memory-bytes / --gpu-memory-utilization / "
               "--num-gpu-blocks-override)")
            + "."
        )


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
        """Bytes of one block over this stage's layers (`kv_bytes_per_block`)."""
        return kv_bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


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
