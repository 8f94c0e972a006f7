"""Writers of real-format FP8 checkpoints and their reference dequantization (and activation quantization).

`write_fp8_checkpoint(dense_dir, out_dir, layout)` quantizes every 2-D `*_proj.weight` of an HF folder (as
checkpoints.py does for int4: attention, MLP and per-expert projections; embeddings, lm_head, norms and the
MoE router stay as they are) and writes:

- "fp8-block": the `quant_method: fp8` layout of DeepSeek-V3 / Qwen3-FP8: `weight` float8_e4m3fn and
  `weight_scale_inv` [ceil(N/128), ceil(K/128)] float32, `weight_block_size: [128, 128]`, dynamic activations;
- "fp8-tensor-static": `quant_method: fp8` with one float32 `weight_scale` per tensor and a calibrated static
  `input_scale` per module (amax of its input over a few random tokens / 448, as llm-compressor's static
  observer); per-expert modules get input_scale 1 (tokenmill checks and drops them: experts quantize per token);
- "ct-fp8-dynamic": compressed-tensors float-quantized, llm-compressor's FP8_DYNAMIC scheme (channel weights
  [N, 1], dynamic per-token activations), compressed by compressed-tensors' own `FloatQuantizationCompressor`
  from scales of its own `calculate_qparams`;
- "ct-fp8-w8a16": compressed-tensors weight-only FP8 (strategy tensor), which llm-compressor writes as
  `naive-quantized` (`NaiveQuantizationCompressor`).

`reference_fp8_state_dict(folder)` reads a folder back into dense float32 weights: compressed-tensors folders
with the library's `decompress`, the fp8 layout by its published formula (weight * scale, block scales
repeated over their 128 x 128 blocks). `activation_hooks(model, folder)` puts on a transformers model the
W8A8 activation quantization the checkpoint asks for (per token, per 1 x 128 group, or the static
input_scale), for the linear modules the checkpoint quantizes.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

try:
    from .checkpoints import _per_expert, is_quantized_by_tools
    from .references import read_state_dict
except ImportError:
    from checkpoints import _per_expert, is_quantized_by_tools
    from references import read_state_dict

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LAYOUTS = ("fp8-block", "fp8-tensor-static", "ct-fp8-dynamic", "ct-fp8-w8a16")
BLOCK = 128


def _ct_args(layout: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if layout == "ct-fp8-dynamic":
        weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
        acts = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    else:
        weights = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        acts = None
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)


def _ct_compressor(layout: str):
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
        NaiveQuantizationCompressor,
    )

    return FloatQuantizationCompressor if layout == "ct-fp8-dynamic" else NaiveQuantizationCompressor


def _ct_quantize(w: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_args(layout)
    if scheme.weights.strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = calculate_qparams(lo, hi, scheme.weights)
    out = _ct_compressor(layout).compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    assert out["weight"].dtype == FP8 and "weight_zero_point" not in out
    return {"weight": out["weight"], "weight_scale": out["weight_scale"]}


def _block_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK)
    padded[:n, :k] = w.float()
    amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return {"weight": q, "weight_scale_inv": scale}


def _tensor_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = (w.float().abs().amax() / FP8_MAX).clamp_min(1e-12)
    return {"weight": (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), "weight_scale": scale.reshape(())}


def calibrate_input_scales(dense_dir: str, modules: set[str], num_tokens: int = 24, seed: int = 0) -> dict[str, float]:
    """module -> amax of its input over `num_tokens` random tokens / 448 (a static per-tensor input scale)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: amax.__setitem__(
        name, max(amax.get(name, 0.0), args[0].abs().max().item()))) for name, m in model.named_modules()
        if name in modules]
    ids = torch.randint(0, model.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return {name: a / FP8_MAX for name, a in amax.items()}


def _config(layout: str, ignore: list[str]) -> dict:
    if layout == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ignore or None}
    if layout == "fp8-tensor-static":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ignore}
    scheme = _ct_args(layout)
    fmt = "float-quantized" if layout == "ct-fp8-dynamic" else "naive-quantized"
    group = {"targets": ["Linear"], "weights": scheme.weights.model_dump(),
             "input_activations": None if scheme.input_activations is None else scheme.input_activations.model_dump(),
             "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head", "re:.*mlp.gate$"] + ignore, "quantization_status": "compressed",
            "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "global_compression_ratio": None,
            "version": "0.20.1"}


