"""Stall-free batching (`max_prefill_tokens_with_decodes`): prefill tokens are capped only beside decodes.

Driven by the fake model runner of conftest (one fixed token per request whose
span reaches its last token), with `block_size=16` and a small budget.
"""

from __future__ import annotations

import random

import pytest

from tokenmill.core.request import RequestStatus


def _tokens_left(sched) -> dict[str, int]:
    """req_id -> tokens a running request has left to compute (1: a decode), read before schedule()."""
    return {r.request_id: len(r.all_token_ids) + r.num_output_placeholders - r.num_computed_tokens
            for r in sched.running}


def _prefill_tokens(left_before: dict[str, int], out) -> int:
    """Tokens `out` scheduled for prefills: waiting requests, and running ones with more than one token left."""
    return sum(n for rid, n in out.num_scheduled_tokens.items() if left_before.get(rid, 2) > 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cap_applies_only_while_decodes_run(make_scheduler, make_request, step, async_scheduling):
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16,
                       async_scheduling=async_scheduling)
    s.add_request(make_request("a", 10, start=100, max_tokens=20))
    s.add_request(make_request("b", 100, start=200))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 54}  # no decode yet: the whole budget
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 16}  # a decodes: b's chunk is capped (46 without the cap)
    s.add_request(make_request("c", 40, start=300))
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 16}  # the cap is spent on b: c waits
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 14, "c": 2}  # b's last 14, c the 2 left of the cap
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 16}

    off = make_scheduler(num_blocks=20, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    off.add_request(make_request("a", 10, start=100, max_tokens=20))
    off.add_request(make_request("b", 100, start=200))
    step(off)
    assert step(off)[0].num_scheduled_tokens == {"a": 1, "b": 46}  # 0 = off: the budget alone


def test_a_request_whose_last_token_is_in_flight_is_no_decode(make_scheduler, make_request):
    """Async scheduling: `a` (max_tokens=1) has its only token being sampled when the next step is planned; it
    has nothing to schedule, so it must not cap `b` (found in review)."""
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16,
                       async_scheduling=True)
    s.add_request(make_request("a", 10, start=100, max_tokens=1))
    s.add_request(make_request("b", 100, start=200))
    assert s.schedule().num_scheduled_tokens == {"a": 10, "b": 54}
    assert s.schedule().num_scheduled_tokens == {"b": 46}  # the rest of b, uncapped (16 with a counted)


def test_lone_long_prompt_keeps_the_whole_budget(make_scheduler, make_request, step):
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16)
    s.add_request(make_request("a", 200))
    chunks = [step(s)[0].num_scheduled_tokens["a"] for _ in range(4)]
    assert chunks == [64, 64, 64, 8]  # a running prefill is no decode: nothing caps it
    assert s.requests["a"].num_output_tokens == 1


def test_cap_counts_new_tokens_after_a_prefix_cache_hit(make_scheduler, make_request, step):
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=16)
    shared = list(range(500, 548))  # three full blocks
    s.add_request(make_request("x", shared + [1, 2, 3], max_tokens=1))
    step(s)
    assert "x" not in s.requests  # finished; its blocks stay cached
    s.add_request(make_request("a", 10, start=100, max_tokens=20))
    step(s)
    s.add_request(make_request("b", shared + list(range(600, 640))))
    out, _ = step(s)
    new_b = next(r for r in out.scheduled_new_reqs if r.req_id == "b")
    assert new_b.num_computed_tokens == 48  # the hit is free
    assert out.num_scheduled_tokens == {"a": 1, "b": 16}  # of its 40 new tokens, the cap's 16


def test_prefill_moves_every_step_even_at_cap_one(make_scheduler, make_request, step):
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=1)
    s.add_request(make_request("a", 10, start=100, max_tokens=30))
    step(s)
    s.add_request(make_request("b", 5, start=200))
    for i in range(5):
        out, _ = step(s)
        assert out.num_scheduled_tokens == {"a": 1, "b": 1}, i
    assert s.requests["b"].num_output_tokens == 1


def _all_blocks_free(sched) -> bool:
    pool = sched.kv_cache_manager.block_pool
    return pool.get_num_free_blocks() == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.mark.parametrize("policy, async_scheduling", [("fcfs", False), ("priority", False), ("fcfs", True)])
def test_random_workload_with_preemption_keeps_the_cap_and_frees_every_block(
        make_scheduler, make_request, runner_output, policy, async_scheduling):
    """Requests arrive while others run on a cache small enough to preempt: every step that starts with a
    decode takes at most the cap's prefill tokens, the cap binds, and every request ends with all its tokens."""
    cap = 8
    rng = random.Random(0)
    s = make_scheduler(num_blocks=14, max_num_batched_tokens=48, max_num_seqs=6, max_model_len=256, policy=policy,
                       async_scheduling=async_scheduling, max_prefill_tokens_with_decodes=cap)
    pending = [make_request(f"r{i}", [rng.randint(10, 200) for _ in range(rng.randint(1, 90))],
                            max_tokens=rng.randint(1, 30), ignore_eos=True, priority=rng.randint(0, 2),
                            max_model_len=256) for i in range(24)]
    want = {r.request_id: r.max_tokens for r in pending}
    got: dict[str, int] = {}
    capped_steps = 0
    for _ in range(3000):
        if not pending and not s.has_unfinished_requests():
            break
        if pending and rng.random() < 0.4:
            s.add_request(pending.pop(0))
        left = _tokens_left(s)
        out = s.schedule()
        prefill = _prefill_tokens(left, out)
        if 1 in left.values():  # the step started with a decode
            assert prefill <= cap
            capped_steps += prefill == cap
        res = s.update_from_output(out, runner_output(s, out))
        for o in res.outputs:
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    assert not pending and not s.has_unfinished_requests()
    assert got == want
    assert s.num_preemptions > 0 and capped_steps > 0
    assert _all_blocks_free(s)


@pytest.mark.parametrize("kwargs", [
    {"max_prefill_tokens_with_decodes": -1},
    {"max_prefill_tokens_with_decodes": 65},
    {"max_prefill_tokens_with_decodes": 16, "enable_chunked_prefill": False, "max_model_len": 64},
])
def test_invalid_cap_is_refused(make_scheduler, kwargs):
    with pytest.raises(ValueError, match=r"max_prefill_tokens_with_decodes \(-?\d+\) must be between 0"):
        make_scheduler(max_num_batched_tokens=64, **kwargs)


def test_preempted_chunk_gives_its_prefill_tokens_back(make_scheduler, make_request, step):
    """Priority policy: a decode needs a block, the victim is a prefill chunk already scheduled this step; its
    tokens go back to the cap, so a later running prefill gets them."""
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=64, policy="priority", long_prefill_token_threshold=16,
                       max_prefill_tokens_with_decodes=8)
    s.add_request(make_request("p", 100, start=100, priority=2))
    assert step(s)[0].num_scheduled_tokens == {"p": 16}
    s.add_request(make_request("d", 15, start=300, priority=0))
    s.add_request(make_request("q", 40, start=500, priority=1))
    assert step(s)[0].num_scheduled_tokens == {"p": 16, "d": 15, "q": 16}  # no decode yet
    assert step(s)[0].num_scheduled_tokens == {"p": 8, "d": 1}  # d decodes: p takes the cap, q waits
    out, _ = step(s)  # d's next token needs a 6th block: p (priority 2) is preempted after its chunk was counted
    assert s.requests["p"].status == RequestStatus.PREEMPTED and "p" in out.finished_req_ids
    assert out.num_scheduled_tokens == {"d": 1, "q": 8}
