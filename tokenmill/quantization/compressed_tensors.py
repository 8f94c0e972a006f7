"""compressed-tensors `pack-quantized` int4/int8 weights (llm-compressor W4A16 / W8A16): parsing and conversion.

The layout, for a linear W [N, K] (out, in), b bits, p = 32 // b:

    weight_packed      int32 [N, ceil(K / p)]       packed along K, low bits first; each value is the
                                                    signed quantized value plus 2^(b-1) (unsigned)
    weight_scale       float [N, ngroups]           ngroups = 1 for the channel strategy
    weight_zero_point  int32 [ceil(N / p), ngroups] asymmetric only: signed zero points plus 2^(b-1),
                                                    packed along dim 0 (N)
    weight_g_idx       int32 [K]                    actorder "group" only
    weight_shape       int   [2]                    [N, K]

    W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]   (the 2^(b-1) offsets cancel)

(source: compressed-tensors' `PackedQuantizationCompressor` and
`pack_to_int32` / `unpack_from_int32`, which the tests run as the
reference). `weight_packed` is already tokenmill's qweight; the zero points
are unpacked along N into unsigned uint8 zeros.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.kernels.quant_pack import unpack_along_last
from tokenmill.quantization.config import (
    QuantizationConfig,
    as_group_size,
    bad_tensor,
    check_fields,
    require,
)

SUFFIXES = {"weight_packed": "qweight", "weight_scale": "scales", "weight_zero_point": "qzeros",
            "weight_g_idx": "g_idx", "weight_shape": None}
FORMAT = "pack-quantized"
# FP8 weights (`ct_float.py`): llm-compressor writes W8A8 FP8 as float-quantized; its weight-only FP8 (W8A16)
# falls through to naive-quantized (compressed_tensors.compressors.format's priority list).
FLOAT_FORMATS = ("float-quantized", "naive-quantized")

_TOP_FIELDS = {
    "quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
    "sparsity_config", "transform_config", "moe_sparsity_config",
    "global_compression_ratio", "version", "provider",  # informational
}
_GROUP_FIELDS = {"targets", "weights", "input_activations", "output_activations", "format"}
_WEIGHT_FIELDS = {
    "num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic", "actorder",
    "scale_dtype", "zp_dtype",  # the stored tensors carry their dtypes
    "observer", "observer_kwargs",  # how scales were calibrated
}


logger = logging.getLogger(__name__)

_KV_FIELDS = {"num_bits", "type", "strategy", "dynamic", "symmetric", "group_size", "block_structure",
              "actorder", "observer", "observer_kwargs"}


def _check_kv_cache_scheme(kv: object, source: str) -> None:
    """Accept llm-compressor's FP8 KV-cache scheme (8-bit float, one static scale per tensor: the checkpoint's
    `k_scale` / `v_scale`, which `--kv-cache-dtype fp8` uses), or none.

    Raises:
        ValueError: any other scheme, naming the field.
    """
    if not kv:
        return
    where = "kv_cache_scheme"
    require(isinstance(kv, dict), source, where, kv, "an FP8 per-tensor scheme object or null")
    check_fields(kv, source, _KV_FIELDS, where + ".")
    require(kv.get("type") == "float" and kv.get("num_bits") == 8, source, where + ".type/num_bits",
            (kv.get("type"), kv.get("num_bits")), "8-bit float (FP8) KV-cache scales")
    require(kv.get("strategy") in (None, "tensor"), source, where + ".strategy", kv.get("strategy"),
            "one scale per tensor (k_scale / v_scale per layer)")
    require(not kv.get("dynamic"), source, where + ".dynamic", kv.get("dynamic"), "static scales stored in the "
            "checkpoint")
    require(kv.get("symmetric", True) is True, source, where + ".symmetric", kv.get("symmetric"), "symmetric")
    logger.info("%s: the checkpoint carries FP8 KV-cache scales (kv_cache_scheme); --kv-cache-dtype fp8 stores the "
                "KV cache in FP8 with them (a 16-bit cache ignores them)", source)


def parse_compressed_tensors_config(raw: dict, source: str) -> QuantizationConfig:
    """Parse llm-compressor's `quantization_config` (`quant_method: compressed-tensors`).

    Supported: `format: pack-quantized` (below) and FP8 `float-quantized` / `naive-quantized`
    (`ct_float.parse_float_groups`), `quantization_status: compressed`,
    config groups whose `weights` are int 4/8-bit, `strategy` channel or group,
    symmetric or not, `actorder` null / weight / group, static; no activation,
    output or KV-cache quantization, no sparsity, no transforms. All groups
    must share one weight scheme. `ignore` entries are module names or "re:"
    patterns.

    Raises:
        ValueError: naming the key that is unknown or unsupported.
    """
    check_fields(raw, source, _TOP_FIELDS)
    fmt = raw.get("format")
    require(fmt in (FORMAT, *FLOAT_FORMATS), source, "format", fmt,
            "pack-quantized int4/int8 weights (W4A16, W8A16) or float-quantized FP8 weights (W8A8, W8A16)")
    # Older llm-compressor releases wrote "frozen" over packed weights; the tensors decide (a dense `weight`
    # with scales has no weight_packed and is refused at load).
    status = raw.get("quantization_status", "compressed")
    require(status in ("compressed", "frozen"), source, "quantization_status", status,
            "only compressed checkpoints (packed weights) are read")
    _check_kv_cache_scheme(raw.get("kv_cache_scheme"), source)
    for key in ("transform_config", "moe_sparsity_config"):
        require(not raw.get(key), source, key, raw.get(key), "must be null")
    require(not raw.get("sparsity_config"), source, "sparsity_config", raw.get("sparsity_config"),
            "sparse checkpoints are not supported")
    groups = raw.get("config_groups")
    require(isinstance(groups, dict) and len(groups) > 0, source, "config_groups", groups, "at least one group")
    ignore = raw.get("ignore") or []
    require(isinstance(ignore, list) and all(isinstance(s, str) for s in ignore), source, "ignore", ignore,
            "a list of module names and re: patterns")
    if fmt in FLOAT_FORMATS:
        from tokenmill.quantization.ct_float import parse_float_groups
        return parse_float_groups(groups, fmt, tuple(ignore), source)
    schemes = {}
    for gname, group in groups.items():
        where = f"config_groups.{gname}."
        require(isinstance(group, dict), source, where[:-1], group, "a scheme object")
        check_fields(group, source, _GROUP_FIELDS, where)
        require(group.get("format") in (None, FORMAT), source, where + "format", group.get("format"),
                "only pack-quantized")
        targets = group.get("targets")
        require(isinstance(targets, list) and all(t == "Linear" or (isinstance(t, str) and t.startswith("re:"))
                                                  for t in targets), source, where + "targets", targets,
                "Linear layers (or re: patterns over them)")
        require(group.get("input_activations") is None, source, where + "input_activations",
                group.get("input_activations"), "activation quantization (W8A8 and the like) is not supported; "
                "only weight-only W4A16 / W8A16")
        require(group.get("output_activations") is None, source, where + "output_activations",
                group.get("output_activations"), "weight-only quantization only")
        schemes[gname] = _parse_weights(group.get("weights"), source, where + "weights.")
    first = next(iter(schemes.values()))
    for gname, scheme in schemes.items():
        require(scheme == first, source, f"config_groups.{gname}.weights", groups[gname].get("weights"),
                "every config group must use the same weight scheme")
    bits, group_size, symmetric, act_order = first
    return QuantizationConfig(method="compressed-tensors", bits=bits, group_size=group_size,
                              has_zeros=not symmetric, act_order=act_order, checkpoint_format=FORMAT,
                              ignore=tuple(ignore), source=source)


def _parse_weights(w: object, source: str, where: str) -> tuple[int, int, bool, bool]:
    """(bits, group_size, symmetric, act_order) of one group's `weights` args."""
    require(isinstance(w, dict), source, where[:-1], w, "weight quantization args")
    check_fields(w, source, _WEIGHT_FIELDS, where)
    bits = w.get("num_bits", 8)
    require(bits in (4, 8) and not isinstance(bits, bool), source, where + "num_bits", bits, "4 or 8")
    require(w.get("type", "int") == "int", source, where + "type", w.get("type"),
            "integer weights only (float types belong to the FP8 work)")
    symmetric = w.get("symmetric", True)
    require(isinstance(symmetric, bool), source, where + "symmetric", symmetric, "true or false")
    require(w.get("dynamic", False) is False, source, where + "dynamic", w.get("dynamic"),
            "weights must be static (stored scales)")
    require(w.get("block_structure") is None, source, where + "block_structure", w.get("block_structure"),
            "block quantization is not supported")
    strategy = w.get("strategy")
    if strategy == "channel":
        require(w.get("group_size") in (None, -1), source, where + "group_size", w.get("group_size"),
                "the channel strategy has no group size")
        group_size = -1
    else:
        require(strategy == "group", source, where + "strategy", strategy, "channel or group")
        group_size = as_group_size(w.get("group_size"), source, where + "group_size")
    actorder = w.get("actorder")
    require(actorder in (None, False, True, "weight", "static", "group", "dynamic"), source, where + "actorder",
            actorder, "null, weight or group")
    act_order = actorder in (True, "group", "dynamic")  # "weight" only reordered the calibration
    if act_order:
        require(strategy == "group", source, where + "actorder", actorder, "group actorder needs the group strategy")
    return bits, group_size, symmetric, act_order


