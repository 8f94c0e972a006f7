"""Checkpoint tensors -> tokenmill's quantized layout (tokenmill/kernels/quant_pack.py), streamed.

A quantized module `<prefix>` arrives as several checkpoint tensors
(`<prefix>.qweight`, `.scales`, ...; compressed-tensors' `.weight_packed`,
`.weight_scale`, ...), possibly in different shards. `convert_weights` holds
a module's tensors until the ones its config requires are all there, checks
them against each other and the config, and yields tokenmill's tensors under
the module's path:

    <prefix>.qweight  int32 [N, ceil(K / p)]
    <prefix>.scales   [N, ngroups] (the checkpoint's dtype)
    <prefix>.qzeros   uint8 [N, ngroups]   only when the config has zero points
    <prefix>.g_idx    int32 [K]            only with act-order

Tensors the config makes redundant (a symmetric checkpoint's midpoint zeros,
a trivial g_idx, compressed-tensors' weight_shape) are checked and dropped.
Every other tensor (embeddings, norms, biases, unquantized modules) passes
through unchanged. Per-expert MoE weights are ordinary modules
(`...mlp.experts.3.gate_proj`).

FP8 checkpoints (`fp8.py`) yield `<prefix>.weight` float8_e4m3fn [N, K], `<prefix>.weight_scale`
float32 [N] or [N, ceil(K / Bk)] (one scale per output row) and `<prefix>.input_scale` [1] (static).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType

import torch

from tokenmill.quantization import awq, compressed_tensors, fp8, gptq
from tokenmill.quantization.config import QuantizationConfig, bad_tensor

_FORMATS: dict[str, ModuleType] = {"awq": awq, "gptq": gptq, "compressed-tensors": compressed_tensors}
_PACKED = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}


def _format(cfg: QuantizationConfig) -> ModuleType:
    if cfg.is_fp8:
        if cfg.checkpoint_format == "quantize-at-load":
            raise ValueError("--quantization fp8 on a 16-bit checkpoint has no checkpoint tensors to convert.")
        return fp8
    if cfg.method not in _FORMATS:
        raise ValueError(f"Quantization method {cfg.method!r} has no converter; "
                         f"tokenmill reads {', '.join(_FORMATS)}.")
    return _FORMATS[cfg.method]


def convert_weights(cfg: QuantizationConfig, weights: Iterable[tuple[str, torch.Tensor]],
                    modules: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert a checkpoint's (name, tensor) stream to tokenmill's names and layout (module docstring).

    Args:
        cfg: the checkpoint's parsed quantization config.
        weights: (name, tensor) pairs in any order (e.g. safetensors shards).
        modules: the quantized modules (`quantized_modules`); needed for FP8, whose weights and 16-bit
            weights share the name `.weight` (FP8 modules are those with a weight_scale / weight_scale_inv).

    Yields:
        (name, tensor) pairs; a module's converted tensors come as soon as
        its last required tensor has arrived.

    Raises:
        ValueError: naming the tensor and the config field, when a tensor's
            dtype or shape disagrees with the config (bits, group size,
            zero points, act-order) or with the module's other tensors, when
            a tensor appears twice, or when, at the end, a module misses a
            required tensor (e.g. a qweight without its scales).
    """
    fmt = _format(cfg)
    if cfg.is_fp8 and modules is None:
        raise ValueError("FP8 conversion needs the set of quantized modules (quantized_modules).")
    required = fmt.required_suffixes(cfg)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()  # converted modules: a tensor of theirs arriving again is a duplicate
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if suffix not in fmt.SUFFIXES or (cfg.is_fp8 and prefix not in modules):
            if tensor.dtype == torch.float8_e4m3fn:
                scale = "weight_scale_inv" if cfg.weight_block_size and cfg.method == "fp8" else "weight_scale"
                raise bad_tensor(name, scale, f"it is FP8 but the checkpoint has no {prefix}.{scale}")
            yield name, tensor
            continue
        if suffix not in required:
            fmt.convert_optional(cfg, name, suffix, tensor)  # checked, then dropped
            continue
        parts = pending.setdefault(prefix, {})
        if suffix in parts or prefix in done:
            raise ValueError(f"Quantized checkpoint tensor {name} appears twice; the checkpoint is refused.")
        parts[suffix] = tensor
        if len(parts) == len(required):
            del pending[prefix]
            done.add(prefix)
            for our_suffix, out in fmt.convert_module(cfg, prefix, parts).items():
                yield f"{prefix}.{our_suffix}", out
    for prefix, parts in pending.items():
        missing = sorted(required - parts.keys())
        have = ", ".join(f"{prefix}.{s}" for s in sorted(parts))
        field = {"qzeros": "zero points (sym / zero_point)", "weight_zero_point": "symmetric",
                 "g_idx": "desc_act", "weight_g_idx": "actorder", "input_scale": "activation_scheme static",
                 "weight": "weight_scale (an FP8 weight next to it)"}.get(missing[0], "tensors")
        raise ValueError(f"Quantized checkpoint tensor {prefix}.{missing[0]} is missing (the checkpoint has "
                         f"{have}); the quantization config's {field} requires "
                         f"{', '.join(f'{prefix}.{s}' for s in missing)}. The checkpoint is refused.")


def quantized_modules(cfg: QuantizationConfig, names: Iterable[str]) -> set[str]:
    """Checkpoint module paths that hold quantized weights, from the tensor names alone.

    `model.layers.0.self_attn.q_proj.qweight` -> `model.layers.0.self_attn.q_proj`
    (compressed-tensors: `...q_proj.weight_packed`). Per-expert MoE modules
    come out one per expert (`model.layers.0.mlp.experts.3.gate_proj`).
    """
    _format(cfg)
    if cfg.is_fp8:  # `weight` names FP8 and 16-bit weights alike: an FP8 module is one with a weight scale
        return {prefix for prefix, _, suffix in (n.rpartition(".") for n in names) if suffix in fp8.module_suffixes()}
    suffix = "." + _PACKED[cfg.method]
    return {n[: -len(suffix)] for n in names if n.endswith(suffix)}
