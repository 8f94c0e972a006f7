"""ModelRunner on a tiny random Llama: chunked prefill + decodes == one full prefill, and HF logits."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_runner import BLOCK
from tiny_runner import make_tiny_runner as _runner

from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


def _new(req_id, prompt, blocks, params=None, computed=0):
    return NewRequestData(req_id, prompt, [], params or SamplingParams(temperature=0.0, logprobs=3), blocks, computed)


def _step(new=(), cached=(), sched=None, finished=()):
    c = CachedRequestData()
    for rid, blocks, nc in cached:
        c.req_ids.append(rid)
        c.new_block_ids.append(blocks)
        c.num_computed_tokens.append(nc)
    return SchedulerOutput(list(new), c, dict(sched), sum(sched.values()), set(finished))


PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]  # 11 tokens


def _greedy_run(chunks: list[int], num_decodes: int) -> tuple[list[int], list[list[float]]]:
    """Prompt fed in `chunks`, then decodes; returns sampled tokens and their logprob rows."""
    r = _runner()
    blocks = list(range(10, 20))  # enough for 40 tokens
    tokens, lps = [], []
    computed = 0
    for i, n in enumerate(chunks):
        so = _step(new=[_new("a", PROMPT, blocks)] if i == 0 else (),
                   cached=[] if i == 0 else [("a", [], computed)], sched={"a": n})
        out = r.execute_model(so)
        computed += n
        if computed < len(PROMPT):
            assert out.sampled_token_ids == [[]]  # partial chunk: no token
    tokens.append(out.sampled_token_ids[0][0])
    lps.append(out.logprobs.logprobs[0])
    for _ in range(num_decodes):
        out = r.execute_model(_step(cached=[("a", [], computed)], sched={"a": 1}))
        computed += 1
        tokens.append(out.sampled_token_ids[0][0])
        lps.append(out.logprobs.logprobs[0])
    return tokens, lps


def test_chunked_prefill_then_decodes_equals_full_prefill():
    full_tokens, full_lps = _greedy_run([11], 5)
    chunk_tokens, chunk_lps = _greedy_run([4, 5, 2], 5)
    assert chunk_tokens == full_tokens
    np.testing.assert_allclose(chunk_lps, full_lps, atol=1e-4)


def test_decode_logits_match_a_full_recompute():
    """The logprobs after decoding equal those of a fresh prefill of prompt + generated tokens."""
    tokens, lps = _greedy_run([11], 3)
    r = _runner()
    prompt = PROMPT + tokens[:3]
    out = r.execute_model(_step(new=[_new("b", prompt, list(range(4)))], sched={"b": len(prompt)}))
    assert out.sampled_token_ids == [[tokens[3]]]
    np.testing.assert_allclose(out.logprobs.logprobs[0], lps[3], atol=1e-4)


def test_mixed_batch_rows_are_independent():
    """Running two requests together (one prefill, one decode) gives each its solo result."""
    solo_a, _ = _greedy_run([11], 2)
    r = _runner()
    other = [7, 7, 8, 1, 2]
    r.execute_model(_step(new=[_new("a", PROMPT, list(range(6)))], sched={"a": 11}))
    out = r.execute_model(_step(new=[_new("b", other, list(range(6, 9)))], cached=[("a", [], 11)],
                                sched={"a": 1, "b": 5}))
    assert out.req_ids == ["a", "b"]
    assert out.sampled_token_ids[out.req_id_to_index["a"]] == [solo_a[1]]
    # finished requests leave the batch; the other keeps decoding
    out = r.execute_model(_step(cached=[("b", [], 5)], sched={"b": 1}, finished=["a"]))
    assert out.req_ids == ["b"] and r.input_batch.num_reqs == 1


def test_logprobs_rows_follow_each_request():
    r = _runner()
    out = r.execute_model(_step(new=[_new("a", PROMPT, list(range(4)), SamplingParams(temperature=0.0, logprobs=2)),
                                     _new("b", [1, 2, 3], [5], SamplingParams(temperature=0.0))],
                                sched={"a": 11, "b": 3}))
    ia, ib = out.req_id_to_index["a"], out.req_id_to_index["b"]
    lp = out.logprobs
    assert len(lp.logprob_token_ids[ia]) == 3 and lp.logprob_token_ids[ia][0] == out.sampled_token_ids[ia][0]
    assert lp.sampled_token_ranks[ia] == 1  # greedy
    assert lp.logprob_token_ids[ib] == [] and lp.logprobs[ib] == []


def test_kv_sizing_and_too_small_cache():
    r = _runner()
    assert r.spec.bytes_per_block == 2 * BLOCK * 2 * 8 * 4 * 2
    r.config.cache_config.num_gpu_blocks_override = None
    r.config.cache_config.kv_cache_memory_bytes = 10 * r.spec.bytes_per_block + 5
    assert r.determine_num_available_blocks() == 10
    with pytest.raises(ValueError, match="max-model-len 40"):
        r.initialize_kv_cache(10)  # 40 tokens < max_model_len 64


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH_SDPA", "TRITON_ATTN"])
def test_cuda_runner_matches_cpu_and_profiles_memory(backend):
    import torch

    cpu_tokens, _ = _greedy_run([4, 5, 2], 4)
    r = _runner(device="cuda", backend=backend)
    assert r.attn_backend.name == backend
    r.config.cache_config.num_gpu_blocks_override = None
    assert r.determine_num_available_blocks() > 1000  # profiled: most of the GPU is free for this tiny model
    blocks = list(range(10, 20))
    out = r.execute_model(_step(new=[_new("a", PROMPT, blocks)], sched={"a": 11}))
    tokens = [out.sampled_token_ids[0][0]]
    computed = 11
    for _ in range(4):
        out = r.execute_model(_step(cached=[("a", [], computed)], sched={"a": 1}))
        computed += 1
        tokens.append(out.sampled_token_ids[0][0])
    assert tokens == cpu_tokens
    assert r.kv_caches[0].device.type == "cuda" and torch.cuda.is_available()


def test_runner_matches_hf_transformers_logprobs():
    """Chunked prefill + decodes through the runner give HF's log-probabilities at each sampled position."""
    import torch
    from tiny_runner import tiny_llama_config
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(1)
    hf = HFLlama(tiny_llama_config()).eval()
    r = _runner()
    r.model.load_weights(hf.state_dict().items())
    params = SamplingParams(temperature=0.0, logprobs=4)
    out = r.execute_model(_step(new=[_new("a", PROMPT, list(range(6)), params)], sched={"a": 7}))
    assert out.sampled_token_ids == [[]]
    out = r.execute_model(_step(cached=[("a", [], 7)], sched={"a": 4}))
    tokens, rows = [out.sampled_token_ids[0][0]], [out.logprobs]
    for computed in range(11, 14):
        out = r.execute_model(_step(cached=[("a", [], computed)], sched={"a": 1}))
        tokens.append(out.sampled_token_ids[0][0])
        rows.append(out.logprobs)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT + tokens])).logits[0].float().log_softmax(-1)
    for j, lp in enumerate(rows):
        pos = len(PROMPT) - 1 + j
        assert tokens[j] == int(ref[pos].argmax())
        ids = lp.logprob_token_ids[0]
        np.testing.assert_allclose(lp.logprobs[0], ref[pos, ids].tolist(), atol=1e-4)
        assert ids[1:] == ref[pos].topk(4).indices.tolist()