def required_suffixes(cfg: QuantizationConfig) -> set[str]:
    """Checkpoint tensors each quantized module must have."""
    need = {"weight_packed", "weight_scale", "weight_shape"}
    if cfg.has_zeros:
        need.add("weight_zero_point")
    if cfg.act_order:
        need.add("weight_g_idx")
    return need


def unpack_zero_points(zp: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """weight_zero_point int32 [ceil(N / p), ngroups] (packed along N) -> unsigned zeros uint8 [N, ngroups]."""
    return unpack_along_last(zp.t(), bits, n).t().contiguous()


def convert_optional(cfg: QuantizationConfig, name: str, suffix: str, t: torch.Tensor) -> None:
    """Tensors that carry nothing for this config are checked and dropped.

    A symmetric config's stored zero points must all be 0 (signed); a g_idx
    without group actorder must be the trivial k // group_size.
    """
    if suffix == "weight_zero_point":
        n = t.shape[0] * (32 // cfg.bits) if t.dtype == torch.int32 else t.shape[0]
        z = unpack_zero_points(t, cfg.bits, n) if t.dtype == torch.int32 else t.to(torch.int64) + (1 << (cfg.bits - 1))
        if not bool((z == 1 << (cfg.bits - 1)).all()):
            raise bad_tensor(name, "symmetric", "the weights are symmetric but the stored zero points are not 0")
        return None
    k = t.shape[0]
    trivial = torch.arange(k, device=t.device) // (k if cfg.group_size == -1 else cfg.group_size)
    if t.dim() != 1 or not bool((t.to(torch.int64) == trivial).all()):
        raise bad_tensor(name, "actorder", "actorder is not group but weight_g_idx is not k // group_size")
    return None


def convert_module(cfg: QuantizationConfig, prefix: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One pack-quantized linear's tensors -> tokenmill's {qweight, scales, qzeros?, g_idx?}; weight_shape checked.

    Raises:
        ValueError: naming the tensor and the field when a dtype or shape
            disagrees with the bits, the group size or weight_shape.
    """
    packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
    p = 32 // cfg.bits
    if shape.numel() != 2:
        raise bad_tensor(f"{prefix}.weight_shape", "shape", f"expected [N, K], got {shape.tolist()}")
    n, k = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or list(packed.shape) != [n, -(-k // p)]:
        raise bad_tensor(f"{prefix}.weight_packed", "num_bits", f"expected int32 [{n}, {-(-k // p)}] for "
                         f"{cfg.bits}-bit values of weight_shape [{n}, {k}], got {packed.dtype} {list(packed.shape)}")
    ngroups = 1 if cfg.group_size == -1 else -(-k // cfg.group_size)
    if scale.dim() == 1 and cfg.group_size == -1:
        scale = scale.unsqueeze(-1)
    if list(scale.shape) != [n, ngroups]:
        raise bad_tensor(f"{prefix}.weight_scale", "group_size", f"expected [{n}, {ngroups}] for K = {k} and "
                         f"group_size {cfg.group_size}, got {list(scale.shape)}")
    out = {"qweight": packed, "scales": scale.contiguous()}
    if cfg.has_zeros:
        zp = parts["weight_zero_point"]
        if zp.dtype == torch.int8 and list(zp.shape) == [n, ngroups]:  # unpacked signed zeros (older releases)
            out["qzeros"] = (zp.to(torch.int16) + (1 << (cfg.bits - 1))).to(torch.uint8)
        elif zp.dtype != torch.int32 or list(zp.shape) != [-(-n // p), ngroups]:
            raise bad_tensor(f"{prefix}.weight_zero_point", "num_bits", f"expected int32 [{-(-n // p)}, {ngroups}] "
                             f"(packed along N), got {zp.dtype} {list(zp.shape)}")
        else:
            out["qzeros"] = unpack_zero_points(zp, cfg.bits, n)
    if cfg.act_order:
        g_idx = parts["weight_g_idx"]
        if list(g_idx.shape) != [k] or (k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= ngroups)):
            raise bad_tensor(f"{prefix}.weight_g_idx", "actorder", f"expected [{k}] groups in [0, {ngroups})")
        out["g_idx"] = g_idx.to(torch.int32)
    return out
