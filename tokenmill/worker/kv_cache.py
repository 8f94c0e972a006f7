"""KV cache shape, size and allocation (the physical side of PagedAttention).

One tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values), in the KV cache dtype (`dtypes.kv_cache_dtype`: the
model dtype, or fp8 with `--kv-cache-dtype fp8*`, one byte per element, so
the same memory holds twice a 16-bit cache's blocks). With a sliding-window
group (`sliding_window_group`: half the layers full attention, half a
sliding window, as gpt-oss) the k-th sliding-window layer shares the k-th
full-attention layer's tensor: a block id then belongs to one group at a
time (core/kv_cache_manager.py hands them out), and a block costs half the
layers' bytes, so the same memory holds twice the blocks while
sliding-window layers keep only the window's blocks of each request.

The one size formula (`kv_bytes_per_block`) and the one "does a max_model_len sequence fit" check
(`check_max_model_len_fits`) live here; the KV dtype rule is `dtypes.kv_cache_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.dtypes import dtype_bytes
from tokenmill.platforms.memory import lazy_zeros


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype | str) -> int:
    """Bytes of one KV block over `num_layers` layers, for the layout [2, num_blocks, block_size, num_kv_heads,
    head_dim] per layer: 2 (K and V) * block_size * num_kv_heads * head_dim * bytes(dtype) * num_layers.

    dtype: a torch dtype or a name (`dtypes.dtype_bytes`; fp8 is 1 byte). Raises ValueError on an unknown name.
    """
    return 2 * block_size * num_kv_heads * head_dim * dtype_bytes(dtype) * num_layers


def blocks_per_sequence(num_tokens: int, block_size: int, window: int | None = None,
                        chunk: int | None = None) -> int:
    """Blocks one sequence of `num_tokens` holds at most: ceil(num_tokens / block_size), plus, with a
    sliding-window group of `window`, the blocks its sliding-window table holds during a step of at most
    `chunk` new tokens (default: the whole sequence at once): the window before the chunk and the chunk,
    plus one partly used block, never more than the whole sequence.

    block_size 16, window 128, chunk 2048, 4096 tokens -> 256 + min(256, ceil(2175 / 16) + 1 = 137) = 393.
    """
    full = -(-num_tokens // block_size)
    if window is None:
        return full
    span = window - 1 + (chunk if chunk is not None else num_tokens)
    return full + min(full, -(-span // block_size) + 1)


def check_max_model_len_fits(num_blocks: int, block_size: int, max_model_len: int,
                             memory_hint: str | None = None, window: int | None = None,
                             chunk: int | None = None) -> None:
    """Raise when one `max_model_len` sequence cannot fit in a KV cache of `num_blocks` blocks.

    memory_hint: what would give the KV cache more memory here (`tokenmill.config.kv_memory_hint`);
    default names every such flag. window, chunk: a sliding-window group (`blocks_per_sequence`).

    Raises:
        ValueError: with the largest max_model_len that fits (num_blocks * block_size with one group) and the
            flags that help.
    """
    if window is not None:
        if blocks_per_sequence(max_model_len, block_size, window, chunk) <= num_blocks:
            return
        lo, hi = 0, max_model_len  # the largest length that fits, by bisection (monotone in length)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_per_sequence(mid, block_size, window, chunk) <= num_blocks else (lo, mid - 1)
        raise ValueError(
            f"The KV cache holds {num_blocks} blocks x {block_size} tokens, shared by the full-attention and the "
            f"sliding-window layers (window {window}), fewer than one sequence of max_model_len={max_model_len} "
            f"needs. The largest max_model_len that fits is {lo}; pass --max-model-len {lo}, or "
            + (memory_hint or "give the KV cache more memory") + ".")
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


def sliding_window_group(hf_config: Any, pipeline_parallel_size: int = 1) -> int | None:
    """The window of a model's sliding-window KV group, or None when it has one group.

    Two groups when `layer_types` marks as many layers "sliding_attention"
    (with a `sliding_window`) as "full_attention" and nothing else, on one
    pipeline stage (gpt-oss: alternating, window 128). Other mixes (Gemma 3's
    5 local : 1 global) keep one group: pairing layers on shared tensors needs
    equal counts.
    """
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    types = list(getattr(cfg, "layer_types", None) or [])
    window = getattr(cfg, "sliding_window", None)
    if not getattr(cfg, "use_sliding_window", True):  # Qwen2/3: the window is off whatever layer_types says
        return None
    if not types or not window or pipeline_parallel_size != 1 or set(types) != {"full_attention", "sliding_attention"}:
        return None
    if types.count("sliding_attention") != types.count("full_attention"):
        return None
    return int(window)


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int  # on this pipeline stage
    num_kv_heads: int  # on this tensor-parallel rank
    head_dim: int
    block_size: int
    dtype: torch.dtype  # storage dtype of the KV tensors (`dtypes.kv_cache_dtype`): the model dtype or fp8
    first_layer: int = 0  # global index of this stage's first layer (pipeline parallelism)
    # With a sliding-window group: global indices of the full-attention and the sliding-window layers (equal
    # counts); the k-th of each share one tensor. Empty: one group, one tensor per layer.
    full_layers: tuple[int, ...] = ()
    swa_layers: tuple[int, ...] = ()

    @property
    def num_tensors(self) -> int:
        """KV tensors of this stage: one per layer, or one per (full, sliding-window) pair."""
        return len(self.full_layers) if self.swa_layers else self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over this stage's KV tensors (`kv_bytes_per_block`)."""
        return kv_bytes_per_block(self.num_tensors, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)


