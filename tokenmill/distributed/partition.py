"""How a model's sizes are split over tensor-parallel ranks and pipeline stages.

Attention heads are split by whole KV-head groups (a KV head and the query
heads that share it), so a rank never needs another rank's keys:

    9 query heads, 3 KV heads (groups of 3), tp=2  ->  rank 0: KV 0-1, q 0-5
                                                       rank 1: KV 2,   q 6-8

The split may be uneven (2 + 1 groups above); the o_proj input slice follows
it. With fewer KV heads than ranks each KV head is replicated on
`tp / num_kv_heads` ranks (vLLM's rule), which needs tp % num_kv_heads == 0
and num_heads % tp == 0. Column-parallel MLP sizes must divide evenly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class HeadPartition:
    """This rank's heads: query heads [q_start, q_start + num_heads), KV heads [kv_start, kv_start + num_kv_heads)."""

    num_heads: int
    q_start: int
    num_kv_heads: int
    kv_start: int


def head_partition(total_num_heads: int, total_num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadPartition:
    """Rank `tp_rank`'s share of the attention heads (see the module docstring).

    Raises:
        ValueError: the heads cannot be split over `tp_size` ranks; the
            message names the sizes that would work.
    """
    if total_num_heads % total_num_kv_heads != 0:
        raise ValueError(f"num_attention_heads ({total_num_heads}) must be a multiple of num_key_value_heads "
                         f"({total_num_kv_heads}).")
    if not heads_fit(total_num_heads, total_num_kv_heads, tp_size):
        works = [t for t in range(1, total_num_heads + 1) if heads_fit(total_num_heads, total_num_kv_heads, t)]
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split {total_num_heads} attention heads with "
            f"{total_num_kv_heads} KV heads (each rank needs whole KV-head groups, or, with more ranks than KV "
            f"heads, tp divisible by the KV heads and the heads divisible by tp). Sizes that work: "
            f"{', '.join(map(str, works))}."
        )
    group = total_num_heads // total_num_kv_heads  # query heads per KV head
    if tp_size <= total_num_kv_heads:
        base, extra = divmod(total_num_kv_heads, tp_size)
        num_kv = base + (1 if tp_rank < extra else 0)
        kv_start = tp_rank * base + min(tp_rank, extra)
        return HeadPartition(num_kv * group, kv_start * group, num_kv, kv_start)
    num_heads = total_num_heads // tp_size
    replicas = tp_size // total_num_kv_heads
    return HeadPartition(num_heads, tp_rank * num_heads, 1, tp_rank // replicas)


def heads_fit(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> bool:
    """Whether `head_partition` can split these heads over `tp_size` ranks."""
    if tp_size < 1 or tp_size > total_num_heads:
        return False
    if tp_size <= total_num_kv_heads:
        return True
    return tp_size % total_num_kv_heads == 0 and total_num_heads % tp_size == 0


def divide_evenly(size: int, tp_size: int, what: str) -> int:
    """`size // tp_size`.

    Raises:
        ValueError: `size` is not divisible by `tp_size`.
    """
    if size % tp_size != 0:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({tp_size}); use a "
                         f"tensor_parallel_size that divides it.")
    return size // tp_size


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of stage `pp_rank`: an even split, the remainder on the stages before the last.

    The last stage also runs the final norm and the LM head, so it gets no
    extra layer: 30 layers over 4 stages -> 8, 8, 7, 7.

    Raises:
        ValueError: fewer layers than stages.
    """
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the number of layers ({num_layers}); "
                         f"use at most {num_layers} stages.")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(extra):
        sizes[i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def _text_config(hf_config: Any) -> Any:
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _column_sizes(cfg: Any) -> dict[str, int]:
    """Column-parallel sizes of the MLP / experts that must divide by tp."""
    sizes = {}
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            sizes[key] = value
    return sizes


def tp_size_fits(hf_config: Any, tp_size: int) -> bool:
    """Whether a model with this transformers config can be split over `tp_size` ranks."""
    cfg = _text_config(hf_config)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads_fit(heads, kv, tp_size) and all(v % tp_size == 0 for v in _column_sizes(cfg).values())


def verify_parallel_sizes(hf_config: Any, tp_size: int, pp_size: int) -> None:
    """Check at start-up that the model splits over tp ranks and pp stages.

    Raises:
        ValueError: naming the offending sizes and the tensor_parallel_size
            values that would work.
    """
    cfg = _text_config(hf_config)
    if not tp_size_fits(hf_config, tp_size):
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        works = [t for t in range(1, heads + 1) if tp_size_fits(hf_config, t)]
        sizes = ", ".join(f"{k}={v}" for k, v in _column_sizes(cfg).items())
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not fit this model ({heads} attention heads, {kv} KV heads"
            f"{', ' + sizes if sizes else ''}): each rank needs whole KV-head groups (or, with more ranks than KV "
            f"heads, tp divisible by the KV heads and the heads divisible by tp) and the MLP sizes must divide "
            f"by tp. Sizes that work: {', '.join(map(str, works))}."
        )
    pp_layer_range(cfg.num_hidden_layers, 0, pp_size)
