"""Quantized checkpoints through the whole engine on CPU vs transformers on the reference-dequantized weights.

Tiny random Llama, Qwen3 and Qwen3-MoE models are written in each format
the tools produce (`checkpoints.write_quantized_checkpoint`: AWQ, GPTQ with
act-order and 8-bit, compressed-tensors W4A16 g128 and W8A16 channel),
loaded by tokenmill (the loader converts, shards and dequantizes them) and
compared with transformers running the same model whose weights are the
reference libraries' dequantization of that checkpoint
(`reference_dequantized_state_dict`): prefill logits within float
tolerance, and the engine's greedy tokens equal up to near-ties (the rule
of tests/models/family_utils.py).

Act-order checkpoints share one permutation per input width
(`engine_parity.write_shared_act_order`), as GPTQ's do.
"""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import reference_dequantized_state_dict
from engine_parity import batch_prefill_logits, compare_greedy, hf_greedy, hf_logits, write_shared_act_order
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model

VARIANTS = {
    "awq-w4-g32": dict(method="awq", bits=4, group_size=32),
    "gptq-w4-g32-actorder": dict(method="gptq", bits=4, group_size=32, act_order=True, symmetric=False),
    "gptq-w8-channel": dict(method="gptq", bits=8, group_size=-1),
    "ct-w4a16-g128": dict(method="compressed-tensors", bits=4, group_size=128),
    "ct-w8a16-channel": dict(method="compressed-tensors", bits=8, group_size=-1),
}
MODELS = ("llama", "qwen3", "qwen3_moe")
# The engine's greedy run for one variant per model and every variant once (LLM start-up dominates).
GREEDY_CASES = [("llama", "awq-w4-g32"), ("qwen3", "gptq-w4-g32-actorder"), ("qwen3_moe", "ct-w4a16-g128"),
                ("llama", "gptq-w8-channel"), ("qwen3_moe", "ct-w8a16-channel"),
                ("qwen3_moe", "gptq-w4-g32-actorder")]
PROMPT_LENS = (29, 5, 17)
MAX_TOKENS = 16
# Logits of float32 models: the references multiply (q - z) * s in the scales' float16 (one rounding per
# weight) where tokenmill multiplies in float32, so the logits differ by ~1e-3 of their range (measured
# 6e-4 to 1e-3); with float32 scales both sides are exact and agree to ~1e-6 (test below).
LOGIT_TOL = 2e-3


@pytest.fixture(scope="session")
def dense_models(tiny_llama_dir, tiny_qwen3_dir, tiny_qwen3_moe_dir) -> dict[str, str]:
    """model kind -> folder of its tiny random dense HF checkpoint (conftest.py)."""
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "qwen3_moe": tiny_qwen3_moe_dir}


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, dense_models):
    """(model kind, variant) -> (quantized folder, transformers model on its reference-dequantized weights)."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str, str], tuple[str, torch.nn.Module]] = {}

    def get(kind: str, variant: str, **extra):
        if (kind, variant) not in cache:
            out = str(tmp_path_factory.mktemp(f"{kind}_{variant}"))
            write_shared_act_order(dense_models[kind], out, **VARIANTS[variant.removesuffix("+f32")], **extra)
            ref_dir = str(tmp_path_factory.mktemp(f"{kind}_{variant}_ref"))
            state = {k: v.float().contiguous() for k, v in reference_dequantized_state_dict(out).items()}
            save_file(state, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(dense_models[kind], "config.json")) as f:
                config_text = f.read()
            with open(os.path.join(ref_dir, "config.json"), "w") as f:
                f.write(config_text)
            hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
            cache[kind, variant] = out, hf
        return cache[kind, variant]

    return get


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", MODELS)
def test_prefill_logits_match_the_reference_dequantization(quantized, kind, variant):
    folder, hf = quantized(kind, variant)
    cfg = EngineArgs(model=folder, device="cpu", dtype="float32", skip_tokenizer_init=True).create_engine_config()
    assert cfg.model_config.quantization.method == VARIANTS[variant]["method"]
    model = get_model(cfg.model_config, "cpu", "float32")
    assert not any(getattr(m, "quant", None) for m in model.modules())  # dense after the CPU dequantization
    for prompt, ours in zip(_prompts(), batch_prefill_logits(model, _prompts())):
        ref = hf_logits(hf, prompt)
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert err <= LOGIT_TOL, f"{kind} {variant}: prompt of {len(prompt)} tokens, rel err {err:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)) or err < 1e-4


def test_float32_scales_give_float32_parity(quantized):
    """With float32 scales the references' products are exact too: the same logits up to summation order."""
    folder, hf = quantized("qwen3_moe", "gptq-w4-g32-actorder+f32", scale_dtype=torch.float32)
    cfg = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True).create_engine_config()
    model = get_model(cfg.model_config, "cpu", "float32")
    for prompt, ours in zip(_prompts(), batch_prefill_logits(model, _prompts())):
        ref = hf_logits(hf, prompt)
        assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-5


@pytest.mark.parametrize(("kind", "variant"), GREEDY_CASES)
def test_engine_greedy_matches_the_reference(quantized, kind, variant):
    folder, hf = quantized(kind, variant)
    llm = LLM(model=folder, dtype="float32", skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=64,
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, seed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(2)], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    compared = 0
    for prompt, out in zip(_prompts(2), outs):
        ref, ref_logits = hf_greedy(hf, prompt, MAX_TOKENS)
        ok, n, msg = compare_greedy(list(out.outputs[0].token_ids), ref, ref_logits)
        assert ok, f"{kind} {variant}, prompt of {len(prompt)} tokens: {msg}"
        compared += n
    assert compared >= 0.75 * MAX_TOKENS * len(PROMPT_LENS), f"{kind} {variant}: only {compared} tokens compared"