def write_fp8_checkpoint(dense_dir: str, out_dir: str, layout: str, skip_modules: tuple[str, ...] = ()) -> str:
    """Write `dense_dir`'s weights as an FP8 checkpoint in `layout` (module docstring); returns out_dir.

    skip_modules: module paths left in 16 bits and listed in the config's ignore list.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}")
    os.makedirs(out_dir, exist_ok=True)
    for entry in os.listdir(dense_dir):
        src = os.path.join(dense_dir, entry)
        if os.path.isfile(src) and not entry.endswith(".safetensors") and entry != "config.json":
            shutil.copy(src, os.path.join(out_dir, entry))
    state = _per_expert(read_state_dict(dense_dir))
    targets = {n[: -len(".weight")] for n, t in state.items() if is_quantized_by_tools(n, t)} - set(skip_modules)
    input_scales = calibrate_input_scales(dense_dir, targets) if layout == "fp8-tensor-static" else {}
    out = {}
    for name, t in state.items():
        module = name[: -len(".weight")]
        if module not in targets or not name.endswith(".weight"):
            out[name] = t
            continue
        if layout == "fp8-block":
            parts = _block_quantize(t)
        elif layout == "fp8-tensor-static":
            parts = _tensor_quantize(t)
            parts["input_scale"] = torch.tensor(input_scales.get(module, 1.0), dtype=torch.float32)
        else:
            parts = _ct_quantize(t, layout)
        out.update({f"{module}.{suffix}": v.contiguous() for suffix, v in parts.items()})
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = _config(layout, list(skip_modules))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return out_dir


def _layout_of(folder: str) -> tuple[str, dict]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        q = json.load(f)["quantization_config"]
    if q["quant_method"] == "fp8":
        return ("fp8-block" if q.get("weight_block_size") else "fp8-tensor-static"), q
    return ("ct-fp8-dynamic" if q["format"] == "float-quantized" else "ct-fp8-w8a16"), q


def reference_fp8_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """The dense float32 weights an FP8 folder stands for (module docstring); input_scale tensors dropped."""
    layout, _ = _layout_of(folder)
    state = read_state_dict(folder)
    out = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        module = name[: -len(".weight")]
        if t.dtype != FP8:
            out[name] = t
        elif layout.startswith("ct-"):
            dense = _ct_compressor(layout).decompress({"weight": t, "weight_scale": state[f"{module}.weight_scale"]},
                                                      _ct_args(layout))
            out[name] = dense["weight"].float()
        elif layout == "fp8-block":
            s = state[f"{module}.weight_scale_inv"].float()
            n, k = t.shape
            out[name] = t.float() * s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
        else:
            out[name] = t.float() * state[f"{module}.weight_scale"].float()
    return out


def fake_quantize_activations(x: torch.Tensor, group: int | None, static_scale: float | None) -> torch.Tensor:
    """x quantized to e4m3 and back: per token (amax / 448 per row), per 1 x `group` run, or with a static scale."""
    xf = x.float()
    if static_scale is not None:
        s = torch.tensor(static_scale)
    elif group is None:
        s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    else:
        k = xf.shape[-1]
        kb = -(-k // group)
        padded = torch.nn.functional.pad(xf, (0, kb * group - k)).unflatten(-1, (kb, group))
        s = (padded.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12).expand(padded.shape)
        s = s.flatten(-2)[..., :k]
    return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).to(x.dtype)


def activation_hooks(model: torch.nn.Module, folder: str) -> list:
    """Forward pre-hooks quantizing the input of every nn.Linear the FP8 folder quantizes (W8A8 layouts only;
    experts, stacked in transformers 5 and weight-only in tokenmill's float32 models, stay unquantized). Returns the handles."""
    layout, q = _layout_of(folder)
    if layout == "ct-fp8-w8a16":
        return []
    state = read_state_dict(folder)
    group = BLOCK if layout == "fp8-block" else None
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and state.get(f"{name}.weight", torch.empty(0)).dtype == FP8:
            static = state[f"{name}.input_scale"].item() if layout == "fp8-tensor-static" else None
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, g=group, s=static: (fake_quantize_activations(args[0], g, s),)))
    return handles
