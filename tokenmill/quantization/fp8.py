"""FP8 (e4m3) checkpoints: the `quant_method: fp8` config, `--quantization fp8` at load, and the tensor conversion
shared with compressed-tensors' float-quantized format.

The layout, for a linear W [N, K] (out, in) (vLLM's and transformers' FP8 checkpoints; llm-compressor's
`float-quantized` writes the same names):

    weight            float8_e4m3fn [N, K]
    weight_scale      float [] / [1] (per-tensor) or [N] / [N, 1] (per-channel)   W = weight * weight_scale
    weight_scale_inv  float [ceil(N / Bn), ceil(K / Bk)] with `weight_block_size: [Bn, Bk]`
                      (DeepSeek-V3 / Qwen3-FP8; despite the name it multiplies:
                      W[n, k] = weight[n, k] * weight_scale_inv[n // Bn, k // Bk])
    input_scale       float [] / [1], `activation_scheme: static` only: x is quantized with it

(source: `kernels/fp8.py`'s module docstring for the number format and the schemes.)

tokenmill's layer layout (`layers/fp8_params.py`) keeps one scale per output row: per-tensor scales are
broadcast to [N] and block scales are repeated over their Bn rows to [N, ceil(K / Bk)] (3% of the FP8
weight's bytes at Bk = 128). The products are unchanged, and every fused (q/k/v, gate/up) or
tensor-parallel split of the output rows is then a plain row slice, whatever its offset.
"""

from __future__ import annotations

import logging
import re

import torch

from tokenmill.kernels.fp8 import FP8_DTYPE
from tokenmill.quantization.config import QuantizationConfig, bad_tensor, check_fields, require, substring_pattern

logger = logging.getLogger(__name__)

SUFFIXES = {"weight": "weight", "weight_scale": "weight_scale", "weight_scale_inv": "weight_scale",
            "input_scale": "input_scale"}
ACTIVATION_SCHEMES = ("dynamic", "static")

_FIELDS = {
    "quant_method", "activation_scheme", "weight_block_size", "ignored_layers", "modules_to_not_convert",
    "fmt",  # checked: "e4m3"
    "dequantize",  # transformers' FineGrainedFP8Config: its own load-time option, not part of the stored tensors
}
_EXPERT_RE = re.compile(r"\.experts\.\d+\.")


def parse_fp8_config(raw: dict, source: str) -> QuantizationConfig:
    """Parse an FP8 config (`quant_method: fp8`, as vLLM, transformers and DeepSeek / Qwen-FP8 write it).

    Keys: `activation_scheme` "dynamic" (default; per token, per 1 x Bk group with blocks) or "static"
    (per-tensor `input_scale` tensors), `weight_block_size` [Bn, Bk] or null (then per-tensor or per-channel
    `weight_scale`, told apart by shape), `fmt` "e4m3", `ignored_layers` (module names, exact or "re:"),
    `modules_to_not_convert` (substrings, as transformers).

    Raises:
        ValueError: naming the key that is unknown or unsupported.
    """
    check_fields(raw, source, _FIELDS)
    act = raw.get("activation_scheme", "dynamic")
    require(act in ACTIVATION_SCHEMES, source, "activation_scheme", act, "dynamic or static")
    require(raw.get("fmt", "e4m3") in ("e4m3", "float8_e4m3fn"), source, "fmt", raw.get("fmt"),
            "only e4m3 weights are read")
    require(raw.get("dequantize") in (None, False), source, "dequantize", raw.get("dequantize"),
            "false or absent (tokenmill decides per device whether FP8 weights are dequantized)")
    block = raw.get("weight_block_size")
    if block is not None:
        require(isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block), source, "weight_block_size",
            block, "[Bn, Bk], two positive ints")
        require(block[1] % 16 == 0, source, "weight_block_size", block,
                "Bk must be a multiple of 16 (the FP8 GEMM's K tile)")
        require(act == "dynamic", source, "activation_scheme", act,
                "block-scaled weights take dynamic per-group activations")
        block = (block[0], block[1])
    ignored = raw.get("ignored_layers") or []
    require(isinstance(ignored, list) and all(isinstance(s, str) for s in ignored), source, "ignored_layers",
            ignored, "a list of module names")
    skip = raw.get("modules_to_not_convert") or []
    require(isinstance(skip, list) and all(isinstance(s, str) for s in skip), source, "modules_to_not_convert",
            skip, "a list of module name fragments")
    ignore = tuple(ignored) + tuple(substring_pattern(s) for s in skip)
    return QuantizationConfig(method="fp8", bits=8, group_size=-1, has_zeros=False, act_order=False,
                              checkpoint_format="fp8", ignore=ignore, source=source, weight_type="float",
                              weight_strategy="block" if block else None, weight_block_size=block,
                              activation_scheme=act)


