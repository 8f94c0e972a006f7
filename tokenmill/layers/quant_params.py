"""int4/int8 weight-only parameters of linear and fused-MoE layers, and their tensor-parallel slices.

A quantized layer holds, instead of `weight [N, K]`, the tensors of
`kernels/quant_pack.py`'s layout (dense: no leading dim; MoE: a leading
expert dim E), each a parameter tagged `quant_kind`:

    qweight  int32 [N, ceil(K_r / p)]        quant_kind "qweight"
    scales   float [N, ngroups_r]            quant_kind "scales" (`scale_dtype`)
    qzeros   uint8 [N, ngroups_r]            quant_kind "qzeros" (only with zero points)
    g_idx    int32 [K_r]                     quant_kind "g_idx"  (only for act-order checkpoints)

where K_r is this rank's input size (all of K except for row-parallel
layers). Column-parallel layers slice rows of every tensor but g_idx (the
output split does not touch K). Row-parallel layers slice the input dim
(`narrow_input`): qweight's words (K_r / p each rank, so a shard must start
on a word), the group columns that rank's rows use, and, for act-order,
g_idx (every rank keeps all groups: act-order spreads a group over all of
K). A row shard that starts inside a group (e.g. K = 3 * 128 over 2 ranks)
keeps the groups it touches and gets a synthesized `g_idx` buffer (local
row -> local group), the act-order form of the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.quant_pack import QuantTensors, pack_factor
from tokenmill.layers.fp8_params import FP8_KINDS, narrow_fp8_input

if TYPE_CHECKING:
    from tokenmill.quantization import QuantizationConfig

QUANT_KINDS = ("qweight", "scales", "qzeros", "g_idx")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """How a checkpoint quantizes its layers (the part of `quantization.QuantizationConfig` layers need)."""

    bits: int  # 4 or 8
    group_size: int  # rows of K per scale; -1 = one group over all of K (per channel)
    has_zeros: bool  # qzeros tensors present (else symmetric, zero 2^(bits-1))
    act_order: bool  # g_idx tensors present

    @classmethod
    def from_config(cls, cfg: QuantizationConfig) -> QuantScheme:
        """From a `tokenmill.quantization.QuantizationConfig` (bits, group_size, has_zeros, act_order)."""
        return cls(cfg.bits, cfg.group_size, cfg.has_zeros, cfg.act_order)

    @property
    def pack(self) -> int:
        """Values per int32 word: 8 for 4-bit, 4 for 8-bit (`quant_pack.pack_factor`)."""
        return pack_factor(self.bits)


@dataclass(frozen=True, slots=True)
class InputShard:
    """This rank's rows [start, start + size) of the input dim K (K_full of them in the checkpoint)."""

    start: int
    size: int
    full: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def group_range(scheme: QuantScheme, shard: InputShard) -> tuple[int, int]:
    """The group columns [g0, g1) this rank keeps: all groups for act-order, else those its rows use."""
    g = shard.full if scheme.group_size == -1 else scheme.group_size
    if scheme.act_order:
        return 0, _ceil_div(shard.full, g)
    return shard.start // g, _ceil_div(shard.start + shard.size, g)


def needs_synthetic_g_idx(scheme: QuantScheme, shard: InputShard) -> bool:
    """True when a row shard starts inside a group, so `k // G` no longer gives a local row's group."""
    return not scheme.act_order and scheme.group_size != -1 and shard.start % scheme.group_size != 0


