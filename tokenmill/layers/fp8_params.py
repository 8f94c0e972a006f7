"""FP8 (e4m3) parameters of linear and fused-MoE layers, their loaders and their tensor-parallel slices.

An FP8 layer holds, instead of a 16-bit `weight [N, K_r]` (MoE: a leading expert dim E):

    weight        float8_e4m3fn [N, K_r]              quant_kind "fp8_weight"
    weight_scale  float32 [N]                         quant_kind "weight_scale" (per output row)
                  float32 [N, ceil(K_r / Bk)]         block scales, repeated over each block's Bn rows
    input_scale   float32 [1]                         quant_kind "input_scale" (static activations, linear only)

One scale per output row (`quantization/fp8.py` converts per-tensor and block checkpoint scales to it) makes
every output split a row slice: q/k/v and gate/up parts, column-parallel ranks and experts load with the
16-bit layers' own weight loaders. A row-parallel rank's input rows [start, start + K_r) keep the K blocks
they cover, so `start` must be a multiple of Bk (`make_fp8_params` refuses other splits at start-up).
The fused parts of a layer read one input, so a static layer keeps the largest of their input_scales.

A 16-bit tensor loaded into an FP8 weight is quantized on the way in (`quantizing_loader`): `--quantization
fp8` (per output row over all of K, before any tensor-parallel slicing, so every split holds the same
values) and dummy weights (the scheme's own blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.kernels.fp8 import FP8_DTYPE, Fp8Weight, quantize_fp8_block, quantize_fp8_per_row

if TYPE_CHECKING:
    from tokenmill.layers.quant_params import InputShard
    from tokenmill.quantization import QuantizationConfig

FP8_KINDS = ("fp8_weight", "weight_scale", "input_scale")
DUMMY_INPUT_SCALE = 1.0 / 16  # static scale of dummy weights: activations up to 448 / 16 = 28 stay unclipped


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a checkpoint's FP8 layers are stored and run (the part of `QuantizationConfig` layers need)."""

    block_size: tuple[int, int] | None  # (Bn, Bk) of block scales, None: one scale per output row
    activations: str | None  # "dynamic" | "static" (input_scale) | None: weight-only (W8A16)

    @classmethod
    def from_config(cls, cfg: QuantizationConfig) -> Fp8Scheme:
        """From an FP8 `tokenmill.quantization.QuantizationConfig` (weight_block_size, activation_scheme)."""
        return cls(cfg.weight_block_size, cfg.activation_scheme)

    @property
    def block_k(self) -> int | None:
        """Bk, the K run of one scale, or None for per-row scales."""
        return None if self.block_size is None else self.block_size[1]


