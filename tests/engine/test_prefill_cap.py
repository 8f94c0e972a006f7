"""`max_prefill_tokens_with_decodes` end to end: the same greedy tokens with the cap on and off.

A tiny random Llama on the CPU (dummy weights, token-id prompts): the cap only
moves prefill tokens to later steps, so every request's tokens must be
unchanged, while the scheduler's outputs show it did cap steps that carried
decodes (and that without it those steps took more).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tokenmill import LLM, SamplingParams

LENGTHS = [3, 17, 40, 64, 5, 33, 90, 12, 70, 8]
CAP = 8


def _llm(folder: str, cap: int, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(folder, load_format="dummy", skip_tokenizer_init=True, dtype="float32", seed=0,
              kv_cache_memory_bytes="4M", max_num_batched_tokens=64, max_prefill_tokens_with_decodes=cap, **kwargs)
    assert llm.llm_engine.engine_core.scheduler.prefill_cap_with_decodes == cap
    return llm


def _record_prefills(llm: LLM) -> list[tuple[bool, int]]:
    """Per step: (it started with a running decode, its prefill tokens), filled as the engine schedules."""
    sched = llm.llm_engine.engine_core.scheduler
    steps: list[tuple[bool, int]] = []
    inner = sched.schedule

    def schedule():
        left = {r.request_id: len(r.all_token_ids) + r.num_output_placeholders - r.num_computed_tokens
                for r in sched.running}
        out = inner()
        prefill = sum(n for rid, n in out.num_scheduled_tokens.items() if left.get(rid, 2) > 1)
        steps.append((1 in left.values(), prefill))
        return out

    sched.schedule = schedule
    return steps


def _run(llm: LLM) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, 246, n).tolist()} for n in LENGTHS]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in (5, 30, 12, 3, 25, 9, 17, 40, 6, 21)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _all_blocks_free(llm: LLM) -> bool:
    sched = llm.llm_engine.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    return not sched.requests and pool.get_num_free_blocks() == pool.num_blocks


@pytest.mark.parametrize("kwargs", [{}, {"num_gpu_blocks_override": 10, "block_size": 16, "max_model_len": 160},
                                    {"async_scheduling": True}], ids=["plain", "preemption", "async"])
def test_same_greedy_tokens_with_the_cap_on_and_off(tiny_dir, kwargs):
    off = _llm(tiny_dir, 0, **kwargs)
    off_steps = _record_prefills(off)
    want = _run(off)
    on = _llm(tiny_dir, CAP, **kwargs)
    on_steps = _record_prefills(on)
    assert _run(on) == want
    assert [len(t) for t in want] == [5, 30, 12, 3, 25, 9, 17, 40, 6, 21]
    assert any(d and p > CAP for d, p in off_steps)  # without the cap, steps beside decodes take more
    assert all(p <= CAP for d, p in on_steps if d) and any(d and p == CAP for d, p in on_steps)
    assert on_steps[0] == (False, 64)  # the first step has no decode: the whole budget
    if "num_gpu_blocks_override" in kwargs:
        assert on.llm_engine.get_stats().num_preemptions > 0
    assert _all_blocks_free(on) and _all_blocks_free(off)