def synthetic_g_idx(scheme: QuantScheme, shard: InputShard) -> torch.Tensor:
    """int32 [K_r]: the local group of each local row of a shard that starts inside a group."""
    g0, _ = group_range(scheme, shard)
    rows = torch.arange(shard.start, shard.start + shard.size)
    return (rows // scheme.group_size - g0).to(torch.int32)


def scale_dtype(weight: torch.Tensor) -> torch.dtype:
    """dtype of a quantized layer's scales: the weight's on GPUs (the kernels read it), float32 on the CPU.

    A CPU layer is dequantized right after loading, so float32 scales (exact
    for the float16 / bfloat16 / float32 scales checkpoints store) round the
    dense weight once, into the model's dtype, instead of twice.
    """
    return torch.float32 if weight.device.type == "cpu" else weight.dtype


def make_quant_params(lead: tuple[int, ...], rows: int, full_rows: int, shard: InputShard, scheme: QuantScheme,
                      dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.nn.Parameter]:
    """Empty quantized parameters for a weight [*lead, rows, K_r] (full checkpoint: [*lead, full_rows, K]).

    Each parameter carries `quant_kind` and `full_shape` (the unsharded
    checkpoint tensor its weight loader accepts; the dummy loader draws it),
    and the scheme's `quant_bits`, `quant_group_size` and the full K `full_in_features`.
    Returns {"qweight", "scales", ["qzeros"], ["g_idx"]} -> Parameter.

    Raises:
        ValueError: the shard starts inside a packed int32 word.
    """
    p = scheme.pack
    if shard.start % p:
        raise ValueError(f"A tensor-parallel shard of the input dim starts at row {shard.start}, inside a packed "
                         f"int32 word of {p} {scheme.bits}-bit values; use a tensor_parallel_size that splits the "
                         f"layer's {shard.full} input rows into multiples of {p}.")
    g0, g1 = group_range(scheme, shard)
    ng_full = _ceil_div(shard.full, shard.full if scheme.group_size == -1 else scheme.group_size)
    specs = {
        "qweight": ((*lead, rows, _ceil_div(shard.size, p)), torch.int32, (*lead, full_rows, _ceil_div(shard.full, p))),
        "scales": ((*lead, rows, g1 - g0), dtype, (*lead, full_rows, ng_full)),
    }
    if scheme.has_zeros:
        specs["qzeros"] = ((*lead, rows, g1 - g0), torch.uint8, (*lead, full_rows, ng_full))
    if scheme.act_order:
        specs["g_idx"] = ((*lead, shard.size), torch.int32, (*lead, shard.full))
    params = {}
    for kind, (shape, dt, full_shape) in specs.items():
        param = torch.nn.Parameter(torch.empty(shape, dtype=dt, device=device), requires_grad=False)
        param.quant_kind = kind
        param.full_shape = full_shape
        # What a loader drawing random full tensors needs (model_loader/quantized.py `random_quantized`).
        param.quant_bits, param.quant_group_size, param.full_in_features = scheme.bits, scheme.group_size, shard.full
        params[kind] = param
    return params


def narrow_input(param: torch.Tensor, loaded: torch.Tensor, shard: InputShard, scheme: QuantScheme | None,
                 dim: int = -1) -> torch.Tensor:
    """This rank's part of the input dim (`dim`) of a full checkpoint tensor, for `param`'s kind.

    Dense weight: rows [start, start + size) of K. qweight: the words of
    those rows. scales / qzeros: the groups `group_range` keeps. g_idx:
    rows [start, start + size) (act-order). `loaded` is returned unchanged
    when the shard is all of K.
    """
    if shard.start == 0 and shard.size == shard.full:
        return loaded
    kind = getattr(param, "quant_kind", None)
    if kind in FP8_KINDS:
        return narrow_fp8_input(param, loaded, shard, dim)
    if kind is None or kind == "g_idx":
        return loaded.narrow(dim, shard.start, shard.size)
    assert scheme is not None, "a quantized parameter needs its layer's scheme"
    if kind == "qweight":
        p = scheme.pack
        return loaded.narrow(dim, shard.start // p, _ceil_div(shard.size, p))
    g0, g1 = group_range(scheme, shard)
    return loaded.narrow(dim, g0, g1 - g0)


def quant_tensors(module: torch.nn.Module, prefix: str, scheme: QuantScheme, in_features: int) -> QuantTensors:
    """The `QuantTensors` of `module`'s parameters named `{prefix}qweight`, ... (prefix "" or "w13_" / "w2_")."""
    g_idx = getattr(module, f"{prefix}g_idx", None)
    return QuantTensors(getattr(module, f"{prefix}qweight"), getattr(module, f"{prefix}scales"),
                        getattr(module, f"{prefix}qzeros", None), g_idx, scheme.bits, scheme.group_size,
                        in_features)


def load_replicated_g_idx(param: torch.nn.Parameter, dst: torch.Tensor, loaded: torch.Tensor, key: int = 0) -> None:
    """Copy a whole g_idx into `dst` (`param` or one expert's row of it): column-parallel layers do not split K.

    The parts of a fused layer (q/k/v, gate/up) read the same input, so
    GPTQ's act-order gives them one permutation; the first part loaded for
    `key` (an expert id, or 0) is copied, later ones must equal it.

    Raises:
        ValueError: the shape differs, or a later part's g_idx differs from the first's.
    """
    if tuple(loaded.shape) != tuple(dst.shape):
        raise ValueError(f"g_idx of shape {tuple(loaded.shape)} does not fit parameter of shape "
                         f"{tuple(dst.shape)}.")
    done: set[int] = param.__dict__.setdefault("g_idx_loaded", set())
    if key in done:
        if not torch.equal(dst, loaded.to(dst.device, dst.dtype)):
            raise ValueError("the parts of a fused layer (q/k/v or gate/up) have different act-order g_idx; "
                             "tokenmill needs one g_idx per fused layer.")
        return
    dst.copy_(loaded)
    done.add(key)
