"""int4/int8 checkpoints on CUDA: weights stay packed, layers run the quantized kernels, the engine agrees with the CPU.

Dummy quantized weights come from a config.json with a `quantization_config`
(the loader draws valid packed tensors); the engine comparison uses a real
GPTQ act-order checkpoint of the tiny Qwen3-MoE written by
tests/quantization/checkpoints.py, run in float32 on the GPU (quantized
kernels) and on the CPU (dequantized at load), greedy tokens equal up to near-ties.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quantized_folders import dummy_quantized_folder
from transformers import Qwen3MoeConfig

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.config import EngineArgs
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts
from tokenmill.layers.linear import LinearBase

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}


def _folder(tmp_path, quantization_config: dict) -> str:
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                            architectures=["Qwen3MoeForCausalLM"])
    return dummy_quantized_folder(tmp_path, config, quantization_config)


@pytest.mark.parametrize("quant", [GPTQ, AWQ], ids=["gptq-actorder", "awq"])
def test_layers_stay_packed_and_match_their_dequantization(tmp_path, quant):
    from tokenmill.model_loader import get_model

    cfg = EngineArgs(model=_folder(tmp_path, quant), load_format="dummy", skip_tokenizer_init=True,
                     device="cuda").create_engine_config()
    assert cfg.model_config.dtype == "float16"  # AWQ / GPTQ with --dtype auto on a GPU
    model = get_model(cfg.model_config, "cuda", "float16")
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and m.quant is not None]
    assert len(linears) == 2 * 2  # qkv, o per layer (the MLPs are MoE blocks; the routers stay 16-bit)
    g = torch.Generator(device="cuda").manual_seed(0)
    for layer in linears:
        assert layer.weight is None and layer.qweight.dtype == torch.int32 and layer.qweight.is_cuda
        dense = kernels.dequantize_weight(layer.quant_tensors(), torch.float32)
        for m in (1, 40, 2048):  # split-K, tiled, dequantize + cuBLAS
            x = torch.randn(m, layer.input_shard.size, device="cuda", generator=g).half()
            ref = F.linear(x.float(), dense)
            err = ((layer(x).float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 5e-3, f"M={m}: rel err {err:.2e}"
    moe = model.model.layers[0].mlp.experts
    assert moe.quant is not None and moe.w13_qweight.is_cuda
    w13, w2 = (kernels.dequantize_weight(moe.quant_tensors(p), torch.float32) for p in ("w13", "w2"))
    for m in (1, 64):
        x = torch.randn(m, 256, device="cuda", generator=g).half()
        logits = torch.randn(m, 8, device="cuda", generator=g)
        topk_w, topk_ids = select_experts(logits, moe.top_k, moe.renormalize)
        ref = fused_experts_reference(x.float(), w13, w2, topk_w, topk_ids)
        err = ((moe(x, logits).float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 5e-3, f"MoE M={m}: rel err {err:.2e}"


def test_memory_profile_runs_the_large_m_path(tmp_path, monkeypatch):
    """The KV budget's dummy step reaches every quantized layer at M = max_num_batched_tokens."""
    seen = []
    real = kernels.quant_linear

    def spy(x, w, bias=None):
        seen.append(x.shape[0])
        return real(x, w, bias)

    monkeypatch.setattr(kernels, "quant_linear", spy)
    llm = LLM(_folder(tmp_path, GPTQ), load_format="dummy", skip_tokenizer_init=True, max_model_len=256,
              max_num_batched_tokens=2048, gpu_memory_utilization=0.3, enforce_eager=True)
    try:
        assert seen[:4] == [2048] * 4  # the profile step: qkv and o of both layers, at the step's full size
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0.0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.shutdown()


def test_engine_on_gpu_matches_the_cpu(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quantization"))
    from checkpoints import save_tiny_hf_model
    from engine_parity import assert_greedy_match, write_shared_act_order

    dense = save_tiny_hf_model("qwen3_moe", str(tmp_path / "dense"))
    folder = write_shared_act_order(dense, str(tmp_path / "gptq"), method="gptq", bits=4, group_size=32,
                                    act_order=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 99, 42]} for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    results = {}
    for device in ("cpu", "cuda"):
        llm = LLM(folder, device=device, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                  kv_cache_memory_bytes="64M", seed=0)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
        results[device] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
    assert_greedy_match(results["cpu"], results["cuda"])
