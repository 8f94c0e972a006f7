"""Scheduler: budget, order, chunked prefill, preemption, stop rules, aborts.

Driven by a fake model runner (conftest.fake_runner_output) that samples a
fixed token for each request whose scheduled span reaches its last token.
"""

from __future__ import annotations

import random

import pytest

from tokenmill.core.request import RequestStatus
from tokenmill.engine.messages import FinishReason


def all_blocks_free(sched) -> bool:
    pool = sched.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_decodes_first_then_prefills_within_budget(make_scheduler, make_request, step):
    s = make_scheduler(max_num_batched_tokens=32)
    s.add_request(make_request("a", 20, start=100))
    s.add_request(make_request("b", 20, start=200))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20, "b": 12}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    s.add_request(make_request("c", 30, start=300))
    out, _ = step(s)
    # a's decode and b's last chunk come before c's new prefill takes the rest.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 8), ("c", 23)]
    assert out.total_num_scheduled_tokens == 32
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [20, 12]


def test_chunked_prefill_over_several_steps(make_scheduler, make_request, step):
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", 40))
    out1, res1 = step(s)
    assert out1.num_scheduled_tokens == {"a": 16}
    assert out1.scheduled_new_reqs[0].block_ids == [0] and out1.scheduled_new_reqs[0].num_computed_tokens == 0
    assert res1.outputs == []  # no token from a partial chunk
    out2, res2 = step(s)
    assert out2.scheduled_cached_reqs.num_computed_tokens == [16]
    assert out2.scheduled_cached_reqs.new_block_ids == [[1]]
    assert res2.outputs == []
    out3, res3 = step(s)
    assert out3.num_scheduled_tokens == {"a": 8}
    assert out3.scheduled_cached_reqs.new_block_ids == [[2]]
    assert [o.new_token_ids for o in res3.outputs] == [[7]]
    stats = res3.scheduler_stats
    assert stats.num_chunked_prefill_steps == 2 and stats.num_steps == 3


def test_long_prefill_token_threshold_caps_each_prompts_chunk(make_scheduler, make_request, step):
    """--long-prefill-token-threshold 16: a prompt takes at most 16 tokens a step, so a second prompt and a
    running decode share the step's budget instead of the first prompt taking all of it."""
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    s.add_request(make_request("a", 40, start=100))
    s.add_request(make_request("b", 10, start=200))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 16, "b": 10}
    s.add_request(make_request("c", 50, start=300))
    out, _ = step(s)
    # a continues at 16, b decodes one token, c starts at 16: 33 of 64, the rest left for other requests.
    assert out.num_scheduled_tokens == {"a": 16, "b": 1, "c": 16}
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 8, "b": 1, "c": 16}
    assert {o.request_id for o in res.outputs} == {"a", "b"}  # a's last chunk samples
    off = make_scheduler(max_num_batched_tokens=64)
    off.add_request(make_request("a", 40, start=100))
    off.add_request(make_request("b", 10, start=200))
    assert step(off)[0].num_scheduled_tokens == {"a": 40, "b": 10}  # 0 = off: the budget alone


def test_chunked_prefill_disabled_prompt_waits_for_budget(make_scheduler, make_request, step):
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(make_request("a", 40, start=100, max_model_len=64))
    s.add_request(make_request("b", 30, start=200, max_model_len=64))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 40}  # b (30) does not fit in 24
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 30}
    assert s.make_stats().num_chunked_prefill_steps == 0


def test_max_num_seqs(make_scheduler, make_request, step):
    s = make_scheduler(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 10, start=100 * i, max_tokens=2))
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    out, res = step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert {o.request_id for o in res.outputs if o.finish_reason == FinishReason.LENGTH} == {"a", "b"}
    out, _ = step(s)
    assert set(out.num_scheduled_tokens) == {"c"}
    assert out.finished_req_ids == {"a", "b"}
    assert s.make_stats().max_num_running_reqs == 2


