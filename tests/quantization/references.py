"""Reference dequantization of quantized checkpoint folders, with the tools' own code where it runs on CPU.

`reference_dequantized_state_dict(folder)` returns the dense weights a
folder written by checkpoints.py (or by the tools) stands for:

- compressed-tensors: its `PackedQuantizationCompressor.decompress`; for
  actorder "group" (whose g_idx decompression the library dropped) its
  `unpack_from_int32` + group `dequantize` over columns sorted by group;
- awq: AutoAWQ's `dequantize_gemm` (plain torch), loaded without AutoAWQ's
  package init;
- gptq: GPTQModel does not install on CPU here (it needs a newer torch and
  compiles extensions), so this file reads its `dequantize_weight` and its
  v1 -> v2 zero conversion (add 0x11111111 / 0x01010101 per int32 word),
  written independently of tokenmill's converter. It was checked once, outside
  the suite, against AutoGPTQ 0.7.1's own CPU dequantization
  (`qlinear_cuda.QuantLinear.forward` without the CUDA extension, act-order
  included) and AutoGPTQ's packer (`qlinear_cuda_old.QuantLinear.pack`)
  against checkpoints.py's GPTQ writer: bit-identical for 4 and 8 bits,
  groups 32 / 64 / 128 / -1, sym and asym. AutoGPTQ is not a test dependency:
  its wheel installs a top-level `tests` package that shadows this
  repository's. (The two tools differ only for a v1 zero of 0, which
  AutoGPTQ's packer cannot store; GPTQModel's word-level reading is used.)
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import torch
from safetensors import safe_open


def read_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files, by name."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _read_quantization_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if "quantization_config" in config:
        return config["quantization_config"]
    for name in ("quantize_config.json", "quant_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    raise ValueError(f"{folder} has no quantization config")


def tool_module(package: str, module: str):
    """Import `package.module` from an installed tool without running `package/__init__.py`, or None if absent.

    AutoAWQ's and AutoGPTQ's package inits import their model registries
    (datasets, CUDA-era transformers APIs); the packing and unpacking modules
    need only torch / numpy / transformers. sys.modules is restored after.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    saved = {k: v for k, v in sys.modules.items() if k == package or k.startswith(package + ".")}
    stand_in = types.ModuleType(package)
    stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = stand_in
    try:
        return importlib.import_module(f"{package}.{module}")
    finally:
        for name in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[name]
        sys.modules.update(saved)


def autoawq_packing_utils():
    """AutoAWQ's `awq/utils/packing_utils.py` (its plain-torch dequantize_gemm), or None without autoawq."""
    return tool_module("awq", "utils.packing_utils")


def _awq_reference(parts: dict, cfg: dict) -> torch.Tensor:
    utils = autoawq_packing_utils()
    if utils is None:
        raise ModuleNotFoundError("autoawq", name="awq")
    k = parts["qweight"].shape[0]
    group = cfg.get("group_size", cfg.get("q_group_size"))
    w = utils.dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"], 4, k if group == -1 else group)
    return w.t().contiguous()


def gptq_reference(parts: dict, cfg: dict) -> torch.Tensor:
    """GPTQModel's dequantize_weight, read: zeros unpacked along N, weights along K, W^T = s[g] * (q - z[g]).

    parts: the module's GPTQ tensors (qweight, qzeros, scales, g_idx); cfg: its
    quantization config (bits, checkpoint_format). Returns W [N, K] in the scales' dtype.
    """
    bits = cfg["bits"]
    p, mask = 32 // bits, (1 << bits) - 1
    qzeros = parts["qzeros"].to(torch.int64)
    if cfg.get("checkpoint_format", cfg.get("format", "gptq")) == "gptq":  # GPTQModel's v1 -> v2 conversion
        qzeros = (qzeros + int("".join(["0" * (bits - 1) + "1"] * p), 2)) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits)
    zeros = ((qzeros.unsqueeze(2) >> shifts) & mask).reshape(qzeros.shape[0], -1)
    scales = parts["scales"]
    zeros = zeros[:, : scales.shape[1]]
    qweight = parts["qweight"].to(torch.int64) & 0xFFFFFFFF
    weight = ((qweight.unsqueeze(1) >> shifts.unsqueeze(-1)) & mask).reshape(-1, qweight.shape[1])
    g_idx = parts["g_idx"].long()
    weight = weight[: g_idx.shape[0]]
    return (scales[g_idx] * (weight - zeros[g_idx]).to(scales.dtype)).t().contiguous()


def _ct_reference(parts: dict, cfg: dict) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    cfg = json.loads(json.dumps(cfg))
    for group in cfg["config_groups"].values():
        if group["weights"].get("actorder") == "group":  # validated by tokenmill; see below
            group["weights"]["actorder"] = None
    qc = QuantizationConfig.model_validate({k: v for k, v in cfg.items()
                                            if k not in ("sparsity_config", "transform_config", "version")})
    scheme: QuantizationScheme = next(iter(qc.config_groups.values()))
    args = scheme.weights
    if "weight_g_idx" not in parts:
        state = {k: v for k, v in parts.items()}
        return PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    # compressed-tensors dropped actorder "group" (g_idx) decompression; its group dequantize runs on columns
    # sorted by group (each group has exactly group_size columns), then the columns go back in place.
    g_idx = parts["weight_g_idx"].long()
    shape = parts["weight_shape"]
    counts = torch.bincount(g_idx)
    assert bool((counts == args.group_size).all()), "act-order groups must each hold group_size columns"
    order = torch.argsort(g_idx, stable=True)
    q = unpack_from_int32(parts["weight_packed"], args.num_bits, shape)
    zp = None
    if not args.symmetric:
        zp = unpack_from_int32(parts["weight_zero_point"], args.num_bits,
                               (int(shape[0]), parts["weight_scale"].shape[-1]), packed_dim=0)
    w_sorted = dequantize(x_q=q[:, order], scale=parts["weight_scale"], zero_point=zp, args=args)
    w = torch.empty_like(w_sorted)
    w[:, order] = w_sorted
    return w


_REFERENCE = {"awq": (_awq_reference, "qweight"), "gptq": (gptq_reference, "qweight"),
              "compressed-tensors": (_ct_reference, "weight_packed")}
_SUFFIXES = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
             "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx",
                                    "weight_shape")}


def reference_dequantized_state_dict(out_dir: str) -> dict[str, torch.Tensor]:
    """The dense state dict a quantized folder stands for, dequantized by the reference libraries' code.

    Quantized modules come back as `<module>.weight` [N, K] in the scales'
    dtype (the libraries multiply in it); every other tensor unchanged.
    Per-expert MoE weights keep their per-expert names.
    """
    cfg = _read_quantization_config(out_dir)
    method = cfg.get("quant_method", "gptq" if "desc_act" in cfg or "sym" in cfg else "awq")
    reference, packed = _REFERENCE[method]
    state = read_state_dict(out_dir)
    modules = {n[: -len(packed) - 1] for n in state if n.endswith("." + packed)}
    out = {}
    for name, t in state.items():
        module, _, suffix = name.rpartition(".")
        if module not in modules or suffix not in _SUFFIXES[method]:
            out[name] = t
    for module in sorted(modules):
        parts = {s: state[f"{module}.{s}"] for s in _SUFFIXES[method] if f"{module}.{s}" in state}
        out[f"{module}.weight"] = reference(parts, cfg)
    return out
