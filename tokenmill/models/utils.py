"""Helpers shared by model classes: checkpoint-name -> fused-parameter loading, pipeline-stage layers."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenmill.distributed.parallel_state import get_pp_rank, get_pp_world_size
from tokenmill.distributed.partition import pp_layer_range
from tokenmill.layers.linear import default_weight_loader


def load_weights_with_mapping(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, tuple[str, str | int]],
) -> set[str]:
    """Load HF-named tensors into `model`, routing fused parts to their shard.

    `packed_modules_mapping` maps a checkpoint name fragment to the fused
    parameter's fragment and shard id, e.g. `".q_proj": (".qkv_proj", "q")`:
    `model.layers.0.self_attn.q_proj.weight` is then loaded by
    `qkv_proj.weight.weight_loader(param, tensor, "q")`; a quantized layer's
    `.qweight` / `.scales` / `.qzeros` / `.g_idx` route the same way. Other names load
    with the parameter's own `weight_loader` (or a plain checked copy).
    Tensors of modules on another pipeline stage (`PPMissingLayer`) are skipped.

    Returns:
        The names (as in `model.named_parameters()`) of parameters written.

    Raises:
        ValueError: a checkpoint tensor matches no parameter, or its shape is wrong (naming the tensor).
    """
    params = dict(model.named_parameters())
    missing = _missing_prefixes(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard_id = route_checkpoint_name(name, packed_modules_mapping)
        if missing and target.startswith(missing):
            continue
        param = _lookup(params, target, name)
        try:
            if target != name:  # a part of a fused parameter
                param.weight_loader(param, tensor, shard_id)
            else:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        except ValueError as e:
            raise ValueError(f"Checkpoint tensor {name!r}: {e}") from e
        loaded.add(target)
    return loaded


def _lookup(params: dict[str, nn.Parameter], target: str, original: str) -> nn.Parameter:
    param = params.get(target)
    if param is None:
        raise ValueError(f"Checkpoint tensor {original!r} matches no parameter of the model "
                         f"(is the checkpoint for another architecture?).")
    return param


def checkpoint_renamer(renames: dict[str, str] | None) -> Callable[[str], str]:
    """name -> name with each fragment of `renames` replaced (Mixtral's `.block_sparse_moe.` -> `.mlp.`)."""
    if not renames:
        return lambda name: name
    pattern = re.compile("|".join(re.escape(k) for k in renames))
    return lambda name: pattern.sub(lambda m: renames[m.group(0)], name)


def route_checkpoint_name(name: str, packed_modules_mapping: dict[str, tuple[str, str | int]]
                          ) -> tuple[str, str | int | None]:
    """(model name, shard id) of a checkpoint tensor or module name; (name, None) when it is no fused part.

    `model.layers.0.self_attn.k_proj.qweight` -> (`model.layers.0.self_attn.qkv_proj.qweight`, "k").
    """
    dotted = name + "."
    for fragment, (fused, shard_id) in packed_modules_mapping.items():
        if fragment + "." in dotted:
            return dotted.replace(fragment + ".", fused + ".", 1)[:-1], shard_id
    return name, None


# ---- pipeline parallelism ----------------------------------------------------------


class PPMissingLayer(nn.Module):
    """Stands in for a module that lives on another pipeline stage (no parameters).

    Checkpoint tensors under it are skipped by `load_weights_with_mapping`.
    """

    def forward(self, *args, **kwargs):
        raise RuntimeError("This module lives on another pipeline stage.")


def make_layers(num_layers: int, layer_fn: Callable[[int], nn.Module]) -> tuple[int, int, nn.ModuleList]:
    """Decoder layers of this pipeline stage.

    Returns (start, end, layers): `layers` has all `num_layers` entries so
    checkpoint names and `layer_idx` stay global; layers outside [start, end)
    are `PPMissingLayer`s. Stage split: `partition.pp_layer_range`.
    """
    start, end = pp_layer_range(num_layers, get_pp_rank(), get_pp_world_size())
    layers = nn.ModuleList(layer_fn(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers


def _missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
