"""Quantization config detection, parsing (configs as the real tools write them) and --quantization resolution."""

from __future__ import annotations

import json
import logging

import pytest

from tokenmill.quantization import (
    QuantizationConfig,
    find_quantization_config,
    is_ignored,
    parse_quantization_config,
    resolve_quantization,
)

# GPTQModel 2.x (quantization_config in config.json; Qwen3-30B-A3B-GPTQ-Int4-style).
GPTQMODEL = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "lm_head": False, "quant_method": "gptq",
             "checkpoint_format": "gptq", "pack_dtype": "int32",
             "meta": {"quantizer": ["gptqmodel:2.2.0"], "uri": "https://github.com/modelcloud/gptqmodel",
                      "damp_percent": 0.01, "damp_auto_increment": 0.0025, "static_groups": False,
                      "true_sequential": True, "mse": 0.0}}
# AutoGPTQ's quantize_config.json (TheBloke-era).
AUTOGPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
            "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": None,
            "is_marlin_format": False, "quant_method": "gptq"}
# transformers' GPTQConfig.to_dict() (optimum exports).
TRANSFORMERS_GPTQ = {"batch_size": 1, "bits": 8, "block_name_to_quantize": None, "cache_block_outputs": True,
                     "damp_percent": 0.1, "dataset": None, "desc_act": False, "exllama_config": {"version": 1},
                     "group_size": -1, "max_input_length": None, "model_seqlen": None,
                     "module_name_preceding_first_block": None,
                     "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.down_proj"]], "pad_token_id": None,
                     "quant_method": "gptq", "sym": False, "tokenizer": None, "true_sequential": True,
                     "use_cuda_fp16": False, "use_exllama": True}
# AutoAWQ via transformers (config.json) and AutoAWQ's own quant_config.json.
AWQ = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "gemm",
       "modules_to_not_convert": None}
AUTOAWQ_FILE = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
# llm-compressor W4A16 (group 128, symmetric) and W8A16 (channel, asymmetric, actorder group).
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized",
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 128, "dynamic": False,
                                                      "actorder": None, "observer": "minmax",
                                                      "observer_kwargs": {}, "block_structure": None}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None, "version": "0.10.2"}


def _ct(**weights) -> dict:
    raw = json.loads(json.dumps(CT_W4A16))
    raw["config_groups"]["group_0"]["weights"].update(weights)
    return raw


@pytest.mark.parametrize("raw, want", [
    (GPTQMODEL, dict(method="gptq", bits=4, group_size=128, has_zeros=False, act_order=False,
                     checkpoint_format="gptq")),
    (AUTOGPTQ, dict(method="gptq", bits=4, group_size=128, has_zeros=False, act_order=True, checkpoint_format="gptq")),
    (TRANSFORMERS_GPTQ, dict(method="gptq", bits=8, group_size=-1, has_zeros=True, act_order=False)),
    ({**GPTQMODEL, "checkpoint_format": "gptq_v2", "sym": False}, dict(checkpoint_format="gptq_v2", has_zeros=True)),
    ({**GPTQMODEL, "format": "gptq_v2", "checkpoint_format": "gptq_v2", "method": "gptq", "dynamic": {}},
     dict(checkpoint_format="gptq_v2")),
    (AWQ, dict(method="awq", bits=4, group_size=128, has_zeros=True, act_order=False, checkpoint_format="gemm",
               ignore=())),
    (AUTOAWQ_FILE, dict(method="awq", group_size=64, has_zeros=True)),
    ({**AWQ, "zero_point": False, "modules_to_not_convert": ["lm_head", "visual"], "backend": "autoawq",
      "do_fuse": False}, dict(has_zeros=False, ignore=("re:.*lm_head", "re:.*visual"))),
    (CT_W4A16, dict(method="compressed-tensors", bits=4, group_size=128, has_zeros=False, act_order=False,
                    checkpoint_format="pack-quantized", ignore=("lm_head", "re:.*mlp.gate$"))),
    (_ct(num_bits=8, strategy="channel", group_size=None, symmetric=False),
     dict(bits=8, group_size=-1, has_zeros=True)),
    (_ct(actorder="group", group_size=32), dict(act_order=True, group_size=32)),
    (_ct(actorder="weight"), dict(act_order=False)),
], ids=["gptqmodel", "autogptq-file", "transformers-gptq", "gptq-v2", "gptqmodel-new-keys", "awq", "autoawq-file",
        "awq-sym-skip", "ct-w4a16", "ct-w8a16-channel", "ct-actorder-group", "ct-actorder-weight"])
