"""Iterate over a HF checkpoint folder's tensors: safetensors (single or sharded) or PyTorch .bin."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch


def safetensors_files(folder: str) -> list[str]:
    """The folder's safetensors files, in load order.

    With `model.safetensors.index.json`, only the shards its `weight_map`
    names (some repos keep stale extra files next to them); otherwise every
    `*.safetensors` file. Empty list when there are none.

    Raises:
        ValueError: the index names a shard that is missing.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"Shards listed in {index} are missing: {', '.join(missing)}.")
        return files
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def safetensors_weights_iterator(files: list[str], device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each file, read straight onto `device` in the file's dtype."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def safetensors_tensor_names(files: list[str]) -> list[str]:
    """Every tensor name in the files, read from their headers only (no tensor data)."""
    from safetensors import safe_open

    names = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def pt_weights_iterator(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from `pytorch_model*.bin` files (weights_only unpickling).

    Raises:
        ValueError: the folder has no .bin weights.
    """
    files = sorted(glob.glob(os.path.join(folder, "*.bin")))
    files = [f for f in files if not os.path.basename(f).startswith("training_args")]
    if not files:
        raise ValueError(f"{folder} has no *.safetensors or *.bin weight files.")
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        del state