def test_fcfs_preempts_newest_and_resumes_from_prefix_hit(make_scheduler, make_request, step):
    s = make_scheduler(num_blocks=4)
    s.add_request(make_request("a", 30, start=100, max_tokens=5))
    s.add_request(make_request("b", 30, start=200, max_tokens=20))
    out, _ = step(s)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[0, 1], [2, 3]]
    step(s)
    step(s)
    # Step 4: a's token at position 32 needs a third block; none is free.
    out, _ = step(s)
    b = s.requests["b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.finished_req_ids == {"b"}
    assert out.scheduled_cached_reqs.new_block_ids == [[3]]  # b's tail block went first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.make_stats().num_preemptions == 1
    assert list(s.waiting) == [b]
    # Step 5: b cannot come back yet (needs 2 fresh blocks, only its cached one is free).
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    assert res.outputs[0].finish_reason == FinishReason.LENGTH
    # Step 6: b resumes as a new request, its first block a prefix hit.
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 16
    assert new.output_token_ids == [7, 7, 7]
    assert new.block_ids == [2, 3, 1]
    assert out.num_scheduled_tokens == {"b": 17}  # prompt 30 + 3 outputs - 16 cached
    assert b.num_cached_tokens == 0  # recorded at first schedule only


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_by_policy(policy, make_scheduler, make_request, step):
    s = make_scheduler(num_blocks=4, policy=policy)
    s.add_request(make_request("a", 20, start=100, priority=1, arrival_time=0.0, max_tokens=50))
    step(s)
    s.add_request(make_request("b", 31, start=200, priority=0, arrival_time=1.0, max_tokens=50))
    out, _ = step(s)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[2, 3]]
    step(s)
    # Step 4: b's position 32 needs a block.
    out, _ = step(s)
    a, b = s.requests["a"], s.requests["b"]
    if policy == "fcfs":
        # Newest running (b) is the victim: it was the one being scheduled, so stop.
        assert out.num_scheduled_tokens == {"a": 1}
        assert out.finished_req_ids == {"b"}
        assert b.status == RequestStatus.PREEMPTED and a.status == RequestStatus.RUNNING
    else:
        # Largest (priority, arrival) is a, already scheduled this step: undone.
        assert out.num_scheduled_tokens == {"b": 1}
        assert out.total_num_scheduled_tokens == 1
        assert out.scheduled_cached_reqs.req_ids == ["b"]
        assert out.scheduled_cached_reqs.new_block_ids == [[1]]  # a's tail block
        assert out.finished_req_ids == {"a"}
        assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
        assert s.kv_cache_manager.get_block_ids("b") == [2, 3, 1]


def test_priority_order_of_waiting(make_scheduler, make_request, step):
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("c", 10, priority=2, arrival_time=0.0, max_tokens=1))
    s.add_request(make_request("a", 10, priority=0, arrival_time=5.0, max_tokens=1))
    s.add_request(make_request("b", 10, priority=0, arrival_time=3.0, max_tokens=1))
    order = []
    while s.has_unfinished_requests():
        out, _ = step(s)
        order += [r.req_id for r in out.scheduled_new_reqs]
    assert order == ["b", "a", "c"]


def test_same_prompt_requests_share_blocks_in_one_step(make_scheduler, make_request, step):
    s = make_scheduler()
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40))
    out, res = step(s)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[0, 1, 2], [0, 1, 3]]
    assert out.num_scheduled_tokens == {"a": 40, "b": 8}
    assert [o.num_cached_tokens for o in res.outputs] == [0, 32]
    stats = res.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def run_to_end(s, step, token):
    results = {}
    while s.has_unfinished_requests():
        _, res = step(s, token)
        for o in res.outputs:
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                results[o.request_id + ":finish"] = (o.finish_reason, o.stop_reason)
    return results


def test_eos_respects_min_tokens(make_scheduler, make_request, step, eos):
    s = make_scheduler()
    s.add_request(make_request("a", 10, min_tokens=3, max_tokens=10))
    r = run_to_end(s, step, eos)
    assert r["a"] == [eos, eos, eos]
    assert r["a:finish"] == (FinishReason.STOP, None)


def test_stop_token_id_records_reason(make_scheduler, make_request, step):
    s = make_scheduler()
    s.add_request(make_request("a", 10, stop_token_ids=[9], max_tokens=10))
    r = run_to_end(s, step, 9)
    assert r["a"] == [9] and r["a:finish"] == (FinishReason.STOP, 9)


