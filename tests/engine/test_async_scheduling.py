"""Async scheduling (`--async-scheduling`): the same tokens as synchronous steps, and every KV block back.

On by default only on one CUDA device, but the engine runs it anywhere when
asked, so here, on a tiny random Llama on the CPU (dummy weights, token-id
prompts), the scheduler's output placeholders and the batch's on-device
fill of not-yet-read-back input ids are checked against the synchronous
engine: greedy and seeded sampling, logprobs, chunked prefill, preemption,
stop tokens (the one token computed past a stop is dropped), penalties
(steps turn synchronous), aborts.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

LENGTHS = [3, 17, 40, 64, 5, 33, 90, 12]


def _prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(10, 246, n).tolist()} for n in LENGTHS]


def _llm(folder: str, async_scheduling: bool, **kwargs) -> LLM:
    llm = LLM(folder, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=256, seed=0,
              kv_cache_memory_bytes="4M", async_scheduling=async_scheduling, **kwargs)
    assert llm.llm_engine.engine_core.scheduler.async_scheduling is async_scheduling
    return llm


class _OverlapCounter:
    """Counts steps launched while the previous step's results were still unread."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.llm_engine.engine_core
        self.overlapped = self.launched = 0
        inner = self.core.executor.execute_model_async

        def launch(scheduler_output):
            self.launched += 1
            self.overlapped += self.core._pending is not None
            return inner(scheduler_output)
        self.core.executor.execute_model_async = launch


def _run(llm: LLM, params) -> list[tuple[list[int], str, object]]:
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]


def _all_blocks_free(llm: LLM) -> bool:
    sched = llm.llm_engine.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    return not sched.requests and pool.get_num_free_blocks() == pool.num_blocks


def _greedy(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]


def test_greedy_equal_and_steps_overlap(tiny_dir):
    params = _greedy([1, 2, 7, 30, 16, 3, 25, 9])
    sync = _run(_llm(tiny_dir, False), params)
    llm = _llm(tiny_dir, True)
    counter = _OverlapCounter(llm)
    got = _run(llm, params)
    assert got == sync
    assert [len(t) for t, _, _ in got] == [1, 2, 7, 30, 16, 3, 25, 9]
    assert counter.overlapped > counter.launched // 2  # most steps launched ahead of the previous one's results
    assert _all_blocks_free(llm)
    # A second batch on the same engine (a stale step in flight from the first must not leak into it).
    assert _run(llm, params) == sync
    assert _all_blocks_free(llm)


def test_chunked_prefill_and_preemption_equal(tiny_dir):
    params = _greedy([40] * len(LENGTHS))
    kwargs = {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 20, "block_size": 16}
    sync = _run(_llm(tiny_dir, False, **kwargs), params)
    llm = _llm(tiny_dir, True, **kwargs)
    got = _run(llm, params)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_chunked_prefill_steps > 0 and stats.max_num_running_reqs > 1
    assert got == sync
    assert _all_blocks_free(llm)


def test_stop_tokens_and_lengths_equal(tiny_dir):
    """Each request stops on a token it generates (the async engine computes one more and drops it)."""
    free = _run(_llm(tiny_dir, False), _greedy([20] * len(LENGTHS)))
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[toks[i % 5 + 1]], detokenize=False)
              for i, (toks, _, _) in enumerate(free)]
    sync = _run(_llm(tiny_dir, False), params)
    assert any(reason == "stop" for _, reason, _ in sync)
    llm = _llm(tiny_dir, True)
    assert _run(llm, params) == sync
    assert _all_blocks_free(llm)


def test_seeded_sampling_and_logprobs_equal(tiny_dir):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True, logprobs=3,
                             detokenize=False) for i in range(len(LENGTHS))]
    sync = _run(_llm(tiny_dir, False), params)
    got = _run(_llm(tiny_dir, True), params)
    assert [t for t, _, _ in got] == [t for t, _, _ in sync]
    for (_, _, lp_a), (_, _, lp_b) in zip(got, sync):
        assert len(lp_a) == len(lp_b) == 12
        for a, b in zip(lp_a, lp_b):
            assert a.keys() == b.keys()
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-5 for k in a)


