"""FP8 configs (`quant_method: fp8`, compressed-tensors float-quantized, `--quantization fp8`), the FP8 tensor
converter, and bad FP8 checkpoints failing at load with the tensor and the field named."""

from __future__ import annotations

import json
import os

import pytest
import torch
from fp8_checkpoints import write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model
from tokenmill.quantization import convert_weights, parse_quantization_config, quantized_modules, resolve_quantization

FP8 = torch.float8_e4m3fn
BLOCK_CFG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "mlp.gate"]}
STATIC_CFG = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}


def _ct(weights=None, acts="token", fmt="float-quantized", **top):
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
         "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    w.update(weights or {})
    a = None if acts is None else {"num_bits": 8, "type": "float", "symmetric": True, "strategy": acts,
                                   "dynamic": acts != "tensor", "group_size": 128 if acts == "group" else None,
                                   "observer": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a,
                                          "output_activations": None, "format": fmt}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, **top}


@pytest.mark.parametrize("raw, want", [
    (BLOCK_CFG, dict(method="fp8", weight_block_size=(128, 128), activation_scheme="dynamic",
                     weight_strategy="block")),
    (STATIC_CFG, dict(method="fp8", weight_block_size=None, activation_scheme="static", ignore=("lm_head",))),
    (_ct(), dict(method="compressed-tensors", weight_strategy="channel", activation_scheme="dynamic")),
    (_ct({"strategy": "tensor"}, acts="tensor"), dict(weight_strategy="tensor", activation_scheme="static")),
    (_ct({"strategy": "block", "block_structure": [128, 128]}, acts="group"),
     dict(weight_strategy="block", weight_block_size=(128, 128), activation_scheme="dynamic")),
    (_ct({"strategy": "tensor"}, acts=None, fmt="naive-quantized"), dict(weight_strategy="tensor",
                                                                         activation_scheme=None)),
])
def test_fp8_configs_parse(raw, want):
    cfg = parse_quantization_config(raw)
    assert cfg.is_fp8 and cfg.bits == 8
    for key, value in want.items():
        assert getattr(cfg, key) == value, key


