"""Random weights for benchmarks and tests without a checkpoint (`--load-format dummy`)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from tokenmill.layers.layernorm import RMSNorm
from tokenmill.model_loader.quantized import random_quantized


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill every parameter deterministically: normal(0, std), biases 0, norms at scale 1.

    Values are drawn in float32 on the parameter's own device (a CPU draw of
    an 8B model takes minutes, a GPU draw well under a second) from a
    generator of that device seeded with `seed` and the parameter's name,
    then cast into the parameter. The same seed gives the same weights on
    the same kind of device; CPU and CUDA generators differ, so a CPU model
    and a GPU model get different (equally distributed) weights. A
    tensor-parallel shard (a parameter with `full_shape`) draws the full
    tensor and keeps its slice through its `weight_loader`, and layers on
    other pipeline stages do not shift the draws, so every tp/pp split holds
    the same model. RMSNorm weights are 1 (0 for the Gemma variant, which
    scales by 1 + w). Quantized layers (`model_loader/quantized.py`) get
    valid random int4/int8 tensors of the same spread (`random_quantized`); FP8 weights get the normal draw
    quantized by their loader (`layers/fp8_params.quantizing_loader`, scales included); a parameter with a
    `dummy_init(param, seed)` attribute (packed quantized weights, e.g. MXFP4 experts) fills itself.
    """
    norm_weights = {id(m.weight): 0.0 if m.gemma else 1.0 for m in model.modules() if isinstance(m, RMSNorm)}
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
        elif (init := getattr(param, "dummy_init", None)) is not None:
            init(param, seed * 1_000_003 + zlib.crc32(name.encode()))
        elif name.endswith("bias"):
            param.zero_()
        else:
            full_shape = tuple(getattr(param, "full_shape", param.shape))
            param_seed = seed * 1_000_003 + zlib.crc32(name.encode())
            if getattr(param, "quant_kind", None) == "fp8_weight":  # its loader quantizes it, scales included
                param.weight_loader(param, draw_normal(full_shape, param.device, param_seed, std))
                continue
            if getattr(param, "quant_kind", None) is not None:
                gen = torch.Generator(device=param.device)
                gen.manual_seed(param_seed)
                values = random_quantized(param, full_shape, gen, std)
            else:
                values = draw_normal(full_shape, param.device, param_seed, std)
            if full_shape != tuple(param.shape):
                param.weight_loader(param, values)
            else:
                param.copy_(values)
            del values  # one float32 temporary at a time (the largest: Llama-3.1-8B's embedding, 2.1 GB)


def draw_normal(shape: tuple[int, ...], device: torch.device | str, seed: int, std: float) -> torch.Tensor:
    """A float32 tensor of `shape` on `device`, normal(0, std), from a generator of that device seeded with `seed`.

    Deterministic per (seed, device type); nothing is drawn on the CPU for
    a GPU tensor.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