def test_real_configs_parse(raw, want):
    cfg = parse_quantization_config(raw)
    assert isinstance(cfg, QuantizationConfig)
    for key, value in want.items():
        assert getattr(cfg, key) == value, key


@pytest.mark.parametrize("raw, field", [
    ({**GPTQMODEL, "quant_method": "bitsandbytes"}, "quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_scheme": "x"}, "'weight_scheme'"),
    ({**GPTQMODEL, "bits": 3}, "bits"),
    ({**GPTQMODEL, "group_size": 0}, "group_size"),
    ({**GPTQMODEL, "sym": "yes"}, "sym"),
    ({**GPTQMODEL, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({**GPTQMODEL, "lm_head": True}, "lm_head"),
    ({**GPTQMODEL, "dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ({**GPTQMODEL, "pack_dtype": "int16"}, "pack_dtype"),
    ({**GPTQMODEL, "is_marlin_format": True}, "is_marlin_format"),
    ({**GPTQMODEL, "wbits": 4}, "wbits"),
    ({**GPTQMODEL, "format": "gptq_v2"}, "format"),
    ({**AWQ, "bits": 8}, "bits"),
    ({**AWQ, "version": "gemv"}, "version"),
    ({**AWQ, "version": "exllama"}, "version"),
    ({**AWQ, "version": "marlin"}, "version"),
    ({**AWQ, "backend": "llm-awq"}, "backend"),
    ({**AWQ, "zero_point": 1}, "zero_point"),
    ({**AWQ, "w_bit": 8}, "w_bit"),
    ({**AWQ, "some_new_key": 1}, "some_new_key"),
    ({**CT_W4A16, "format": "int-quantized"}, "format"),
    ({**CT_W4A16, "format": "float-quantized"}, "group_0.format = 'pack-quantized'"),
    ({**CT_W4A16, "quantization_status": "initialized"}, "quantization_status"),
    ({**CT_W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "kv_cache_scheme.type"),
    ({**CT_W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": True}}, "kv_cache_scheme.dynamic"),
    ({**CT_W4A16, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel"}},
     "kv_cache_scheme.strategy"),
    ({**CT_W4A16, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    (_ct(num_bits=2), "num_bits"),
    (_ct(type="float"), "type"),
    (_ct(strategy="tensor"), "strategy"),
    (_ct(dynamic=True), "dynamic"),
    (_ct(actorder="group", strategy="channel", group_size=None), "actorder"),
    (_ct(mystery=1), "mystery"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_values_name_the_field(raw, field):
    """(llm-compressor's FP8 per-tensor KV scheme is accepted: test_fp8_kv_cache_scheme_is_accepted.)"""
    with pytest.raises(ValueError, match=field):
        parse_quantization_config(raw)


def test_activation_quantization_is_refused():
    raw = json.loads(json.dumps(CT_W4A16))
    raw["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True,
                                                            "strategy": "token", "dynamic": True}
    with pytest.raises(ValueError, match="input_activations.*W8A8"):
        parse_quantization_config(raw)


def test_config_groups_must_share_one_scheme():
    raw = json.loads(json.dumps(CT_W4A16))
    other = json.loads(json.dumps(raw["config_groups"]["group_0"]))
    raw["config_groups"]["group_1"] = other
    assert parse_quantization_config(raw).bits == 4  # identical schemes are one scheme
    other["weights"]["num_bits"] = 8
    with pytest.raises(ValueError, match="config_groups.group_1.weights"):
        parse_quantization_config(raw)


def test_config_without_quant_method_is_told_apart_by_its_keys(caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.quantization.config")
    gptq = {k: v for k, v in AUTOGPTQ.items() if k != "quant_method"}
    assert parse_quantization_config({**gptq, "_source": "quantize_config.json"}).method == "gptq"
    assert "quantize_config.json has no quant_method" in caplog.text
    assert parse_quantization_config(AUTOAWQ_FILE).method == "awq"
    with pytest.raises(ValueError, match="no quant_method"):
        parse_quantization_config({"bits": 4})


def test_find_prefers_config_json_then_side_files(tmp_path):
    assert find_quantization_config(str(tmp_path), {}) is None
    (tmp_path / "quant_config.json").write_text(json.dumps(AUTOAWQ_FILE))
    assert find_quantization_config(str(tmp_path), {})["_source"] == "quant_config.json"
    (tmp_path / "quantize_config.json").write_text(json.dumps(AUTOGPTQ))
    found = find_quantization_config(str(tmp_path), {})
    assert found["_source"] == "quantize_config.json" and found["desc_act"] is True
    found = find_quantization_config(str(tmp_path), {"quantization_config": AWQ})
    assert found["_source"] == "config.json" and found["quant_method"] == "awq"
    assert parse_quantization_config(found).source == "config.json"

    class HfConfig:  # a transformers config object carries it as an attribute
        quantization_config = GPTQMODEL

    assert find_quantization_config(str(tmp_path), HfConfig())["quant_method"] == "gptq"
    (tmp_path / "quantize_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        find_quantization_config(str(tmp_path), {})


def test_resolve_cli_spellings(caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.quantization.config")
    raw = {**GPTQMODEL, "_source": "config.json"}
    assert resolve_quantization(raw, None).method == "gptq"
    assert resolve_quantization(raw, "None").method == "gptq"
    assert resolve_quantization(raw, "none").method == "gptq"
    assert resolve_quantization(raw, "gptq").method == "gptq"
    assert not caplog.text
    assert resolve_quantization(raw, "gptq_marlin").method == "gptq"
    assert "gptq_marlin is vLLM's Marlin spelling of gptq" in caplog.text
    assert resolve_quantization(AWQ, "awq_marlin").method == "awq"
    assert resolve_quantization(CT_W4A16, "compressed-tensors").method == "compressed-tensors"
    assert resolve_quantization(None, None) is None
    assert resolve_quantization(None, "none") is None


@pytest.mark.parametrize("raw, cli, match", [
    (GPTQMODEL, "awq", "disagrees with the checkpoint, which is quantized with gptq"),
    (AWQ, "gptq_marlin", "disagrees"),
    (None, "awq", "no quantization config"),
    (GPTQMODEL, "fp8", "disagrees with the checkpoint, which is quantized with gptq"),
    (GPTQMODEL, "bitsandbytes", "not supported"),
])
def test_resolve_refusals(raw, cli, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(raw, cli)


def test_is_ignored():
    ct = parse_quantization_config(CT_W4A16)
    assert is_ignored(ct, "lm_head")
    assert is_ignored(ct, "model.layers.3.mlp.gate")
    assert not is_ignored(ct, "model.layers.3.mlp.gate_proj")
    assert not is_ignored(ct, "model.layers.3.mlp.experts.0.gate_proj")
    awq = parse_quantization_config({**AWQ, "modules_to_not_convert": ["visual", "mlp.gate"]})
    assert is_ignored(awq, "model.visual.blocks.0.attn")  # AWQ: substring match, as AutoAWQ
    assert is_ignored(awq, "model.layers.0.mlp.gate")
    assert not is_ignored(awq, "model.layers.0.self_attn.q_proj")
    assert not is_ignored(parse_quantization_config(GPTQMODEL), "lm_head")


def test_fp8_kv_cache_scheme_is_accepted(caplog):
    # llm-compressor's FP8 KV-cache scheme: static per-tensor k_scale / v_scale that --kv-cache-dtype fp8 uses.
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
          "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    with caplog.at_level("INFO"):
        cfg = parse_quantization_config({**CT_W4A16, "kv_cache_scheme": kv})
    assert cfg.method == "compressed-tensors" and cfg.bits == 4
    assert "--kv-cache-dtype fp8" in caplog.text
