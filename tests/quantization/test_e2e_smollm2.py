"""The real SmolLM2-135M weights quantized by each format's writer, through tokenmill on CPU vs transformers.

The dense weights are transformers' own float32 reading of the bundled GGUF
(`hf_smollm2`), saved as an HF folder; K = 576 is not a multiple of 128, so
the g128 variant also covers a last partial group. transformers runs the
model with the weights the reference libraries dequantize from the same
checkpoint. To keep the CPU suite short, the writers quantize the first
QUANTIZED_LAYERS of the 30 layers and list the rest as left unquantized
(each tool's ignore list), so the loader also sees a mixed checkpoint.
"""

from __future__ import annotations

import gc
import json
import logging
import os

import pytest
import torch
from checkpoints import reference_dequantized_state_dict
from engine_parity import batch_prefill_logits, compare_greedy, hf_greedy, hf_logits, write_shared_act_order
from safetensors.torch import save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineArgs
from tokenmill.model_loader import get_model

pytestmark = pytest.mark.slow  # 135M parameters quantized, loaded and run per variant: ~15 s each on 2 cores

VARIANTS = {
    "awq-w4-g64": dict(method="awq", bits=4, group_size=64),  # AWQ needs K % G == 0: 576 = 9 x 64
    "gptq-w4-g128-actorder": dict(method="gptq", bits=4, group_size=128, act_order=True),
    "ct-w8a16-channel": dict(method="compressed-tensors", bits=8, group_size=-1),
}
TEXT = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined"
# float16 products in the references (see test_e2e_parity.py).
LOGIT_TOL = 5e-3
QUANTIZED_LAYERS = 6
_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")
SKIPPED = tuple(f"model.layers.{i}.{p}" for i in range(QUANTIZED_LAYERS, 30) for p in _PROJ)


@pytest.fixture(scope="module")
def smollm2_dense(hf_smollm2, tmp_path_factory) -> tuple[str, list[int]]:
    """(HF folder of SmolLM2's float32 weights, the prompt's token ids)."""
    model, tokenizer = hf_smollm2
    folder = str(tmp_path_factory.mktemp("smollm2_dense"))
    # save_pretrained refuses a model read from GGUF: write its tensors and config by hand.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder, tokenizer.encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def hf_dense(smollm2_dense):
    """One transformers SmolLM2 (float32) whose weights each test replaces by its checkpoint's reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dense[0], dtype=torch.float32).eval()


def _reference_model(hf: torch.nn.Module, folder: str) -> torch.nn.Module:
    state = {k: v.float() for k, v in reference_dequantized_state_dict(folder).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)  # the head is tied to the embedding
    return hf


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_smollm2_logits_and_greedy_tokens(smollm2_dense, hf_dense, tmp_path, caplog, variant):
    dense, prompt = smollm2_dense
    folder = write_shared_act_order(dense, str(tmp_path / variant), skip_modules=SKIPPED, **VARIANTS[variant])
    hf = _reference_model(hf_dense, folder)
    cfg = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True).create_engine_config()
    with caplog.at_level(logging.INFO, logger="tokenmill.model_loader.loader"):
        model = get_model(cfg.model_config, "cpu", "float32")
    bits = VARIANTS[variant]["bits"]
    assert f"Dequantized {QUANTIZED_LAYERS * 4} int{bits} layers" in caplog.text  # qkv, o, gate_up, down
    ours, ref = batch_prefill_logits(model, [prompt])[0], hf_logits(hf, prompt)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= LOGIT_TOL, f"{variant}: rel err {err:.2e}"
    del model
    gc.collect()
    if variant != "gptq-w4-g128-actorder":  # one engine run covers the serving path; logits cover the rest
        return
    llm = LLM(model=folder, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory_bytes="32M", seed=0)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=16,
                                                                          ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    ref_tokens, ref_logits = hf_greedy(hf, prompt, 16)
    ok, n, msg = compare_greedy(list(out[0].outputs[0].token_ids), ref_tokens, ref_logits)
    assert ok and n >= 8, msg
    assert os.path.isfile(os.path.join(folder, "config.json"))
