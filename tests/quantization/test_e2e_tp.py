"""Quantized checkpoints at tensor_parallel_size=2 (CPU, gloo) give the single-process run's greedy tokens.

The row-parallel shards are the interesting part: GPTQ act-order keeps all
groups on each rank and slices g_idx; compressed-tensors g128 on the tiny
Llama splits o_proj's 128 inputs at row 64, inside its only group (rank 1
gets a synthesized g_idx), and down_proj's 256 at a group boundary.
compressed-tensors FP8_DYNAMIC on the tiny Qwen3-MoE splits per-channel FP8 scales with the rows
(q/k/v, gate/up, the experts) and keeps them whole for the row-parallel layers.
"""

from __future__ import annotations

import pytest
from engine_parity import assert_greedy_match, write_shared_act_order
from fp8_checkpoints import write_fp8_checkpoint

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow  # two engines per case, one of them with 2 worker processes: ~20 s each

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 99, 42, 7 * i]} for i in range(4)]
CASES = {
    "qwen3_moe-gptq-w4-g32-actorder": ("qwen3_moe", dict(method="gptq", bits=4, group_size=32, act_order=True)),
    "llama-ct-w4a16-g128": ("llama", dict(method="compressed-tensors", bits=4, group_size=128)),
}


def _generate(folder: str, **kw):
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory_bytes="16M",
              max_num_seqs=4, seed=0, **kw)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(request, tmp_path, case):
    kind, variant = CASES[case]
    dense = request.getfixturevalue(f"tiny_{kind}_dir")  # conftest.py's session-wide dense models
    folder = write_shared_act_order(dense, str(tmp_path / "quantized"), **variant)
    ref = _generate(folder)
    got = _generate(folder, tensor_parallel_size=2)
    assert_greedy_match(ref, got)
    assert all(len(ids) == PARAMS.max_tokens for ids, _ in got)


def test_fp8_tp2_matches_tp1(tiny_qwen3_moe_dir, tmp_path):
    folder = write_fp8_checkpoint(tiny_qwen3_moe_dir, str(tmp_path / "fp8"), "ct-fp8-dynamic")
    ref = _generate(folder)
    got = _generate(folder, tensor_parallel_size=2)
    assert_greedy_match(ref, got)
    assert all(len(ids) == PARAMS.max_tokens for ids, _ in got)
