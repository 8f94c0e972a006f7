"""GPTQ (AutoGPTQ / GPTQModel) checkpoints: config parsing and per-tensor conversion to tokenmill's layout.

GPTQ's layout for a linear W [N, K] (out, in), b bits (4 or 8), p = 32 // b,
ngroups = ceil(K / G):

    qweight int32 [K / p, N]        packed along K, low bits first: bits b*j.. of word
                                    (r, n) hold q[r * p + j, n] (unsigned)
    qzeros  int32 [ngroups, N / p]  zero points packed along N, low bits first
    scales  float [ngroups, N]
    g_idx   int32 [K]               group of input row k (k // G without act-order)

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

`checkpoint_format: gptq` (v1, AutoGPTQ and GPTQModel's default) stores
every zero point minus one; GPTQModel converts v1 words to v2 by adding
0x11111111 (4-bit) / 0x01010101 (8-bit) to each int32 word, borrows and
carries included, and this module does the same, so a v1 word that a zero
of 0 made borrow reads back exactly. `gptq_v2` stores the zeros as they are.
(Sources: GPTQModel's `PackableQuantLinear.dequantize_weight` and
`convert_gptq_v1_to_v2_format_module`.) Symmetric checkpoints (`sym: true`)
store the midpoint 2^(b-1) in every zero; it is checked and dropped.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.quant_pack import pack_along_last, unpack_along_last
from tokenmill.quantization.config import (
    QuantizationConfig,
    TOOL_METADATA,
    as_bool,
    as_group_size,
    bad_tensor,
    check_fields,
    check_tool_fields,
    require,
)

SUFFIXES = {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales", "g_idx": "g_idx"}
FORMATS = ("gptq", "gptq_v2")

_FIELDS = {
    "quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format",
    # AutoGPTQ / GPTQModel calibration settings: they shaped the values, not the stored layout
    # (static_groups and desc_act's order are carried by g_idx itself).
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "mse", "act_group_aware",
    # transformers' GPTQConfig (optimum): calibration inputs and its own runtime kernels' options.
    "tokenizer", "dataset", "use_cuda_fp16", "model_seqlen", "block_name_to_quantize",
    "module_name_preceding_first_block", "batch_size", "pad_token_id", "use_exllama", "disable_exllama",
    "max_input_length", "exllama_config", "cache_block_outputs", "modules_in_block_to_quantize", "backend",
} | TOOL_METADATA


def parse_gptq_config(raw: dict, source: str) -> QuantizationConfig:
    """Parse a GPTQ config (config.json's `quantization_config` or `quantize_config.json`).

    Keys: `bits` (4 or 8), `group_size` (positive or -1), `sym` (default
    true), `desc_act` (act-order: g_idx tensors are used), `checkpoint_format`
    / `format` (`gptq` or `gptq_v2`; marlin, bitblas and planar exports are
    refused), plus the metadata keys listed in `_FIELDS`.

    Raises:
        ValueError: naming the key that is unknown or unsupported.
    """
    check_fields(raw, source, _FIELDS)
    bits = raw.get("bits")
    require(bits in (4, 8) and not isinstance(bits, bool), source, "bits", bits, "GPTQ checkpoints of 4 or 8 bits")
    group = as_group_size(raw.get("group_size", -1), source, "group_size")
    sym = as_bool(raw, "sym", True, source)
    desc_act = as_bool(raw, "desc_act", False, source)
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    require(fmt in FORMATS, source, "checkpoint_format", fmt,
            "gptq (zeros stored minus one) or gptq_v2; marlin, bitblas and planar exports are repacked differently")
    if "format" in raw and "checkpoint_format" in raw:
        require(str(raw["format"]).lower() == fmt, source, "format", raw["format"], "must agree with checkpoint_format")
    check_tool_fields(raw, source, "gptq", fmt)
    return QuantizationConfig(method="gptq", bits=bits, group_size=group, has_zeros=not sym, act_order=desc_act,
                              checkpoint_format=fmt, ignore=(), source=source)


def required_suffixes(cfg: QuantizationConfig) -> set[str]:
    """Tensors each quantized module must have: qzeros when asymmetric, g_idx with act-order."""
    need = {"qweight", "scales"}
    if cfg.has_zeros:
        need.add("qzeros")
    if cfg.act_order:
        need.add("g_idx")
    return need


def unpack_zeros(cfg: QuantizationConfig, qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros int32 [ngroups, W] -> the true unsigned zero points uint8 [ngroups, W * p] (v1 fixed up)."""
    if cfg.checkpoint_format == "gptq":
        one_each = sum(1 << (cfg.bits * j) for j in range(32 // cfg.bits))  # 0x11111111 / 0x01010101
        words = (qzeros.to(torch.int64) + one_each) & 0xFFFFFFFF
        qzeros = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return unpack_along_last(qzeros, cfg.bits, qzeros.shape[-1] * (32 // cfg.bits))


def convert_optional(cfg: QuantizationConfig, name: str, suffix: str, t: torch.Tensor) -> None:
    """Tensors that carry nothing for this config are checked and dropped.

    qzeros of a symmetric checkpoint must hold the midpoint in every zero;
    g_idx without act-order must be the trivial k // group_size.
    """
    if suffix == "qzeros":
        if not bool((unpack_zeros(cfg, t) == 1 << (cfg.bits - 1)).all()):
            raise bad_tensor(name, "sym / bits", f"sym is true but the zero points are not the midpoint "
                             f"{1 << (cfg.bits - 1)} of {cfg.bits}-bit values")
        return None
    k = t.shape[0]
    trivial = torch.arange(k, device=t.device) // (k if cfg.group_size == -1 else cfg.group_size)
    if t.dim() != 1 or not bool((t.to(torch.int64) == trivial).all()):
        raise bad_tensor(name, "desc_act / group_size", f"g_idx is not k // {cfg.group_size}, the order that "
                         f"desc_act false and group_size {cfg.group_size} imply")
    return None


def convert_module(cfg: QuantizationConfig, prefix: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One GPTQ linear's tensors -> tokenmill's {qweight [N, ceil(K/p)], scales [N, ngroups], qzeros?, g_idx?}.

    K is g_idx's length when act-order, else qweight's rows * p.

    Raises:
        ValueError: naming the tensor and the field when a dtype or shape
            disagrees with the bits, the group size or the other tensors.
    """
    qweight, scales = parts["qweight"], parts["scales"]
    p = 32 // cfg.bits
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise bad_tensor(f"{prefix}.qweight", "bits", f"expected int32 [K / {p}, N], got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    n = qweight.shape[1]
    g_idx = parts.get("g_idx")
    k = qweight.shape[0] * p if g_idx is None else g_idx.shape[0]
    if -(-k // p) != qweight.shape[0]:
        raise bad_tensor(f"{prefix}.qweight", "bits", f"{qweight.shape[0]} packed rows cannot hold K = {k} "
                         f"{cfg.bits}-bit values ({p} per word; g_idx has {k} rows)")
    ngroups = 1 if cfg.group_size == -1 else -(-k // cfg.group_size)
    if scales.dim() != 2 or scales.shape[1] != n:
        raise bad_tensor(f"{prefix}.scales", "shape", f"scales {list(scales.shape)} must have N = {n} columns "
                         f"like qweight {list(qweight.shape)}")
    if scales.shape[0] != ngroups:
        raise bad_tensor(f"{prefix}.scales", "group_size / bits", f"{scales.shape[0]} groups for K = {k} input rows; "
                         f"group_size {cfg.group_size} with {cfg.bits} bits gives {ngroups}")
    if k == qweight.shape[0] * p:
        ours = qweight.t().contiguous()  # GPTQ packs along K already: the same words, transposed
    else:  # clear the bits past K in each row's last word
        ours = pack_along_last(unpack_along_last(qweight.t(), cfg.bits, k), cfg.bits)
    out = {"qweight": ours, "scales": scales.t().contiguous()}
    if cfg.has_zeros:
        qzeros = parts["qzeros"]
        if qzeros.dtype != torch.int32 or list(qzeros.shape) != [ngroups, -(-n // p)]:
            raise bad_tensor(f"{prefix}.qzeros", "bits", f"expected int32 [{ngroups}, {-(-n // p)}] for "
                             f"{cfg.bits}-bit zeros of N = {n} columns, got {qzeros.dtype} {list(qzeros.shape)}")
        out["qzeros"] = unpack_zeros(cfg, qzeros)[:, :n].t().contiguous()
    if cfg.act_order:
        if g_idx.dim() != 1 or (k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= ngroups)):
            raise bad_tensor(f"{prefix}.g_idx", "group_size", f"g_idx must hold groups in [0, {ngroups})")
        out["g_idx"] = g_idx.to(torch.int32)
    return out