def test_max_tokens_and_ignore_eos(make_scheduler, make_request, step, eos):
    s = make_scheduler()
    s.add_request(make_request("a", 10, max_tokens=3))
    s.add_request(make_request("b", 10, max_tokens=4, ignore_eos=True))
    r = run_to_end(s, step, {"a": 7, "b": eos})
    assert r["a"] == [7, 7, 7] and r["a:finish"] == (FinishReason.LENGTH, None)
    assert r["b"] == [eos] * 4 and r["b:finish"] == (FinishReason.LENGTH, None)
    assert all_blocks_free(s)


def test_max_model_len_caps(make_scheduler, make_request, step):
    s = make_scheduler(max_model_len=24)
    req = make_request("a", 20, max_tokens=100)
    req.max_tokens = 100  # only max_model_len can stop it
    s.add_request(req)
    r = run_to_end(s, step, 7)
    assert len(r["a"]) == 4 and r["a:finish"][0] == FinishReason.LENGTH


def test_logprobs_rows_reach_outputs(make_scheduler, make_request, step):
    s = make_scheduler()
    s.add_request(make_request("a", 10, logprobs=1))
    _, res = step(s)
    (o,) = res.outputs
    assert o.new_logprob_token_ids == [[7, 8]]
    assert o.new_logprobs == [[-0.5, -1.5]] and o.new_sampled_token_ranks == [1]


def test_abort_running_and_waiting_frees_blocks(make_scheduler, make_request, step):
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 40, start=100))
    s.add_request(make_request("b", 40, start=200))
    step(s)
    assert s.kv_cache_manager.get_block_ids("a") == [0, 1, 2]
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.get_num_unfinished_requests() == 0
    assert all_blocks_free(s)
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.total_num_scheduled_tokens == 0
    # The empty step may be skipped by the engine: the ids come again until a real step.
    s.add_request(make_request("c", 5))
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.num_scheduled_tokens == {"c": 5}
    assert s.schedule().finished_req_ids == set()
    with pytest.raises(ValueError):
        s.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update(make_scheduler, make_request, runner_output):
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    out = s.schedule()
    mro = runner_output(s, out)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.update_from_output(out, mro).outputs == []
    assert all_blocks_free(s)


def test_random_workload_invariants_and_all_blocks_back(make_scheduler, make_request, step):
    rng = random.Random(0)
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=48, max_num_seqs=4)
    want = {}
    shared = list(range(500, 532))  # a common 2-block prefix for some prompts
    for i in range(12):
        n = rng.randint(5, 60)
        prompt = (shared + list(range(1000 * i, 1000 * i + n))) if i % 3 == 0 else list(range(1000 * i, 1000 * i + n))
        prompt = prompt[:90]
        want[f"r{i}"] = rng.randint(1, 30)
        s.add_request(make_request(f"r{i}", prompt, max_tokens=want[f"r{i}"]))
    got: dict[str, int] = {}
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        out, res = step(s)
        assert out.total_num_scheduled_tokens <= 48
        assert len(s.running) <= 4
        for o in res.outputs:
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    assert not s.has_unfinished_requests()
    assert got == want
    assert s.make_stats().num_preemptions > 0  # the cache is small enough to force some
    assert all_blocks_free(s)


def test_config_and_request_errors(make_scheduler, make_request):
    with pytest.raises(ValueError, match="chunked prefill"):
        make_scheduler(max_num_batched_tokens=32, max_model_len=64, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="scheduling policy"):
        make_scheduler(policy="lifo")
    with pytest.raises(ValueError, match="only with chunked prefill"):
        make_scheduler(max_model_len=64, enable_chunked_prefill=False, long_prefill_token_threshold=16)
    s = make_scheduler(max_model_len=32)
    s.add_request(make_request("a", 10))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 10))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("b", 40))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(make_request("c", []))


def test_later_request_hits_blocks_of_a_chunked_prefill(make_scheduler, make_request, step):
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 16}
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 16}
    # a's last 8 tokens, then b with a's two full blocks already cached.
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}
    (new_b,) = out.scheduled_new_reqs
    assert new_b.block_ids == [0, 1, 3] and new_b.num_computed_tokens == 32
    assert [(o.request_id, o.num_cached_tokens) for o in res.outputs] == [("a", 0), ("b", 32)]
    pool = s.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]


