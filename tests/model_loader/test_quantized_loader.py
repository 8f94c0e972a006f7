"""The loader's side of int4/int8 checkpoints: which layers it quantizes, dummy quantized weights, the flags.

Checkpoint-made end-to-end parity lives in tests/quantization/test_e2e_*.py;
these tests use names and configs only (no checkpoint tensors), tiny models.
"""

from __future__ import annotations

import logging

import pytest
import torch
from quantized_folders import dummy_quantized_folder
from transformers import LlamaConfig, Qwen3MoeConfig

from tokenmill.config import EngineArgs
from tokenmill.layers.quant_params import QuantScheme
from tokenmill.model_loader.quantized import dequantize_layers, quantize_layers, weight_bytes
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.quantization import parse_quantization_config

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _moe_config(**kw) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                          architectures=["Qwen3MoeForCausalLM"], **kw)


def _llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       architectures=["LlamaForCausalLM"], **kw)


def _checkpoint_modules(num_layers: int, num_experts: int = 0) -> set[str]:
    names = set()
    for i in range(num_layers):
        names |= {f"model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"}
        if num_experts:
            names |= {f"model.layers.{i}.mlp.experts.{e}.{p}_proj" for e in range(num_experts)
                      for p in ("gate", "up", "down")}
        else:
            names |= {f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")}
    return names


def test_walk_quantizes_fused_layers_and_experts():
    model = Qwen3MoeForCausalLM(_moe_config())
    count = quantize_layers(model, parse_quantization_config(GPTQ), _checkpoint_modules(2, num_experts=4))
    assert count == 2 * 3  # qkv, o, experts per layer
    params = dict(model.named_parameters())
    assert "model.layers.0.self_attn.qkv_proj.qweight" in params
    assert "model.layers.0.self_attn.qkv_proj.weight" not in params
    assert params["model.layers.1.mlp.experts.w13_qweight"].shape == (4, 64, 64 // 8)
    assert params["model.layers.1.mlp.experts.w2_g_idx"].shape == (4, 32)
    assert "model.layers.0.mlp.gate.weight" in params  # the router stays 16-bit


def test_walk_refuses_a_partly_quantized_fused_layer():
    model = LlamaForCausalLM(_llama_config())
    names = _checkpoint_modules(2) - {"model.layers.1.self_attn.v_proj"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj.*all quantized or all not"):
        quantize_layers(model, parse_quantization_config(GPTQ), names)
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(model.named_parameters())  # nothing changed yet


def test_walk_refuses_some_experts_quantized():
    model = Qwen3MoeForCausalLM(_moe_config())
    names = _checkpoint_modules(2, num_experts=4) - {"model.layers.0.mlp.experts.2.down_proj"}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts .*all quantized or all not"):
        quantize_layers(model, parse_quantization_config(GPTQ), names)


def test_walk_refuses_a_quantized_lm_head():
    model = LlamaForCausalLM(_llama_config())
    with pytest.raises(ValueError, match="quantizes lm_head.*ParallelLMHead"):
        quantize_layers(model, parse_quantization_config(GPTQ), _checkpoint_modules(2) | {"lm_head"})


@pytest.mark.parametrize("quant", [GPTQ, AWQ], ids=["gptq-actorder", "awq"])
def test_dummy_load_with_a_quantization_config(tmp_path, caplog, quant):
    from tokenmill.model_loader import get_model

    folder = dummy_quantized_folder(tmp_path, _moe_config(), quant)
    cfg = EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True).create_engine_config()
    assert cfg.model_config.quantization.method == quant["quant_method"]
    with caplog.at_level(logging.INFO, logger="tokenmill.model_loader.loader"):
        model = get_model(cfg.model_config, "cpu", "float32")
    lines = [r.getMessage() for r in caplog.records]
    assert any("weights" in line and f"{quant['quant_method']} int4 g32" in line for line in lines), lines
    assert any(line.startswith("Dequantized 6 int4 layers") for line in lines), lines
    w = model.model.layers[0].self_attn.qkv_proj.weight  # dense again on the CPU, of a plausible spread
    assert w.dtype == torch.float32 and w.shape == (128, 64) and 0.005 < w.std().item() < 0.05
    experts = model.model.layers[1].mlp.experts
    assert experts.quant is None and experts.w13_weight.shape == (4, 64, 64)


def test_weight_bytes_count_the_packed_tensors():
    model = LlamaForCausalLM(_llama_config())
    dense_total, _ = weight_bytes(model)
    quantize_layers(model, parse_quantization_config(AWQ), None)
    total, quantized = weight_bytes(model)
    linear_dense = sum(p.numel() * 4 for n, p in LlamaForCausalLM(_llama_config()).named_parameters()
                       if n.endswith("proj.weight"))
    # int4 codes (1/8 of float32) + float32 scales and uint8 zeros per 32 inputs
    assert quantized == linear_dense // 8 + linear_dense // 4 // 32 * 5
    assert total == dense_total - linear_dense + quantized
    assert dequantize_layers(model) == 2 * 4  # qkv, o, gate_up, down
    assert weight_bytes(model) == (dense_total, 0)


class _FakeGpu:
    device_type = "cuda"

    def __init__(self, capability: tuple[int, int]):
        self.capability = capability

    def default_dtype(self):
        return torch.bfloat16 if self.capability >= (8, 0) else torch.float16

    def default_dtype_reason(self):
        return "fake GPU"

    def supported_dtypes(self):
        return [torch.bfloat16, torch.float16, torch.float32]

    def get_device_name(self):
        return "fake GPU"

    def get_device_capability(self):
        return self.capability


def test_dtype_auto_follows_vllm_for_awq_and_gptq():
    from tokenmill.config.resolve import _resolve_dtype
    from tokenmill.platforms.cpu import CpuPlatform

    gpu = _FakeGpu((9, 0))
    for raw in (AWQ, GPTQ):
        assert _resolve_dtype("auto", gpu, "LlamaForCausalLM", parse_quantization_config(raw)) == torch.float16
        assert _resolve_dtype("bfloat16", gpu, "LlamaForCausalLM", parse_quantization_config(raw)) == torch.bfloat16
        assert _resolve_dtype("auto", CpuPlatform(), "LlamaForCausalLM",
                              parse_quantization_config(raw)) == torch.float32
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
    assert _resolve_dtype("auto", gpu, "LlamaForCausalLM", parse_quantization_config(ct)) == torch.bfloat16


def test_start_up_refuses_a_gpu_the_kernels_cannot_run(tmp_path):
    from tokenmill.config.resolve import _resolve_quantization
    from tokenmill.model_loader.source import ModelSource

    folder = dummy_quantized_folder(tmp_path, _llama_config(), GPTQ)
    args = EngineArgs(model=folder)
    hf_config = _llama_config()
    hf_config.quantization_config = GPTQ
    with pytest.raises(ValueError, match=r"gptq.*compute capability 6\.1"):
        _resolve_quantization(args, ModelSource(path=folder), hf_config, _FakeGpu((6, 1)))
    assert _resolve_quantization(args, ModelSource(path=folder), hf_config, _FakeGpu((7, 0))).method == "gptq"


def test_quantization_flag_must_agree_with_the_checkpoint(tmp_path):
    folder = dummy_quantized_folder(tmp_path, _llama_config(), GPTQ)
    with pytest.raises(ValueError, match="awq"):
        EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True,
                   quantization="awq").create_engine_config()
    cfg = EngineArgs(model=folder, load_format="dummy", skip_tokenizer_init=True,
                     quantization="gptq_marlin").create_engine_config()
    assert cfg.model_config.quantization.method == "gptq"


def test_unquantized_checkpoint_has_no_quantization(tiny_dir):
    cfg = EngineArgs(model=tiny_dir, load_format="dummy", skip_tokenizer_init=True).create_engine_config()
    assert cfg.model_config.quantization is None


@pytest.mark.parametrize("method", ["awq", "gptq_marlin", "compressed-tensors"])
def test_dummy_weights_quantized_from_the_flag_alone(tmp_path, method):
    from tokenmill.model_loader import get_model

    _llama_config().save_pretrained(tmp_path)
    cfg = EngineArgs(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                     quantization=method).create_engine_config()
    q = cfg.model_config.quantization
    assert (q.method, q.bits, q.group_size) == (method.removesuffix("_marlin"), 4, 128)
    model = get_model(cfg.model_config, "cpu", "float32")
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 128)
    with pytest.raises(ValueError, match="no quantization config"):  # a real checkpoint is never quantized at load
        EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, quantization=method).create_engine_config()
