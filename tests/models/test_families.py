"""Qwen2, Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 3 vs transformers on tiny random configs.

Each config is built with transformers, saved as safetensors, loaded by
tokenmill's loader. Checks, in float32:
- logits of a mixed-length batch (one paged prefill step through TORCH_SDPA)
  match HF's per-prompt logits to max|diff| / max|ref| <= 1e-4;
- 32 greedy tokens through the full engine (`tokenmill.LLM`) with chunked
  prefill and preemption forced (asserted through the scheduler counters)
  equal HF's greedy tokens, a divergence allowed only at an HF near tie
  (top-2 logits within 1e-3), where that prompt's comparison stops.
Sliding-window configs use windows of 4 to 16 tokens and prompts several
windows long; weights use a larger init std so near ties are rare.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from family_utils import batch_prefill_logits, compare_greedy, hf_greedy, hf_logits
from torch_threads import one_torch_thread

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model

VOCAB = 160
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.15,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
GEMMA_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}

# id -> (HF config class, HF model class, overrides)
CASES = {
    "qwen2-swa": ("Qwen2Config", "Qwen2ForCausalLM",
                  dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=True)),
    "qwen3-swa-bias": ("Qwen3Config", "Qwen3ForCausalLM",
                       dict(head_dim=24, attention_bias=True, use_sliding_window=True, sliding_window=6,
                            max_window_layers=2)),
    "qwen3moe-renorm": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                             mlp_only_layers=[0], decoder_sparse_step=1, head_dim=16)),
    "qwen3moe-norenorm-swa": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                              dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24,
                                   norm_topk_prob=False, decoder_sparse_step=2, use_sliding_window=True,
                                   sliding_window=16, head_dim=16)),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "mixtral-swa": ("MixtralConfig", "MixtralForCausalLM",
                    dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=12)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=7,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    rope_parameters=GEMMA_ROPE, hidden_activation="gelu_pytorch_tanh")),
    "gemma3-softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                       dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                            sliding_window_pattern=2, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                            tie_word_embeddings=False)),
}
PROMPT_LENS = [37, 5, 23, 50]
MAX_TOKENS = 32
# HF 5.x renames past_key_values -> cache for some models; the old name still works.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: intra-op threads cost more than they save (and 2 cores are shared)."""
    with one_torch_thread():
        yield


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _save_tiny(case: str, folder: str):
    config_cls, model_cls, overrides = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))  # non-trivial norms and biases, so their loading matters
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, folder, _save_tiny(request.param, folder)


def test_batch_prefill_logits_match_transformers(family):
    case, folder, hf = family
    cfg = EngineArgs(model=folder, device="cpu", dtype="float32").create_engine_config()
    assert cfg.model_config.architecture == CASES[case][1]
    model = get_model(cfg.model_config, "cpu", "float32")
    prompts = _prompts(1)
    for prompt, ours in zip(prompts, batch_prefill_logits(model, prompts)):
        ref = hf_logits(hf, prompt)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-4, f"{case}: prompt of {len(prompt)} tokens, rel err {err:.2e}"


def test_engine_greedy_matches_transformers(family):
    case, folder, hf = family
    prompts = _prompts(2)
    # 4 prompts need up to 4 * ceil(82 / 4) = 84 blocks together; 32 blocks force preemptions.
    llm = LLM(model=folder, dtype="float32", skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=32,
              max_num_batched_tokens=16, max_num_seqs=4, max_model_len=96, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_chunked_prefill_steps > 0
    assert stats.num_preemptions > 0
    compared = 0
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, prompt, MAX_TOKENS)
        ok, n, msg = compare_greedy(list(out.outputs[0].token_ids), ref, ref_logits)
        assert ok, f"{case}, prompt of {len(prompt)} tokens: {msg}"
        compared += n
    # The near-tie escape must stay rare, or the test would prove nothing.
    assert compared >= 0.75 * MAX_TOKENS * len(prompts), f"{case}: only {compared} tokens compared"


class _FakeGpu:
    """A platform whose `auto` dtype is float16 (as a GPU of compute capability < 8.0)."""

    device_type = "cuda"

    def __init__(self, bf16: bool):
        self.bf16 = bf16

    def default_dtype(self):
        return torch.float16

    def default_dtype_reason(self):
        return "float16 (fake GPU)"

    def supported_dtypes(self):
        return [torch.bfloat16, torch.float16, torch.float32] if self.bf16 else [torch.float16, torch.float32]

    def get_device_name(self):
        return "fake GPU"

    def get_device_capability(self):
        return (8, 0) if self.bf16 else (7, 0)


def test_fp16_unsafe_models_avoid_auto_float16(caplog):
    from tokenmill.config.resolve import _resolve_dtype

    caplog.set_level(logging.INFO, logger="tokenmill.config.resolve")
    assert _resolve_dtype("auto", _FakeGpu(bf16=True), "Gemma3ForCausalLM") == torch.bfloat16
    assert _resolve_dtype("auto", _FakeGpu(bf16=False), "Gemma3ForCausalLM") == torch.float32
    assert "overflows in float16" in caplog.text
    # Models without the mark keep the device default.
    assert _resolve_dtype("auto", _FakeGpu(bf16=False), "Qwen2ForCausalLM") == torch.float16
    caplog.clear()
    assert _resolve_dtype("float16", _FakeGpu(bf16=False), "Gemma3ForCausalLM") == torch.float16
    assert any(r.levelname == "WARNING" and "overflow" in r.message for r in caplog.records)
    caplog.clear()
    _resolve_dtype("float16", _FakeGpu(bf16=False), "MistralForCausalLM")
    assert not any(r.levelname == "WARNING" for r in caplog.records)


def test_unsupported_architecture_lists_supported_ones():
    from tokenmill.models.registry import resolve_model_cls

    with pytest.raises(ValueError, match="Gemma3ForCausalLM.*Qwen3MoeForCausalLM|Qwen3MoeForCausalLM") as e:
        resolve_model_cls(["BertModel"])
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM"):
        assert arch in str(e.value)
