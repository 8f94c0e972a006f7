"""Exact block ids for the prefix-cache cases tests/core does not already pin down.

tests/core/test_prefix_caching.py covers full / partial / block-boundary hits,
one request's eviction order, salts on the first block, and ref counts of two
sharers. Here: LRU order across several finished requests, a salt changing
every block's hash through the chain, three sharers, and a scheduler run that
ends with every block back in the pool and still hittable.
"""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import hash_request_tokens

BS = 16


def _admit(m: KVCacheManager, req) -> list[int]:
    hits, n_hit = m.get_computed_blocks(req)
    ids = m.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
    assert ids is not None
    req.num_computed_tokens = req.num_tokens
    return ids


def _free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_lru_across_requests_first_finished_evicted_first(make_request):
    m = KVCacheManager(8, BS, enable_caching=True)
    a = make_request("a", 48, start=1000)  # blocks 0, 1, 2
    b = make_request("b", 48, start=2000)  # blocks 3, 4, 5
    assert _admit(m, a) == [0, 1, 2] and _admit(m, b) == [3, 4, 5]
    m.free(a)
    m.free(b)
    # Never-used blocks first, then a (finished first) tail to head, then b.
    assert _free_ids(m) == [6, 7, 2, 1, 0, 5, 4, 3]
    # A 5-block request takes 6, 7 and evicts a's 2, 1, 0: a no longer hits, b fully does.
    c = make_request("c", 80, start=3000)
    assert _admit(m, c) == [6, 7, 2, 1, 0]
    assert m.get_computed_blocks(make_request("a2", 49, start=1000))[1] == 0
    hits, n = m.get_computed_blocks(make_request("b2", 49, start=2000))
    assert [blk.block_id for blk in hits] == [3, 4, 5] and n == 48


def test_salt_changes_every_block_hash_through_the_chain(make_request):
    plain = hash_request_tokens(BS, make_request("p", 48))
    salted = hash_request_tokens(BS, make_request("s", 48, cache_salt="tenant"))
    assert len(plain) == len(salted) == 3
    # The salt enters only block 0's extra keys; chaining carries it to every later block.
    assert all(p != s for p, s in zip(plain, salted))
    # A salted tenant cannot hit even a later block of an unsalted copy.
    m = KVCacheManager(12, BS, enable_caching=True)
    _admit(m, make_request("p", 48))
    assert m.get_computed_blocks(make_request("s", 49, cache_salt="tenant")) == ([], 0)


def test_three_sharers_ref_counts(make_request):
    m = KVCacheManager(12, BS, enable_caching=True)
    reqs = [make_request(f"r{i}", 40) for i in range(3)]  # 2 full blocks + a partial one each
    assert [_admit(m, r) for r in reqs] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    m.free(reqs[1])
    assert [m.block_pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 1, 0, 1]
    m.free(reqs[0])
    m.free(reqs[2])
    assert m.num_free_blocks == 12 and all(b.ref_cnt == 0 for b in m.block_pool.blocks)


def test_scheduler_run_returns_every_block_and_keeps_them_hittable(make_scheduler, make_request, step):
    sched = make_scheduler(num_blocks=16)
    prompts = [make_request(f"q{i}", list(range(500, 540)) + [i], max_tokens=4) for i in range(4)]
    for r in prompts:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        step(sched)
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    # The shared 40-token prefix (2 full blocks) is still cached after everyone left.
    assert kv.get_computed_blocks(make_request("late", list(range(500, 540)) + [9]))[1] == 32
    assert kv.prefix_cache_hits == 3 * 32  # q1..q3 hit q0's two blocks
