"""Prefix caching and scheduling under pressure on the real SmolLM2-135M (float32, greedy).

The reference is one batched run with prefix caching off. Every other run
(caching on, cache warm or cold, preemption forced, priorities) must give
exactly the same tokens: a prefix-cache hit only skips recomputing KV that
an earlier step already wrote, and preemption by recompute rebuilds it.

The model loads once per session (tests/conftest.py `smollm2_llm`, shared with
other files); each configuration gets a fresh scheduler built from the flag it
stands for (see `pc_helpers.use_scheduler`).

Prompts (token ids, so lengths are exact; block_size 16):

    SYS + Q1, SYS + Q2, SYS + Q3   a 53-token shared system prefix + a question
    P16, P32, P48                  16 / 32 / 48 tokens, each a prefix of the next
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pc_helpers import use_scheduler

from tokenmill import SamplingParams

pytestmark = pytest.mark.slow  # the real SmolLM2, cold and warm runs: a minute or more on 2 cores

BLOCK = 16
NUM_TOKENS = 16
SYSTEM = ("You are a careful assistant for a public library. Answer in one short sentence, cite no sources, "
          "and if you do not know the answer say so plainly. Be polite and precise.")
QUESTIONS = ["Who wrote Pride and Prejudice?", "When does the library open on Sundays?",
             "What is the capital of France?"]
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. ") * 2


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    """The session's SmolLM2 LLM (tests/conftest.py: float32, 16-token blocks, 16 sequences), with a default
    scheduler again after this module (its tests swap the scheduler)."""
    config = smollm2_llm.llm_engine.engine_core.engine_config
    assert config.cache_config.block_size == BLOCK and config.scheduler_config.max_num_seqs == 16
    yield smollm2_llm
    use_scheduler(smollm2_llm, caching=config.cache_config.enable_prefix_caching)


@pytest.fixture(scope="module")
def prompts(llm) -> dict[str, list[int]]:
    tok = llm.get_tokenizer()
    system = tok.encode(SYSTEM)  # with BOS, as a chat prompt would start
    out = {f"sys_q{i + 1}": system + tok.encode(" " + q, add_special_tokens=False) for i, q in enumerate(QUESTIONS)}
    text = tok.encode(TEXT, add_special_tokens=False)
    out.update({f"p{n}": text[:n] for n in (16, 32, 48)})
    assert len(system) > 2 * BLOCK and all(len(v) < 100 for v in out.values())
    return out


def _generate(llm, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llm, prompts) -> dict[str, list[int]]:
    """name -> greedy tokens, all prompts in one batch, prefix caching off."""
    sched = use_scheduler(llm, caching=False)
    outs = _generate(llm, list(prompts.values()))
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert sched.kv_cache_manager.prefix_cache_hits == 0
    return dict(zip(prompts, _tokens(outs)))


@pytest.fixture(scope="module")
def cold_then_warm(llm, prompts):
    """Caching on: run SYS+Q1, P16, P32, P48 (cold), then every prompt (warm)."""
    use_scheduler(llm, caching=True)
    cold_names = ["sys_q1", "p16", "p32", "p48"]
    cold = _generate(llm, [prompts[n] for n in cold_names])
    warm = _generate(llm, list(prompts.values()))
    return dict(zip(cold_names, cold)), dict(zip(prompts, warm))


def _shared_full_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // BLOCK


def test_full_hit_same_prompt_twice(cold_then_warm, reference, prompts):
    cold, warm = cold_then_warm
    assert cold["sys_q1"].num_cached_tokens == 0
    # Every full block but the one holding the last prompt token comes from the cache.
    n = len(prompts["sys_q1"])
    assert warm["sys_q1"].num_cached_tokens == (n - 1) // BLOCK * BLOCK > 0
    assert cold["sys_q1"].outputs[0].token_ids == warm["sys_q1"].outputs[0].token_ids == reference["sys_q1"]


def test_partial_hit_shared_system_prompt(cold_then_warm, reference, prompts):
    _, warm = cold_then_warm
    for name in ("sys_q2", "sys_q3"):
        shared = _shared_full_blocks(prompts["sys_q1"], prompts[name])
        assert shared >= 2
        assert warm[name].num_cached_tokens == shared * BLOCK
        assert warm[name].outputs[0].token_ids == reference[name], name


def test_block_boundary_prompts(cold_then_warm, reference):
    cold, warm = cold_then_warm
    # Cold, in one step: P32 hits the block P16 cached moments before, P48 both
    # (blocks are entered into the map when scheduled; the worker writes KV
    # before attention reads it). A prompt never takes its last block from
    # the cache, so P16 hits nothing and P48 at most 32 tokens.
    assert [cold[n].num_cached_tokens for n in ("p16", "p32", "p48")] == [0, 16, 32]
    assert [warm[n].num_cached_tokens for n in ("p16", "p32", "p48")] == [0, 16, 32]
    for n in ("p16", "p32", "p48"):
        assert cold[n].outputs[0].token_ids == warm[n].outputs[0].token_ids == reference[n], n


@pytest.mark.parametrize("caching", [True, False], ids=["caching_on", "caching_off"])
def test_preemption_forced_keeps_outputs(llm, prompts, reference, caching):
    # 6 prompts of up to ~70 tokens + 16 new ones need ~26 blocks without sharing; give 8.
    sched = use_scheduler(llm, caching=caching, num_blocks=8)
    outs = _generate(llm, list(prompts.values()))
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert dict(zip(prompts, _tokens(outs))) == reference
    assert sched.kv_cache_manager.num_free_blocks == 8  # everything back in the pool


def _run_steps(engine, on_step=None) -> list[str]:
    """Step until idle; returns request ids in the order they finished."""
    order = []
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            return order
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
        if on_step is not None:
            on_step()
    raise AssertionError("engine did not finish")


def test_priority_order_with_one_seat(llm, prompts):
    use_scheduler(llm, caching=True, policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prio in (5, 0, 3):  # all queued before the first step
        engine.add_request(f"prio{prio}", {"prompt_token_ids": prompts["p16"]}, params, priority=prio)
    assert _run_steps(engine) == ["prio0", "prio3", "prio5"]


def test_priority_preempts_largest_priority_first(llm, prompts, reference):
    # Caching off keeps block accounting plain: each request holds its own blocks.
    names = ["sys_q1", "sys_q2", "sys_q3"]
    need = [-(-(len(prompts[n]) + NUM_TOKENS) // BLOCK) for n in names]
    prompt_blocks = [-(-len(prompts[n]) // BLOCK) for n in names]
    # All three prompts fit; their decodes cannot all finish together.
    num_blocks = sum(need) - 2
    assert sum(prompt_blocks) < num_blocks
    sched = use_scheduler(llm, caching=False, num_blocks=num_blocks, policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for name, prio in zip(names, (0, 5, 3)):  # arrival order sys_q1, sys_q2, sys_q3
        engine.add_request(name, {"prompt_token_ids": prompts[name]}, params, priority=prio)
    preempted: list[str] = []

    def note_preemptions():
        for rid, req in sched.requests.items():
            if req.num_preemptions and rid not in preempted:
                preempted.append(rid)

    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        note_preemptions()
    assert sched.num_preemptions > 0
    # The victim is the running request with the largest (priority, arrival): sys_q2 (priority 5).
    assert preempted[0] == "sys_q2"
    assert {n: done[n].outputs[0].token_ids for n in names} == {n: reference[n] for n in names}


def test_n3_children_share_prompt_blocks(llm, prompts, reference):
    sched = use_scheduler(llm, caching=True)
    engine = llm.llm_engine
    prompt = prompts["sys_q1"]
    engine.add_request("fan", {"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0.0,
                                                                          max_tokens=NUM_TOKENS, ignore_eos=True))
    engine.step()  # all three children's prefill in one step
    kv = sched.kv_cache_manager
    tables = [kv.get_block_ids(f"{i}_fan") for i in range(3)]
    num_full = (len(prompt) - 1) // BLOCK  # blocks a later child can take from the cache
    assert num_full >= 2
    shared = tables[0][:num_full]
    assert all(t[:num_full] == shared for t in tables)
    assert [kv.block_pool.blocks[b].ref_cnt for b in shared] == [3] * num_full
    # Each child computes its own last (partial) block.
    tails = [t[num_full] for t in tables]
    assert len(set(tails)) == 3 and all(kv.block_pool.blocks[b].ref_cnt == 1 for b in tails)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = o
    assert [c.token_ids for c in out["fan"].outputs] == [reference["sys_q1"]] * 3
    assert kv.num_free_blocks == kv.block_pool.num_blocks
