"""Helpers shared by model classes: checkpoint-name -> fused-parameter loading."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

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
    `qkv_proj.weight.weight_loader(param, tensor, "q")`. Other names load
    with the parameter's own `weight_loader` (or a plain checked copy).

    Returns:
        The names (as in `model.named_parameters()`) of parameters written.

    Raises:
        ValueError: a checkpoint tensor matches no parameter, or its shape is wrong.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        for fragment, (fused, shard_id) in packed_modules_mapping.items():
            if fragment + "." in name:
                target = name.replace(fragment + ".", fused + ".")
                param = _lookup(params, target, name)
                param.weight_loader(param, tensor, shard_id)
                break
        else:
            target = name
            param = _lookup(params, target, name)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    return loaded


def _lookup(params: dict[str, nn.Parameter], target: str, original: str) -> nn.Parameter:
    param = params.get(target)
    if param is None:
        raise ValueError(f"Checkpoint tensor {original!r} matches no parameter of the model "
                         f"(is the checkpoint for another architecture?).")
    return param