@pytest.mark.parametrize("raw, field", [
    ({**BLOCK_CFG, "activation_scheme": "per_tensor"}, "activation_scheme"),
    ({**BLOCK_CFG, "activation_scheme": "static"}, "activation_scheme = 'static'.*dynamic per-group"),
    ({**BLOCK_CFG, "weight_block_size": [128]}, "weight_block_size"),
    ({**BLOCK_CFG, "weight_block_size": [128, 100]}, "weight_block_size.*multiple of 16"),
    ({**BLOCK_CFG, "fmt": "e5m2"}, "fmt"),
    ({**BLOCK_CFG, "ignored_layers": "lm_head"}, "ignored_layers"),
    ({**BLOCK_CFG, "kv_cache_scheme": None}, "'kv_cache_scheme'"),
    (_ct({"num_bits": 4}), "weights.num_bits"),
    (_ct({"symmetric": False}), "weights.symmetric"),
    (_ct({"strategy": "group", "group_size": 128}), "weights.strategy"),
    (_ct({"strategy": "block"}), "weights.block_structure"),
    (_ct({"mystery": 1}), "field config_groups.group_0.weights.'mystery'"),
    (_ct(acts="tensor") | {"config_groups": {"group_0": {**_ct()["config_groups"]["group_0"], "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True}}}}, "input_activations.strategy"),
    (_ct({"strategy": "block", "block_structure": [128, 128]}, acts="token"), "input_activations.strategy"),
    (_ct({"type": "int"}), "weights.type"),
])
def test_fp8_refusals_name_the_field(raw, field):
    with pytest.raises(ValueError, match=field):
        parse_quantization_config(raw)


def test_resolve_quantization_fp8():
    at_load = resolve_quantization(None, "fp8")
    assert at_load.checkpoint_format == "quantize-at-load" and at_load.activation_scheme == "dynamic"
    assert resolve_quantization(BLOCK_CFG, "fp8").checkpoint_format == "fp8"
    with pytest.raises(ValueError, match="disagrees with the checkpoint, which is quantized with compressed-tensors"):
        resolve_quantization(_ct(), "fp8")
    with pytest.raises(ValueError, match="only with --quantization fp8"):
        resolve_quantization(None, "awq")


def _convert(cfg, tensors):
    return dict(convert_weights(cfg, tensors.items(), quantized_modules(cfg, tensors)))


def test_converter_layouts():
    """Per-tensor scales broadcast to [N], block scales repeated over their rows: one scale per output row."""
    w = torch.randn(200, 160).to(FP8)
    block = _convert(parse_quantization_config(BLOCK_CFG), {
        "a.weight": w, "a.weight_scale_inv": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "norm.weight": torch.ones(3)})
    assert torch.equal(block["a.weight_scale"][:128], torch.tensor([[1.0, 2.0]]).expand(128, 2))
    assert torch.equal(block["a.weight_scale"][128:], torch.tensor([[3.0, 4.0]]).expand(72, 2))
    assert torch.equal(block["norm.weight"], torch.ones(3)) and block["a.weight"] is w
    static = _convert(parse_quantization_config(STATIC_CFG), {
        "a.weight": w, "a.weight_scale": torch.tensor(0.5), "a.input_scale": torch.tensor([0.25]),
        "m.experts.0.up_proj.weight": w, "m.experts.0.up_proj.weight_scale": torch.tensor(2.0),
        "m.experts.0.up_proj.input_scale": torch.tensor(1.0)})
    assert torch.equal(static["a.weight_scale"], torch.full((200,), 0.5)) and static["a.input_scale"].tolist() == [0.25]
    assert "m.experts.0.up_proj.input_scale" not in static  # experts quantize dynamically: checked, not kept
    channel = _convert(parse_quantization_config(_ct()), {"a.weight": w, "a.weight_scale": torch.ones(200, 1)})
    assert channel["a.weight_scale"].shape == (200,) and channel["a.weight_scale"].dtype == torch.float32


@pytest.mark.parametrize("cfg, tensors, match", [
    (BLOCK_CFG, {"a.weight": torch.zeros(200, 160, dtype=FP8), "a.weight_scale_inv": torch.ones(2, 1)},
     r"a\.weight_scale_inv disagrees with the quantization config's weight_block_size: expected \[2, 2\]"),
    (BLOCK_CFG, {"a.weight": torch.zeros(8, 8, dtype=FP8), "a.weight_scale": torch.ones(1)},
     r"a\.weight_scale disagrees with the quantization config's weight_block_size: .*scales are weight_scale_inv"),
    (BLOCK_CFG, {"a.weight": torch.zeros(8, 8, dtype=FP8)},
     r"a\.weight disagrees with .*weight_scale_inv: it is FP8 but the checkpoint has no a\.weight_scale_inv"),
    (STATIC_CFG, {"a.weight": torch.zeros(8, 8, dtype=FP8), "a.weight_scale": torch.ones(1)},
     r"a\.input_scale is missing .*activation_scheme static"),
    (STATIC_CFG, {"a.weight": torch.zeros(8, 8), "a.weight_scale": torch.ones(1), "a.input_scale": torch.ones(1)},
     r"a\.weight disagrees .*quant_method: expected float8_e4m3fn \[N, K\], got torch.float32"),
    (_ct(), {"a.weight": torch.zeros(8, 8, dtype=FP8), "a.weight_scale": torch.ones(1, 8)},
     r"a\.weight_scale disagrees with the quantization config's strategy: expected \[8\] or \[8, 1\]"),
    (_ct(), {"a.weight": torch.zeros(8, 8, dtype=FP8), "a.weight_scale": -torch.ones(8, 1)},
     r"a\.weight_scale .*positive and finite"),
])
def test_bad_tensors_name_the_tensor_and_field(cfg, tensors, match):
    with pytest.raises(ValueError, match=match):
        _convert(parse_quantization_config(cfg), tensors)


def test_bad_checkpoint_fails_at_load(tiny_llama_dir, tmp_path):
    """A real fp8-block folder with one scale missing: get_model refuses it, naming the tensor and the field."""
    folder = write_fp8_checkpoint(tiny_llama_dir, str(tmp_path / "fp8"), "fp8-block")
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(state, path, metadata={"format": "pt"})
    cfg = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True).create_engine_config()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight disagrees .*weight_scale_inv"):
        get_model(cfg.model_config, "cpu", "float32")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["weight_block_size"] = [128, 0]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="weight_block_size"):
        EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True).create_engine_config()
