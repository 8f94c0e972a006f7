"""The real bundled SmolLM2 (GGUF) through get_model vs transformers' model built from the same file."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model

pytestmark = pytest.mark.slow  # builds transformers' SmolLM2 from the GGUF (~30 s)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    cfg = EngineArgs(model=smollm2_gguf, device="cpu").create_engine_config()
    return get_model(cfg.model_config, "cpu", cfg.model_config.dtype)


def test_logits_match_transformers(smollm2, hf_smollm2, run_tokenmill_prompt):
    hf_model, tokenizer = hf_smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    token_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
        token_ids = token_ids["input_ids"]
    token_ids = list(token_ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([token_ids])).logits[0].float()
    logits = run_tokenmill_prompt(smollm2, token_ids)
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    # The greedy next token is the reference's, and it starts the known answer ("The capital ...").
    assert logits[-1].argmax().item() == ref[-1].argmax().item()
    assert tokenizer.decode([logits[-1].argmax().item()]).strip() == "The"
