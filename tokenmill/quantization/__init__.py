"""Quantized checkpoints: int4/int8 weight-only (AWQ, GPTQ, compressed-tensors pack-quantized) and FP8
(`fp8`, compressed-tensors float-quantized, `--quantization fp8` at load).

`config` finds and parses a checkpoint's quantization config and resolves
`--quantization`; `convert` streams checkpoint tensors into tokenmill's one
layout (tokenmill/kernels/quant_pack.py) through the per-format modules
`awq`, `gptq`, `compressed_tensors` and `fp8` (`ct_float` parses compressed-tensors' FP8
configs); `support` says which device runs
them through which kernel.
"""

from tokenmill.quantization.config import (
    QuantizationConfig,
    find_quantization_config,
    is_ignored,
    parse_quantization_config,
    resolve_quantization,
)
from tokenmill.quantization.convert import convert_weights, quantized_modules
from tokenmill.quantization.support import SupportRow, check_supported, kernel_for, rows_for, support_table

__all__ = [
    "QuantizationConfig", "SupportRow", "check_supported", "convert_weights", "find_quantization_config",
    "is_ignored", "kernel_for", "parse_quantization_config", "quantized_modules", "resolve_quantization",
    "rows_for", "support_table",
]
