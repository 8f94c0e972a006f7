"""Which quantization a checkpoint uses: detection, parsing, `--quantization` resolution.

Four checkpoint formats are read (vLLM's spellings for the method names):

- `awq`: AutoAWQ / llm-awq GEMM checkpoints (`quant_method: awq`, 4 bits,
  `version: gemm`);
- `gptq`: AutoGPTQ / GPTQModel checkpoints (`quant_method: gptq`, 4 or 8
  bits, `desc_act` act-order, `checkpoint_format` gptq or gptq_v2);
- `compressed-tensors`: llm-compressor's `pack-quantized` int4/int8 weights
  (W4A16 / W8A16; channel or group strategy, `actorder`, `ignore`), and its
  `float-quantized` FP8 weights (W8A8 with dynamic per-token or static
  activations, W8A16; tensor / channel / block strategies): `ct_float.py`;
- `fp8`: FP8 (e4m3) checkpoints in the `quant_method: fp8` layout
  (per-tensor / per-channel `weight_scale`, or 128x128 `weight_scale_inv`
  blocks; dynamic or static activations): `fp8.py`. `--quantization fp8` on
  a 16-bit checkpoint quantizes it at load (per-channel weight scales,
  dynamic per-token activations).

Every key a config may hold is either interpreted, checked against the one
value we support, or listed as metadata that does not change the stored
tensors; anything else is refused with a ValueError naming the key, so a
checkpoint we do not understand never loads into wrong weights.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
# vLLM's Marlin-kernel spellings: the same checkpoints, read by our kernels.
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
# Methods a model family reads itself from its hf_config (no int4/int8 layer walk): gpt-oss's MXFP4 experts
# (`models/gpt_oss.py`, `layers/fused_moe/mxfp4.py`). `--quantization` may name them to confirm the checkpoint.
MODEL_HANDLED = ("mxfp4",)
# Files next to config.json that hold the config of older AutoGPTQ / AutoAWQ exports.
CONFIG_FILES = ("quantize_config.json", "quant_config.json")


@dataclass(frozen=True)
class QuantizationConfig:
    """How a checkpoint's linear weights are quantized (plain data; one scheme for every quantized module)."""

    method: str  # "awq" | "gptq" | "compressed-tensors" | "fp8"
    bits: int  # 4 or 8
    group_size: int  # input rows per scale; -1 = one group over all of K (per output channel)
    has_zeros: bool  # zero points are stored (asymmetric); False = the midpoint 2^(bits-1)
    act_order: bool  # g_idx tensors present (GPTQ desc_act, compressed-tensors actorder "group")
    # awq: "gemm"; gptq: "gptq" (zeros stored minus one) | "gptq_v2"; ct: "pack-quantized" | "float-quantized";
    # fp8: "fp8" (a checkpoint) | "quantize-at-load" (`--quantization fp8` on a 16-bit checkpoint)
    checkpoint_format: str
    ignore: tuple[str, ...] = ()  # module names / "re:" patterns (re.match) left unquantized
    source: str = ""  # the file the config came from, for messages
    # FP8 (e4m3) weights only:
    weight_type: str = "int"  # "int" (int4/int8 packed) | "float" (FP8 e4m3)
    weight_strategy: str | None = None  # "tensor" | "channel" | "block"; None = read from the scale's shape
    weight_block_size: tuple[int, int] | None = None  # (Bn, Bk) of block scales
    activation_scheme: str | None = None  # "dynamic" | "static" (stored input_scale) | None (weight-only)

    @property
    def is_fp8(self) -> bool:
        """True for FP8 weights (`fp8` checkpoints, compressed-tensors float-quantized, `--quantization fp8`)."""
        return self.weight_type == "float"


# ---- detection ----------------------------------------------------------------------------------

def find_quantization_config(model_path: str, hf_config: Any) -> dict | None:
    """The raw quantization config of a checkpoint folder, or None for an unquantized model.

    Args:
        model_path: the model folder (config.json's folder).
        hf_config: the parsed config (a transformers PretrainedConfig or a
            dict); its `quantization_config` wins.

    Returns:
        A dict copy; the key `"_source"` names the file it came from
        (`config.json`, `quantize_config.json` or `quant_config.json`).

    Raises:
        ValueError: a config file exists but is not a JSON object.
    """
    raw = hf_config.get("quantization_config") if isinstance(hf_config, dict) else getattr(
        hf_config, "quantization_config", None)
    if raw is not None:
        if not isinstance(raw, dict):
            to_dict = getattr(raw, "to_dict", None)
            raw = to_dict() if callable(to_dict) else None
        if not isinstance(raw, dict):
            raise ValueError("config.json's quantization_config must be a JSON object.")
        return {**raw, "_source": "config.json"}
    for name in CONFIG_FILES:
        path = os.path.join(model_path, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} is not valid JSON ({e}).") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path} must hold a JSON object.")
            return {**data, "_source": name}
    return None


# ---- parsing ------------------------------------------------------------------------------------