def make_fp8_params(lead: tuple[int, ...], rows: int, full_rows: int, shard: InputShard, scheme: Fp8Scheme,
                    device: torch.device | str, with_input_scale: bool) -> dict[str, nn.Parameter]:
    """Empty FP8 parameters for a weight [*lead, rows, K_r] (full checkpoint: [*lead, full_rows, K]).

    Each carries `quant_kind` and `full_shape` (what its weight loader accepts unsharded); `weight_scale`
    and `input_scale` fill themselves under dummy weights from their weight (`dummy_init`).
    Returns {"weight", "weight_scale", ["input_scale"]} -> Parameter.

    Raises:
        ValueError: this rank's input rows start inside a K block of the block scales.
    """
    bk = scheme.block_k
    if bk is not None and shard.start % bk:
        raise ValueError(f"A tensor-parallel shard of the input dim starts at row {shard.start}, inside a "
                         f"{bk}-wide block of the FP8 weight scales; use a tensor_parallel_size that splits the "
                         f"layer's {shard.full} input rows into multiples of {bk}.")
    scale_cols = () if bk is None else (-(-shard.size // bk),)
    full_cols = () if bk is None else (-(-shard.full // bk),)
    specs = {
        "weight": ((*lead, rows, shard.size), FP8_DTYPE, (*lead, full_rows, shard.full), "fp8_weight"),
        "weight_scale": ((*lead, rows, *scale_cols), torch.float32, (*lead, full_rows, *full_cols), "weight_scale"),
    }
    if with_input_scale:
        specs["input_scale"] = ((1,), torch.float32, (1,), "input_scale")
    params = {}
    for name, (shape, dtype, full_shape, kind) in specs.items():
        param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
        param.quant_kind, param.full_shape, param.fp8_block_k = kind, full_shape, bk
        params[name] = param
    params["weight_scale"].dummy_init = _filled_by_weight
    params["weight_scale"].loaded_with_weight = True  # the loader's missing-weights check looks at the weight
    if with_input_scale:
        params["input_scale"].dummy_init = _dummy_input_scale
    return params


def _filled_by_weight(param: nn.Parameter, seed: int) -> None:
    """Dummy weights: a weight_scale is written by its weight's `quantizing_loader`."""


def _dummy_input_scale(param: nn.Parameter, seed: int) -> None:
    param.fill_(DUMMY_INPUT_SCALE)


def quantize_16bit(loaded: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A full 16/32-bit checkpoint tensor [..., R, K] -> (q float8_e4m3fn [..., R, K], scale float32 [..., R] or
    [..., R, ceil(K / Bk)]): per output row over all of K, or the scheme's Bn x Bk blocks (scales repeated per row)."""
    if scheme.block_size is None:
        q, s = quantize_fp8_per_row(loaded)
        return q, s.squeeze(-1)
    bn, _ = scheme.block_size
    flat = loaded.reshape(-1, *loaded.shape[-2:])
    qs, ss = zip(*(quantize_fp8_block(w, scheme.block_size) for w in flat))
    q = torch.stack(qs).reshape(loaded.shape)
    s = torch.stack([x.repeat_interleave(bn, dim=0)[:loaded.shape[-2]] for x in ss])
    return q, s.reshape(*loaded.shape[:-1], s.shape[-1])


def quantizing_loader(inner: Callable[..., None], scale: nn.Parameter, scheme: Fp8Scheme) -> Callable[..., None]:
    """The weight loader of an FP8 `weight`: FP8 tensors go to `inner` as they are; a 16/32-bit tensor is
    quantized (`quantize_16bit`) and its scales go through `inner` into `scale` with the same shard arguments."""

    @functools.wraps(inner)
    def load(param: nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
        if loaded.dtype != FP8_DTYPE:
            q, s = quantize_16bit(loaded, scheme)
            inner(scale, s, *args, **kwargs)
            loaded = q
        inner(param, loaded, *args, **kwargs)

    return load


def load_input_scale(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Keep the largest input_scale of a fused layer's parts (they quantize one input; the largest clips none).

    Raises:
        ValueError: the tensor is not one scale.
    """
    if loaded.numel() != 1:
        raise ValueError(f"input_scale of shape {tuple(loaded.shape)} must hold one scale.")
    param.data.copy_(torch.maximum(param.data, loaded.reshape(1).to(param.device, torch.float32)))


def narrow_fp8_input(param: torch.Tensor, loaded: torch.Tensor, shard: InputShard, dim: int = -1) -> torch.Tensor:
    """This rank's part of the input dim of a full FP8 checkpoint tensor: the weight's rows
    [start, start + size), block scales' K blocks (start is a multiple of Bk), per-row scales whole."""
    kind = param.quant_kind
    if kind == "fp8_weight":
        return loaded.narrow(dim, shard.start, shard.size)
    if kind == "weight_scale" and param.fp8_block_k is not None:
        bk = param.fp8_block_k
        return loaded.narrow(dim, shard.start // bk, -(-shard.size // bk))
    return loaded


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme,
               input_scale: torch.Tensor | None = None) -> Fp8Weight:
    """The `kernels.fp8.Fp8Weight` of a layer's (or all experts' [E * N, K]) FP8 tensors: per-row scales, or
    block scales as (1, Bk) blocks."""
    block = None if scheme.block_k is None else (1, scheme.block_k)
    return Fp8Weight(weight, scale, block, input_scale if scheme.activations == "static" else None)