def test_prefix_caching_off_shares_nothing(make_scheduler, make_request, step):
    s = make_scheduler(enable_prefix_caching=False)
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40))
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 40, "b": 24}
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[0, 1, 2], [3, 4]]
    assert res.scheduler_stats.prefix_cache_hits == 0


def _output_of(out, sampled: dict[str, int]):
    """A ModelRunnerOutput for `out` in which exactly the requests in `sampled` sampled their token."""
    from tokenmill.core.sched_output import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids])


def test_async_placeholders_schedule_ahead_and_stop_at_max_tokens(make_scheduler, make_request):
    """Async scheduling: step N+1 is scheduled before step N's tokens are known; no step past max_tokens."""
    s = make_scheduler(async_scheduling=True)
    a = make_request("a", 20, max_tokens=3, ignore_eos=True)
    b = make_request("b", 20, start=2000, max_tokens=8, stop_token_ids=[9])
    s.add_request(a)
    s.add_request(b)
    o1 = s.schedule()
    assert o1.num_scheduled_tokens == {"a": 20, "b": 20}
    assert (a.num_output_placeholders, b.num_output_placeholders) == (1, 1)
    o2 = s.schedule()  # before o1's tokens: one decode each, its input the token o1 samples
    assert o2.num_scheduled_tokens == {"a": 1, "b": 1}
    assert o2.scheduled_cached_reqs.num_computed_tokens == [20, 20]
    assert (a.num_output_placeholders, a.num_computed_tokens) == (2, 21)
    r1 = s.update_from_output(o1, _output_of(o1, {"a": 5, "b": 6}))
    assert [o.new_token_ids for o in r1.outputs] == [[5], [6]]
    assert a.num_output_placeholders == 1 and a.output_token_ids == [5]
    o3 = s.schedule()
    assert o3.num_scheduled_tokens == {"a": 1, "b": 1}
    r2 = s.update_from_output(o2, _output_of(o2, {"a": 5, "b": 9}))  # b stops on 9: o3's token for it is wasted
    assert [o.finish_reason for o in r2.outputs] == [None, FinishReason.STOP]
    assert b.status == RequestStatus.FINISHED_STOPPED
    o4 = s.schedule()  # a's third token is being sampled by o3: nothing left to schedule
    assert o4.total_num_scheduled_tokens == 0 and "b" in o4.finished_req_ids
    r3 = s.update_from_output(o3, _output_of(o3, {"a": 5, "b": 9}))
    assert [(o.request_id, o.finish_reason) for o in r3.outputs] == [("a", FinishReason.LENGTH)]
    assert a.output_token_ids == [5, 5, 5] and b.output_token_ids == [6, 9]
    assert not s.has_unfinished_requests() and all_blocks_free(s)


def test_async_preempted_request_finishing_on_its_pending_token(make_scheduler, make_request):
    """A request preempted while its token was in flight, and stopped by that token, leaves the waiting queue."""
    s = make_scheduler(num_blocks=3, async_scheduling=True, max_num_batched_tokens=64)
    a = make_request("a", 16, start=100, max_tokens=8, stop_token_ids=[9])
    b = make_request("b", 16, start=300, max_tokens=8, stop_token_ids=[9])
    s.add_request(a)
    s.add_request(b)
    o1 = s.schedule()  # 2 blocks; o2's decodes need a third each: b (newest) is preempted
    assert o1.num_scheduled_tokens == {"a": 16, "b": 16}
    o2 = s.schedule()
    assert o2.num_scheduled_tokens == {"a": 1} and b.status == RequestStatus.PREEMPTED
    assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    r1 = s.update_from_output(o1, _output_of(o1, {"a": 4, "b": 9}))  # b's in-flight token stops it
    assert {o.request_id: o.finish_reason for o in r1.outputs} == {"a": None, "b": FinishReason.STOP}
    assert len(s.waiting) == 0 and "b" not in s.requests
    r2 = s.update_from_output(o2, _output_of(o2, {"a": 9}))
    assert [o.finish_reason for o in r2.outputs] == [FinishReason.STOP]
    assert not s.has_unfinished_requests() and all_blocks_free(s)