def parse_quantization_config(raw: dict) -> QuantizationConfig:
    """Parse a checkpoint's quantization config (see the module docstring for the formats).

    Args:
        raw: the dict from `find_quantization_config` (or config.json's
            `quantization_config`); an optional `"_source"` key names its file.

    Returns:
        The frozen QuantizationConfig.

    Raises:
        ValueError: an unknown `quant_method`, a key we do not know, or a
            value we do not support; the message names the key.
    """
    raw = dict(raw)
    source = str(raw.pop("_source", "quantization_config"))
    method = raw.get("quant_method")
    if method is None:
        method = _infer_method(raw, source)
    if not isinstance(method, str):
        raise ValueError(f"{source}: quant_method must be a string, not {method!r}.")
    method = method.lower()
    if method in ALIASES:
        method = ALIASES[method]
    if method == "awq":
        from tokenmill.quantization.awq import parse_awq_config
        return parse_awq_config(raw, source)
    if method == "gptq":
        from tokenmill.quantization.gptq import parse_gptq_config
        return parse_gptq_config(raw, source)
    if method == "compressed-tensors":
        from tokenmill.quantization.compressed_tensors import parse_compressed_tensors_config
        return parse_compressed_tensors_config(raw, source)
    if method == "fp8":
        from tokenmill.quantization.fp8 import parse_fp8_config
        return parse_fp8_config(raw, source)
    raise ValueError(f"{source}: quant_method {method!r} is not supported; tokenmill reads "
                     f"{', '.join(METHODS)} checkpoints.")


def _infer_method(raw: dict, source: str) -> str:
    """Old AutoAWQ / AutoGPTQ config files carry no quant_method: tell them apart by their keys."""
    if {"w_bit", "q_group_size"} & raw.keys() or ("zero_point" in raw and "version" in raw):
        method = "awq"
    elif {"desc_act", "sym", "damp_percent"} & raw.keys():
        method = "gptq"
    else:
        raise ValueError(f"{source}: the quantization config has no quant_method and its keys "
                         f"({', '.join(sorted(raw))}) match neither AWQ nor GPTQ.")
    logger.info("%s has no quant_method; its keys are %s's.", source, method.upper())
    return method


def check_fields(raw: dict, source: str, known: set[str], where: str = "") -> None:
    """Refuse any key of `raw` outside `known` (ValueError naming the key and the file)."""
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{source}: unknown quantization config field {where}{unknown[0]!r} "
                         f"(tokenmill knows {', '.join(sorted(known))}); it may change how the weights "
                         "are stored, so the checkpoint is refused.")


def require(ok: bool, source: str, field: str, value: Any, allowed: str) -> None:
    """ValueError `<source>: <field> = <value> is not supported (<allowed>).` unless ok."""
    if not ok:
        raise ValueError(f"{source}: {field} = {value!r} is not supported ({allowed}).")


def as_bool(raw: dict, key: str, default: bool, source: str) -> bool:
    """A boolean field (JSON true/false), `default` when absent; anything else is refused."""
    v = raw.get(key, default)
    if v is None:
        return default
    require(isinstance(v, bool), source, key, v, "true or false")
    return v


def as_group_size(v: Any, source: str, field: str) -> int:
    """A group size: a positive int or -1 (one group over all of K)."""
    require(isinstance(v, int) and not isinstance(v, bool) and (v > 0 or v == -1), source, field, v,
            "a positive number of input rows per group, or -1 for one group per output channel")
    return v


# ---- --quantization -----------------------------------------------------------------------------

def resolve_quantization(raw: dict | None, cli: str | None) -> QuantizationConfig | None:
    """The quantization to load with: the checkpoint's, confirmed (or named) by `--quantization`.

    Args:
        raw: the checkpoint's raw config (`find_quantization_config`) or None.
        cli: `--quantization` / `LLM(quantization=...)`: None, "None"/"none"
            (use the checkpoint's), "awq", "gptq", "compressed-tensors", "fp8", "mxfp4", or
            vLLM's aliases "awq_marlin" / "gptq_marlin" (logged).

    Returns:
        The parsed config, or None for an unquantized checkpoint without a flag
        and for a method the model reads itself (`MODEL_HANDLED`: gpt-oss's mxfp4).
        "fp8" on a checkpoint without a quantization config: quantize at load
        (`fp8.quantize_at_load_config`: per-channel weights, dynamic per-token activations).

    Raises:
        ValueError: an unknown method name; a method that disagrees with the
            checkpoint's; a method named for a checkpoint without a
            quantization config; or a bad checkpoint config.
    """
    method = None
    if cli is not None and cli.lower() != "none":
        method = cli.lower()
        if method in ALIASES:
            logger.info("--quantization %s is vLLM's Marlin spelling of %s; tokenmill reads the same "
                        "checkpoints with its own kernels.", cli, ALIASES[method])
            method = ALIASES[method]
        if method not in METHODS + MODEL_HANDLED:
            raise ValueError(f"--quantization {cli!r} is not supported; use one of "
                             f"{', '.join(METHODS + MODEL_HANDLED)} (or awq_marlin / gptq_marlin), or leave it "
                             "unset to use the checkpoint's.")
    if raw is None:
        if method == "fp8":
            from tokenmill.quantization.fp8 import quantize_at_load_config
            return quantize_at_load_config()
        if method is not None:
            raise ValueError(f"--quantization {cli} was given but the checkpoint has no quantization config "
                             f"(no quantization_config in config.json, no {' / '.join(CONFIG_FILES)}); "
                             "tokenmill quantizes 16-bit weights at load only with --quantization fp8. "
                             "Leave the flag unset.")
        return None
    raw_method = str(raw.get("quant_method", "")).lower()
    if raw_method in MODEL_HANDLED:  # the model reads it (gpt-oss MXFP4): nothing for the layer walk
        if method is not None and method != raw_method:
            raise ValueError(f"--quantization {cli} disagrees with the checkpoint, which is quantized with "
                             f"{raw_method}; leave the flag unset or pass {raw_method}.")
        return None
    cfg = parse_quantization_config(raw)
    if method is not None and method != cfg.method:
        raise ValueError(f"--quantization {cli} disagrees with the checkpoint, which is quantized with "
                         f"{cfg.method} ({cfg.source}); leave the flag unset or pass {cfg.method}.")
    return cfg


