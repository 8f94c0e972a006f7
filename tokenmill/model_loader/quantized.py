"""int4/int8 checkpoints in the loader: which layers are quantized, random quantized weights, CPU dequantization.

Before loading, `quantize_layers` walks the built model and turns the
layers the checkpoint quantizes into quantized layers (`LinearBase.quantize`,
`FusedMoE.quantize`), deciding from the checkpoint's tensor names alone
(`quantization.quantized_modules`) mapped onto the model's modules:

    checkpoint module                              model module (part)
    model.layers.0.self_attn.k_proj                model.layers.0.self_attn.qkv_proj ("k")
    model.layers.0.mlp.gate_proj                   model.layers.0.mlp.gate_up_proj (0)
    model.layers.0.mlp.experts.3.down_proj         model.layers.0.mlp.experts (expert 3, "w2")

A fused module must be all quantized or all not: q/k/v share one weight
tensor, the experts one stacked weight. Everything is checked before the
first tensor is copied, so a bad checkpoint fails without half a model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.kernels.quant_pack import pack_along_last
from tokenmill.layers.fp8_params import Fp8Scheme
from tokenmill.layers.fused_moe import FusedMoE, expert_module
from tokenmill.layers.linear import LinearBase, ReplicatedLinear
from tokenmill.layers.quant_params import QuantScheme
from tokenmill.models.utils import PPMissingLayer, checkpoint_renamer, route_checkpoint_name

if TYPE_CHECKING:
    from tokenmill.quantization import QuantizationConfig

logger = logging.getLogger(__name__)

_MOE_SHARDS = ("w1", "w3", "w2")


def _expected_parts(name: str, module: nn.Module, mapping: dict[str, tuple[str, str | int]]) -> set:
    """The parts a checkpoint spreads `module` over: q/k/v, gate/up, (expert, shard), or {None}."""
    if isinstance(module, FusedMoE):
        return {(e, s) for e in range(module.num_experts) for s in _MOE_SHARDS}
    parts = {sid for frag, (fused, sid) in mapping.items() if (name + ".").endswith(fused + ".")}
    return parts or {None}


def _route_module(name: str, mapping: dict[str, tuple[str, str | int]]) -> tuple[str, object]:
    """(model module, part) of a checkpoint module name."""
    expert = expert_module(name)
    if expert is not None:
        prefix, expert_id, shard_id = expert
        return prefix, (expert_id, shard_id)
    return route_checkpoint_name(name, mapping)


def quantize_layers(model: nn.Module, cfg: QuantizationConfig, checkpoint_modules: Iterable[str] | None) -> int:
    """Make the layers `checkpoint_modules` names quantized layers (with `cfg`'s scheme); returns how many.

    Args:
        model: the built model (parameters on their device, not loaded yet).
        cfg: the checkpoint's `tokenmill.quantization.QuantizationConfig`.
        checkpoint_modules: checkpoint module names that hold quantized
            tensors (`quantization.quantized_modules`), or None for dummy
            weights and `--quantization fp8` at load: then every linear layer but the MoE
            routers (`ReplicatedLinear`) and every FusedMoE, except those `cfg` ignores.

    Raises:
        ValueError: a fused layer is only partly quantized, or the checkpoint
            quantizes a module tokenmill cannot run quantized (names it).
    """
    scheme = Fp8Scheme.from_config(cfg) if cfg.is_fp8 else QuantScheme.from_config(cfg)
    mapping = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    if checkpoint_modules is None:
        targets = [name for name, m in modules.items() if _dummy_target(cfg, name, m, mapping)]
    else:
        targets = _checkpoint_targets(model, modules, checkpoint_modules, mapping)
    for name in targets:
        modules[name].quantize(scheme)
    return len(targets)


def _checkpoint_targets(model: nn.Module, modules: dict[str, nn.Module], checkpoint_modules: Iterable[str],
                        mapping: dict[str, tuple[str, str | int]]) -> list[str]:
    rename = checkpoint_renamer(getattr(model, "checkpoint_renames", None))
    skipped = tuple(name + "." for name, m in modules.items() if isinstance(m, PPMissingLayer))
    found: dict[str, dict[object, str]] = {}  # model module -> part -> checkpoint module
    for ck in sorted(checkpoint_modules):
        target, part = _route_module(rename(ck), mapping)
        if skipped and (target + ".").startswith(skipped):
            continue  # another pipeline stage's layer
        module = modules.get(target)
        if not isinstance(module, (LinearBase, FusedMoE)):
            raise ValueError(f"The checkpoint quantizes {ck}, but tokenmill runs only linear layers and MoE experts "
                             f"quantized (it is {type(module).__name__ if module is not None else 'no module'} "
                             "here); use a checkpoint that leaves it unquantized.")
        found.setdefault(target, {})[part] = ck
    for target, parts in found.items():
        expected = _expected_parts(target, modules[target], mapping)
        if set(parts) != expected:
            missing = sorted(_part_label(target, part, mapping) for part in expected - set(parts))
            names = sorted(parts.values())
            have = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ValueError(f"The checkpoint quantizes only part of the fused layer {target} ({have} quantized; "
                             f"parts {', '.join(missing[:4])} not); a fused layer must be all quantized or all not.")
    return list(found)


def _part_label(target: str, part: object, mapping: dict[str, tuple[str, str | int]]) -> str:
    """A missing part as the checkpoint names it: `v_proj`, `expert 2 w2`."""
    if isinstance(part, tuple):
        return f"expert {part[0]} {part[1]}"
    frags = [frag for frag, (fused, sid) in mapping.items() if sid == part and (target + ".").endswith(fused + ".")]
    return frags[0].lstrip(".") if frags else str(part)


def _dummy_target(cfg: QuantizationConfig, name: str, module: nn.Module, mapping: dict[str, tuple[str, str | int]]) -> bool:
    from tokenmill.quantization import is_ignored

    if isinstance(module, FusedMoE):
        return not is_ignored(cfg, name)
    if not isinstance(module, LinearBase) or isinstance(module, ReplicatedLinear):
        return False  # ReplicatedLinear: MoE routers, which checkpoints keep in 16 bits
    parts = [name.replace(fused, frag) for frag, (fused, _) in mapping.items() if (name + ".").endswith(fused + ".")]
    return not any(is_ignored(cfg, n) for n in (name, *parts))


def dequantize_layers(model: nn.Module) -> int:
    """Turn every loaded quantized layer back into a dense one, in the layer's dtype (the CPU path).

    One layer at a time, so the peak is the quantized model plus one dense
    layer. Returns the number of layers dequantized.
    """
    count = 0
    for module in model.modules():
        if getattr(module, "quant", None) is not None:
            module.dequantize()
            count += 1
    return count


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of all parameters, bytes of the quantized tensors among them); tied weights counted once.

    GGUF weights kept as ggml blocks on the CPU (`layers/gguf_weights.GGUFWeight`, not parameters) count
    as quantized bytes.
    """
    total = quantized = 0
    for module in model.modules():
        for attr in ("weight", "gguf_weight"):
            blocks = module.__dict__.get(attr)
            if blocks is not None and not isinstance(blocks, torch.Tensor) and hasattr(blocks, "nbytes"):
                total += blocks.nbytes
                quantized += blocks.nbytes
    for param in model.parameters():
        size = param.numel() * param.element_size()
        total += size
        if getattr(param, "quant_kind", None) is not None:
            quantized += size
    for name, buf in model.named_buffers():
        if name.endswith("g_idx"):  # synthesized for row shards inside a group
            total += buf.numel() * buf.element_size()
            quantized += buf.numel() * buf.element_size()
    return total, quantized


def format_bytes(n: int) -> str:
    """`1.234 GiB` / `12.3 MiB` (log lines)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_quantization(cfg: QuantizationConfig) -> str:
    """`awq int4 g128` / `fp8 e4m3 block 128x128 W8A8 dynamic` style summary of a config for log lines."""
    if cfg.is_fp8:
        block = cfg.weight_block_size
        scales = f"block {block[0]}x{block[1]}" if block else (cfg.weight_strategy or "per-tensor/channel")
        acts = f"W8A8 {cfg.activation_scheme}" if cfg.activation_scheme else "W8A16"
        at_load = ", quantized at load" if cfg.checkpoint_format == "quantize-at-load" else ""
        return f"{cfg.method} e4m3 {scales} {acts}{at_load}"
    group = "channel" if cfg.group_size == -1 else f"g{cfg.group_size}"
    return f"{cfg.method} int{cfg.bits} {group}{' act-order' if cfg.act_order else ''}"


def random_quantized(param: torch.Tensor, full_shape: tuple[int, ...], generator: torch.Generator,
                     std: float) -> torch.Tensor:
    """A valid random full checkpoint tensor of `param`'s `quant_kind` (dummy weights).

    qweight: uniform codes (bits past K zero); scales: around the value
    that gives dequantized weights of standard deviation ~`std`; qzeros: the
    midpoint +-1; g_idx: the groups `k // G` in a random order (act-order).
    """
    kind, device = param.quant_kind, param.device
    bits, k = param.quant_bits, param.full_in_features
    if kind == "qweight":
        if k % (32 // bits) == 0:  # every int32 word is valid: uniform words are uniform codes
            return torch.randint(-(1 << 31), 1 << 31, full_shape, device=device, generator=generator,
                                 dtype=torch.int32)
        codes = torch.randint(0, 1 << bits, (*full_shape[:-1], k), device=device, generator=generator,
                              dtype=torch.int64)
        return pack_along_last(codes, bits)  # zero bits past K in each row's last word
    if kind == "scales":
        base = std * 12**0.5 / (1 << bits)  # uniform codes: std of (q - z) is 2^b / sqrt(12)
        return base * (0.5 + torch.rand(full_shape, device=device, generator=generator))
    if kind == "qzeros":
        mid = 1 << (bits - 1)
        return torch.randint(mid - 1, mid + 2, full_shape, device=device, generator=generator).to(torch.uint8)
    group = param.quant_group_size if param.quant_group_size != -1 else k
    groups = torch.arange(k, device=device) // group
    perm = torch.randperm(k, device=device, generator=generator)
    return groups[perm].to(torch.int32).expand(*full_shape[:-1], k).contiguous()