def quantize_at_load_config() -> QuantizationConfig:
    """`--quantization fp8` on a 16-bit checkpoint: per-channel weight scales computed at load, dynamic per-token
    activations (vLLM's on-the-fly FP8)."""
    return QuantizationConfig(method="fp8", bits=8, group_size=-1, has_zeros=False, act_order=False,
                              checkpoint_format="quantize-at-load", source="--quantization fp8", weight_type="float",
                              weight_strategy="channel", activation_scheme="dynamic")


# ---- conversion -----------------------------------------------------------------------------------

def _scale_name(cfg: QuantizationConfig) -> str:
    return "weight_scale_inv" if cfg.checkpoint_format == "fp8" and cfg.weight_block_size else "weight_scale"


def required_suffixes(cfg: QuantizationConfig) -> set[str]:
    """Checkpoint tensors each FP8 module must have: weight, its scale, and input_scale when static."""
    need = {"weight", _scale_name(cfg)}
    if cfg.activation_scheme == "static":
        need.add("input_scale")
    return need


def module_suffixes() -> tuple[str, ...]:
    """Suffixes that mark a checkpoint module as FP8 (`quantized_modules`)."""
    return ("weight_scale", "weight_scale_inv")


def _check_scalar(name: str, field: str, t: torch.Tensor) -> torch.Tensor:
    if t.numel() != 1 or t.dim() > 1:
        raise bad_tensor(name, field, f"expected one scale ([] or [1]), got {list(t.shape)}")
    t = t.float().reshape(1)
    if not bool(torch.isfinite(t).all() and (t > 0).all()):
        raise bad_tensor(name, field, f"the scale must be positive and finite, not {t.item()}")
    return t


def convert_optional(cfg: QuantizationConfig, name: str, suffix: str, t: torch.Tensor) -> None:
    """Tensors that carry nothing for this config: a dynamic checkpoint's input_scale is checked and dropped;
    a scale of the other kind (weight_scale_inv without weight_block_size, or the reverse) is refused."""
    if suffix == "input_scale":
        _check_scalar(name, "activation_scheme", t)
        return None
    field = "weight_block_size"
    why = (f"the config has weight_block_size {list(cfg.weight_block_size)}, whose scales are weight_scale_inv"
           if cfg.weight_block_size else "weight_scale_inv (block scales) needs weight_block_size in the config")
    raise bad_tensor(name, field, why)


def convert_module(cfg: QuantizationConfig, prefix: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One FP8 linear's tensors -> tokenmill's {weight fp8 [N, K], weight_scale float32 [N] or [N, ceil(K / Bk)],
    input_scale float32 [1] (static)}.

    Raises:
        ValueError: naming the tensor and the field when a dtype or shape disagrees with the config
            (weight not float8_e4m3fn [N, K]; a scale that fits neither per-tensor nor per-channel, or not the
            block grid of weight_block_size; a non-positive or non-finite scale).
    """
    weight = parts["weight"]
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise bad_tensor(f"{prefix}.weight", "quant_method", f"expected float8_e4m3fn [N, K], got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    sname = _scale_name(cfg)
    scale = parts[sname]
    where = f"{prefix}.{sname}"
    strategy = cfg.weight_strategy
    if cfg.weight_block_size is not None:
        bn, bk = cfg.weight_block_size
        grid = [-(-n // bn), -(-k // bk)]
        if list(scale.shape) != grid:
            raise bad_tensor(where, "weight_block_size", f"expected {grid} block scales for a [{n}, {k}] weight with "
                             f"blocks [{bn}, {bk}], got {list(scale.shape)}")
        out_scale = scale.float().repeat_interleave(bn, dim=0)[:n].contiguous()
    elif scale.numel() == 1 and scale.dim() <= 2 and strategy in (None, "tensor"):
        out_scale = scale.float().reshape(1).expand(n).contiguous()
    elif list(scale.shape) in ([n], [n, 1]) and strategy in (None, "channel"):
        out_scale = scale.float().reshape(n).contiguous()
    else:
        want = {"tensor": "[] or [1]", "channel": f"[{n}] or [{n}, 1]"}.get(
            strategy, f"[] / [1] (per-tensor) or [{n}] / [{n}, 1] (per-channel)")
        raise bad_tensor(where, "strategy" if strategy else "weight_scale", f"expected {want} for a [{n}, {k}] "
                         f"weight, got {list(scale.shape)}")
    if not bool(torch.isfinite(out_scale).all() and (out_scale > 0).all()):
        raise bad_tensor(where, "weight_scale", "every scale must be positive and finite")
    out = {"weight": weight, "weight_scale": out_scale}
    if "input_scale" in parts:
        input_scale = _check_scalar(f"{prefix}.input_scale", "activation_scheme", parts["input_scale"])
        if not _EXPERT_RE.search(prefix + "."):  # experts quantize dynamically (layers/fused_moe): checked, not kept
            out["input_scale"] = input_scale
    return out