def kv_cache_spec(hf_config: Any, block_size: int, dtype: torch.dtype, tp_size: int | None = None,
                  two_groups: bool = False) -> KVCacheSpec:
    """Read layer count, KV heads and head size from a transformers config.

    Multimodal configs (e.g. Gemma 3) are read through their text config.
    KV heads are split over tensor-parallel ranks as the attention layers
    split them (`distributed.partition.head_partition`: whole KV-head groups,
    possibly uneven, replicated when fewer heads than ranks); layers over
    pipeline stages. Rank and stage come from `distributed.parallel_state`;
    `tp_size` overrides the size (rank 0's share). `two_groups`: the config
    has a sliding-window group (`sliding_window_group`) and it is used.
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
    full, swa = (), ()
    if two_groups:
        types = list(cfg.layer_types)
        full = tuple(i for i, t in enumerate(types) if t == "full_attention")
        swa = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return KVCacheSpec(end - start, num_kv, head_dim, block_size, dtype, first_layer=start, full_layers=full,
                       swa_layers=swa)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """Zeroed caches, one per layer of this stage (list indexed by global layer index). Zeros (not `empty`)
    matter: attention reads whole blocks and masks the unused slots, and NaN garbage there would leak through
    `0 * NaN` in the softmax-weighted sum.

    On CPU the zeros come from `platforms.memory.lazy_zeros` (an anonymous mmap on Linux): no time at start,
    and resident memory grows only as blocks are first written; the engine core has checked that the whole
    cache fits in the memory available (`platforms.memory.check_cpu_kv_cache_fits`)."""
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def zeros() -> torch.Tensor:
        if torch.device(device).type == "cpu":
            return lazy_zeros(shape, spec.dtype)
        return torch.zeros(shape, dtype=spec.dtype, device=device)

    if spec.swa_layers:  # the k-th sliding-window layer shares the k-th full-attention layer's tensor
        caches: list[torch.Tensor] = [torch.empty(0)] * spec.num_layers
        for full, swa in zip(spec.full_layers, spec.swa_layers, strict=True):
            caches[full] = caches[swa] = zeros()
        return caches
    # Layers of earlier pipeline stages get empty placeholders so `kv_caches[layer_idx]` stays global.
    placeholders = [torch.empty(0, dtype=spec.dtype, device=device) for _ in range(spec.first_layer)]
    return placeholders + [zeros() for _ in range(spec.num_layers)]