def test_penalties_turn_steps_synchronous(tiny_dir):
    params = _greedy([15] * len(LENGTHS))
    params[2] = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.5, detokenize=False)
    params[5] = SamplingParams(temperature=0.0, max_tokens=15, min_tokens=10, detokenize=False)
    sync = _run(_llm(tiny_dir, False), params)
    llm = _llm(tiny_dir, True)
    assert _run(llm, params) == sync
    assert llm.llm_engine.engine_core.scheduler.num_sync_requests == 0
    assert _all_blocks_free(llm)


def test_abort_with_a_step_in_flight(tiny_dir):
    llm = _llm(tiny_dir, True)
    engine = llm.llm_engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                                                           detokenize=False))
    for _ in range(6):
        engine.step()
    assert engine.engine_core._pending is not None  # a step is in flight
    engine.abort_request(["r1", "r4"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
    assert set(done) == {f"r{i}" for i in range(len(LENGTHS))} - {"r1", "r4"}
    assert all(n == 50 for n in done.values())
    assert _all_blocks_free(llm)


def test_shutdown_releases_the_model_runner(tiny_dir):
    """A step left in flight (the last one of a generate) must not keep the runner and its KV cache alive."""
    import gc
    import weakref

    llm = _llm(tiny_dir, True)
    _run(llm, _greedy([5] * len(LENGTHS)))
    core = llm.llm_engine.engine_core
    runner = weakref.ref(core.executor.worker.model_runner)
    llm.llm_engine.shutdown()
    del llm, core
    gc.collect()
    assert runner() is None


def test_shutdown_frees_the_weights_and_kv_cache_even_if_the_runner_is_referenced(tiny_dir):
    llm = _llm(tiny_dir, True)
    _run(llm, _greedy([3] * len(LENGTHS)))
    runner = llm.llm_engine.engine_core.executor.worker.model_runner  # a reference kept past shutdown
    assert runner.kv_caches and runner.model is not None
    llm.llm_engine.shutdown()
    assert runner.kv_caches == [] and runner.model is None and runner.cuda_graphs is None


def _reuse_run(llm: LLM, abort: bool, stop_token: int) -> list[list[int]]:
    """Request "R" ends (on a stop token, or aborted) with a step in flight, then a new "R" with another prompt."""
    engine = llm.llm_engine
    p1, p2 = _prompts()[1], _prompts()[3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    first = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token], detokenize=False)
    got = []
    engine.add_request("R", p1, params if abort else first)
    steps = 0
    while engine.has_unfinished_requests() and steps < 3:
        engine.step()
        steps += 1
    engine.abort_request(["R"]) if abort else None
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("R", p2, params)  # the old R may still be in the step in flight
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got.append(list(out.outputs[0].token_ids))
    engine.add_request("fresh", p2, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got.append(list(out.outputs[0].token_ids))
    return got


@pytest.mark.parametrize("abort", [False, True], ids=["finished", "aborted"])
def test_reused_request_id_gets_only_its_own_tokens(tiny_dir, abort):
    probe = _llm(tiny_dir, False).generate(_prompts()[1], _greedy([8])[0], use_tqdm=False)[0]
    stop_token = probe.outputs[0].token_ids[4]
    sync = _reuse_run(_llm(tiny_dir, False), abort, stop_token)
    llm = _llm(tiny_dir, True)
    got = _reuse_run(llm, abort, stop_token)
    assert got == sync
    assert got[0] == got[1]  # the reused id generates what a fresh id does for the same prompt
    assert _all_blocks_free(llm)


@pytest.mark.parametrize(("kwargs", "sync"), [
    ({}, False),
    ({"logprobs": 2, "seed": 3, "temperature": 0.7}, False),
    ({"repetition_penalty": 1.1}, True),
    ({"presence_penalty": 0.5}, True),
    ({"frequency_penalty": 0.5}, True),
    ({"min_tokens": 4}, True),
    ({"structured_outputs": StructuredOutputsParams(choice=["a", "b"])}, True),
])
def test_which_requests_need_synchronous_steps(kwargs, sync):
    from tokenmill.core.request import Request
    from tokenmill.engine.messages import EngineCoreRequest

    req = Request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=5, **kwargs)), max_tokens=5)
    assert req.needs_sync is sync
