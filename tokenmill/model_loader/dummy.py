"""Random weights for benchmarks and tests without a checkpoint (`--load-format dummy`)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from tokenmill.layers.layernorm import RMSNorm


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter deterministically: normal(0, std), biases 0, norms at scale 1.

    Values are drawn on the CPU in float32 from a generator seeded with
    `seed` and the parameter's name, then copied to each parameter's device
    and dtype, so the same seed gives the same weights on any device. A
    tensor-parallel shard (a parameter with `full_shape`) draws the full
    tensor and keeps its slice through its `weight_loader`, and layers on
    other pipeline stages do not shift the draws, so every tp/pp split holds
    the same model. RMSNorm weights are 1 (0 for the Gemma variant, which
    scales by 1 + w).
    """
    norm_weights = {id(m.weight): 0.0 if m.gemma else 1.0 for m in model.modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator(device="cpu")
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
        elif name.endswith("bias"):
            param.zero_()
        else:
            full_shape = tuple(getattr(param, "full_shape", param.shape))
            gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            values = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
            if full_shape != tuple(param.shape):
                param.weight_loader(param, values)
            else:
                param.copy_(values)