# ---- ignore lists -------------------------------------------------------------------------------

def is_ignored(cfg: QuantizationConfig, module_name: str) -> bool:
    """Whether the config leaves `module_name` (a checkpoint module path) unquantized.

    An entry matches the exact module name, or with a "re:" prefix the
    pattern `re.match`es it (compressed-tensors' rule; AWQ's substring
    `modules_to_not_convert` entries are stored as such patterns).

    For a real checkpoint the tensors are the authority
    (`convert.quantized_modules`: a module is quantized when its packed
    weight is stored); this answers for weights that are not read from a
    checkpoint (dummy weights) and for messages. AWQ's substring rule is
    broad: an entry "mlp.gate" also matches "mlp.gate_proj".
    """
    for entry in cfg.ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module_name):
                return True
        elif entry == module_name:
            return True
    return False


def substring_pattern(name: str) -> str:
    """The "re:" ignore entry matching every module path that contains `name` (AWQ's rule)."""
    return "re:.*" + re.escape(name)


def bad_tensor(name: str, field: str, why: str) -> ValueError:
    """The load error for a checkpoint tensor that disagrees with the config: names the tensor and the field."""
    return ValueError(f"Quantized checkpoint tensor {name} disagrees with the quantization config's {field}: "
                      f"{why}. The checkpoint is refused.")


# Keys GPTQModel writes into every config it exports (GPTQ and AWQ alike), beyond the method's own.
TOOL_METADATA = {
    "meta",  # {quantizer, uri, damp_percent, static_groups, true_sequential, mse, ...}: how it was calibrated
    "model_name_or_path", "model_file_base_name",  # where it was made / the weights file's stem
    "is_marlin_format",  # checked: must be false (true = Marlin-repacked tensors)
    "method", "format", "checkpoint_format", "pack_dtype", "lm_head", "dynamic", "activation", "rotation",
    "desc_act", "sym",  # checked per method
    "quantizer", "uri",  # old GPTQModel wrote these at the top level
}


def check_tool_fields(raw: dict, source: str, method: str, fmt: str) -> None:
    """Check GPTQModel's shared keys: they must describe plain `method`/`fmt` int32-packed weights.

    `lm_head: true` (a quantized LM head), a non-empty `dynamic` (per-module
    bits / skips), `activation` (activation quantization), `rotation`
    (Hadamard-rotated weights), `pack_dtype` other than int32 and
    `is_marlin_format: true` change the stored tensors and are refused.
    """
    if "method" in raw:
        require(str(raw["method"]).lower() == method, source, "method", raw["method"],
                f"must agree with quant_method {method}")
    for key in ("format", "checkpoint_format"):
        if key in raw and method == "awq":
            require(str(raw[key]).lower() == fmt, source, key, raw[key], f"AWQ checkpoints must be {fmt}")
    require(raw.get("lm_head") in (None, False), source, "lm_head", raw.get("lm_head"),
            "a quantized LM head is not supported; the LM head must be stored unquantized")
    require(not raw.get("dynamic"), source, "dynamic", raw.get("dynamic"),
            "per-module overrides are not supported; every quantized module must use the same bits and group size")
    require(raw.get("activation") is None, source, "activation", raw.get("activation"),
            "only weight-only quantization is supported (activations stay in 16 bits)")
    require(raw.get("rotation") is None, source, "rotation", raw.get("rotation"),
            "rotated (e.g. Hadamard) weights are not supported")
    require(raw.get("pack_dtype") in (None, "int32", "torch.int32"), source, "pack_dtype", raw.get("pack_dtype"),
            "weights must be packed into int32 words")
    require(raw.get("is_marlin_format") in (None, False), source, "is_marlin_format", raw.get("is_marlin_format"),
            "Marlin-repacked checkpoints are not supported; use the plain GPTQ export")
