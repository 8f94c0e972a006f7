"""AWQ (AutoAWQ GEMM) checkpoints: config parsing and per-tensor conversion to tokenmill's layout.

AutoAWQ's GEMM layout for a linear W [N, K] (out, in), 4 bits, group G:

    qweight int32 [K, N / 8]        packed along N; word j holds output columns in the
                                    interleaved order AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]:
                                    bits 4i..4i+3 of word c hold column 8c + AWQ_ORDER[i]
    qzeros  int32 [K / G, N / 8]    unsigned zero points, packed like qweight
    scales  float [K / G, N]

    W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]

(source: AutoAWQ's `WQLinear_GEMM.from_linear` packing and
`awq/utils/packing_utils.py` `dequantize_gemm`, which the tests run as the
reference). There is no act-order; a checkpoint written with
`zero_point: false` is symmetric (zero 8), and its qzeros, when stored, must
hold 8.
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
    substring_pattern,
)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8

# checkpoint suffix -> tokenmill suffix
SUFFIXES = {"qweight": "qweight", "qzeros": "qzeros", "scales": "scales"}

_FIELDS = {
    "quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
    "modules_to_not_convert",
    # transformers' AwqConfig: runtime options of its own AWQ modules, not of the stored tensors.
    "backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config",
    # AutoRound's AWQ export: calibration hyper-parameters (data_type is checked).
    "data_type", "enable_quanted_input", "enable_minmax_tuning", "seqlen", "batch_size", "scale_dtype", "lr",
    "minmax_lr", "gradient_accumulate_steps", "iters", "amp", "nsamples", "low_gpu_mem_usage", "quant_block_list",
    "to_quant_block_names", "enable_norm_bias_tuning", "dataset", "autoround_version",
} | TOOL_METADATA


def parse_awq_config(raw: dict, source: str) -> QuantizationConfig:
    """Parse an AWQ config (`quant_method: awq`, or an AutoAWQ `quant_config.json`).

    Keys: `bits` / `w_bit` (4), `group_size` / `q_group_size` (positive or
    -1), `zero_point` (default true), `version` (`gemm`; gemv, gemv_fast,
    exllama, marlin and ipex repack the tensors differently and are
    refused), `modules_to_not_convert` (substring matches, as AutoAWQ).

    Raises:
        ValueError: naming the key that is unknown or unsupported.
    """
    check_fields(raw, source, _FIELDS)
    bits = raw.get("bits", raw.get("w_bit", 4))
    require(bits == 4, source, "bits", bits, "AWQ checkpoints are 4-bit")
    if "bits" in raw and "w_bit" in raw:
        require(raw["bits"] == raw["w_bit"], source, "w_bit", raw["w_bit"], "must agree with bits")
    group = raw.get("group_size", raw.get("q_group_size", 128))
    group = as_group_size(group, source, "group_size")
    if "group_size" in raw and "q_group_size" in raw:
        require(raw["group_size"] == raw["q_group_size"], source, "q_group_size", raw["q_group_size"],
                "must agree with group_size")
    zero_point = as_bool(raw, "zero_point", True, source)
    version = str(raw.get("version", "gemm")).lower()
    require(version == "gemm", source, "version", raw.get("version"),
            "only AWQ's GEMM packing is read; gemv, gemv_fast, exllama, marlin and ipex exports repack the tensors")
    backend = raw.get("backend")
    require(backend in (None, "autoawq", "AUTOAWQ", "auto_awq"), source, "backend", backend,
            "llm-awq exports use a different packing; AutoAWQ's GEMM packing is read")
    require(raw.get("data_type", "int") == "int", source, "data_type", raw.get("data_type"), "integer weights only")
    if "sym" in raw:
        require(raw["sym"] is (not zero_point), source, "sym", raw["sym"], "must be the opposite of zero_point")
    require(not raw.get("desc_act"), source, "desc_act", raw.get("desc_act"), "AWQ has no act-order")
    check_tool_fields(raw, source, "awq", "gemm")
    skip = raw.get("modules_to_not_convert") or []
    require(isinstance(skip, list) and all(isinstance(s, str) for s in skip), source, "modules_to_not_convert",
            skip, "a list of module names")
    return QuantizationConfig(method="awq", bits=4, group_size=group, has_zeros=zero_point, act_order=False,
                              checkpoint_format="gemm", ignore=tuple(substring_pattern(s) for s in skip),
                              source=source)


def required_suffixes(cfg: QuantizationConfig) -> set[str]:
    """Checkpoint tensors each quantized module must have (qzeros only when zero_point)."""
    return {"qweight", "scales", "qzeros"} if cfg.has_zeros else {"qweight", "scales"}


def _unpack_awq(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 words in AWQ's interleaved order -> uint8 [R, C * 8] in plain column order."""
    vals = unpack_along_last(packed, bits, packed.shape[-1] * (32 // bits))  # nibble order
    p = 32 // bits
    inverse = [AWQ_ORDER.index(i) for i in range(p)]  # column i of a word sits in nibble inverse[i]
    cols = (torch.arange(packed.shape[-1], device=packed.device).unsqueeze(-1) * p
            + torch.tensor(inverse, device=packed.device)).reshape(-1)
    return vals[..., cols]


def convert_optional(cfg: QuantizationConfig, name: str, suffix: str, t: torch.Tensor) -> None:
    """qzeros of a `zero_point: false` checkpoint: must hold the midpoint 8; dropped."""
    z = _unpack_awq(t, cfg.bits)
    if not bool((z == 1 << (cfg.bits - 1)).all()):
        raise bad_tensor(name, "zero_point", "zero_point is false (symmetric) but the stored zero points are not 8")


def convert_module(cfg: QuantizationConfig, prefix: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One AWQ linear's tensors -> tokenmill's {qweight [N, K/8], scales [N, ngroups], qzeros uint8 [N, ngroups]}.

    Raises:
        ValueError: naming the tensor and the field when a dtype or shape
            disagrees with 4 bits, the group size or the other tensors.
    """
    qweight, scales = parts["qweight"], parts["scales"]
    p = 32 // cfg.bits
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise bad_tensor(f"{prefix}.qweight", "bits", f"expected int32 [K, N / {p}], got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    k, n = qweight.shape[0], qweight.shape[1] * p
    ngroups = 1 if cfg.group_size == -1 else -(-k // cfg.group_size)
    if scales.dim() != 2 or scales.shape[1] != n:
        raise bad_tensor(f"{prefix}.scales", "bits", f"scales {list(scales.shape)} must have N = {n} columns "
                         f"(qweight {list(qweight.shape)} holds {p} {cfg.bits}-bit values per word)")
    if scales.shape[0] != ngroups:
        raise bad_tensor(f"{prefix}.scales", "group_size", f"{scales.shape[0]} groups for K = {k} input rows; "
                         f"group_size {cfg.group_size} gives {ngroups}")
    q = _unpack_awq(qweight, cfg.bits)  # [K, N]
    out = {"qweight": pack_along_last(q.t(), cfg.bits), "scales": scales.t().contiguous()}
    if cfg.has_zeros:
        qzeros = parts["qzeros"]
        if qzeros.dtype != torch.int32 or list(qzeros.shape) != [ngroups, n // p]:
            raise bad_tensor(f"{prefix}.qzeros", "group_size", f"expected int32 [{ngroups}, {n // p}], got "
                             f"{qzeros.dtype} {list(qzeros.shape)}")
        out["qzeros"] = _unpack_awq(qzeros, cfg.bits).t().contiguous()
    return out
