"""Prefix caching: hash chains, hits, the last-token rule, salts, eviction, sharing."""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import hash_block_tokens, hash_request_tokens

BS = 16


def make_manager(num_blocks: int = 12) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=True, max_model_len=1024)


def admit(m: KVCacheManager, req) -> list[int] | None:
    """Admit like the scheduler: lookup, allocate the rest, advance."""
    hits, n_hit = m.get_computed_blocks(req)
    ids = m.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
    if ids is not None:
        req.num_computed_tokens = req.num_tokens
    return ids


def test_hash_is_deterministic_and_chained():
    tokens = list(range(16))
    h = hash_block_tokens(None, tokens)
    assert h == hash_block_tokens(None, list(tokens)) and 0 <= h < 2**64
    # Same block tokens under different parents -> different hashes.
    assert hash_block_tokens(1, tokens) != hash_block_tokens(2, tokens)
    assert hash_block_tokens(None, tokens, ("salt",)) != h


def test_hash_request_tokens_only_full_blocks(make_request):
    r = make_request("a", 40)
    hashes = hash_request_tokens(BS, r)
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], r.prompt_token_ids[16:32])
    # A request sharing only block 1's tokens (different block 0) gets another hash.
    other = make_request("b", list(range(16)) + r.prompt_token_ids[16:32])
    assert hash_request_tokens(BS, other)[1] != hashes[1]


def test_full_and_partial_hit(make_request):
    m = make_manager()
    a = make_request("a", 40)  # blocks 0, 1 full; 2 partial
    assert admit(m, a) == [0, 1, 2]
    # Same 40 tokens: both full blocks hit, the partial one is recomputed.
    b = make_request("b", 40)
    hits, n = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and n == 32
    assert admit(m, b) == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    # Shares block 0 only: its second block differs.
    c = make_request("c", r := a.prompt_token_ids[:16] + list(range(9000, 9020)))
    assert len(r) == 36
    assert admit(m, c) == [0, 4, 5]
    assert m.prefix_cache_queries == 40 + 40 + 36
    assert m.prefix_cache_hits == 32 + 16


def test_block_boundary_prompt_keeps_last_token_computed(make_request):
    m = make_manager()
    a = make_request("a", 32)
    assert admit(m, a) == [0, 1]
    # 32 cached tokens, but the last must be computed: back off one block.
    b = make_request("b", 32)
    hits, n = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0] and n == 16
    assert admit(m, b) == [0, 2]
    # Exactly one block: nothing may come from the cache.
    c = make_request("c", 16)
    d = make_request("d", 16)
    assert admit(m, c) == [3]
    assert m.get_computed_blocks(d) == ([], 0)


def test_salt_isolates_tenants(make_request):
    m = make_manager()
    a = make_request("a", 40, cache_salt="tenant-1")
    admit(m, a)
    assert m.get_computed_blocks(make_request("b", 40, cache_salt="tenant-2"))[1] == 0
    assert m.get_computed_blocks(make_request("c", 40))[1] == 0
    assert m.get_computed_blocks(make_request("d", 40, cache_salt="tenant-1"))[1] == 32


def test_freed_blocks_still_hit_and_are_touched(make_request):
    m = make_manager(num_blocks=6)
    a = make_request("a", 40)
    assert admit(m, a) == [0, 1, 2]
    m.free(a)
    b = make_request("b", 40)
    assert admit(m, b) == [0, 1, 3]
    free = [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()]
    # Hits left the free queue; 3 was taken from the head.
    assert free == [4, 5, 2]


def test_eviction_is_lru_tail_first(make_request):
    m = make_manager(num_blocks=6)
    a = make_request("a", 48)  # three full blocks 0, 1, 2 (48 tokens)
    assert admit(m, a) == [0, 1, 2]
    m.free(a)
    # Queue: 3, 4, 5, then a's blocks tail first: 2, 1, 0.
    filler = make_request("f", 64, start=7000)  # needs 4 blocks: 3, 4, 5, then evicts 2
    assert admit(m, filler) == [3, 4, 5, 2]
    b = make_request("b", 48)
    hits, n = m.get_computed_blocks(b)
    # a's tail (block 2) is gone, its head blocks still hit.
    assert [blk.block_id for blk in hits] == [0, 1] and n == 32


def test_shared_prefix_ref_counts_and_all_free_at_end(make_request):
    m = make_manager()
    a = make_request("a", 36)
    b = make_request("b", 36)
    assert admit(m, a) == [0, 1, 2]
    assert admit(m, b) == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    m.free(a)
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    # Only a's own tail went back so far.
    assert [blk.block_id for blk in m.block_pool.free_block_queue.get_all_free_blocks()][-1] == 2
    m.free(b)
    assert m.num_free_blocks == 12 and m.usage == 0.0
    assert all(blk.ref_cnt == 0 for blk in m.block_pool.blocks)


def test_decode_fills_block_then_it_is_cached(make_request):
    m = make_manager()
    a = make_request("a", 15)
    admit(m, a)
    a.append_output_token_ids([42])  # token 15: block 0 now full
    assert m.allocate_slots(a, 1) == []
    blk0 = m.block_pool.blocks[0]
    assert blk0.block_hash == hash_block_tokens(None, a.all_token_ids[:16])
    # A new request with the same 16 tokens + more hits block 0.
    b = make_request("b", a.all_token_ids[:16] + [1, 2, 3])
    assert m.get_computed_blocks(b)[1] == 16


def test_caching_disabled_no_hits(make_request):
    m = KVCacheManager(12, BS, enable_caching=False, max_model_len=1024)
    a = make_request("a", 40)
    admit(m, a)
    assert m.get_computed_blocks(make_request("b", 40)) == ([], 0)
    assert m.prefix_cache_queries == 0


def test_free_before_the_step_runs_uncaches_unwritten_blocks(make_request):
    m = make_manager()
    a = make_request("a", 29)
    admit(m, a)  # computed 29: block 0 cached, block 1 partial
    a.append_output_token_ids([5, 6, 7])  # 32 tokens known
    a.num_computed_tokens = 29
    assert m.allocate_slots(a, 3) == []  # schedules 29..31: block 1 now full and cached
    h1 = a.block_hashes[1]
    assert m.block_pool.get_cached_block(h1) is m.block_pool.blocks[1]
    # Preempted before the step ran: num_computed_tokens never advanced.
    m.free(a)
    assert m.block_pool.get_cached_block(h1) is None
    assert m.block_pool.get_cached_block(a.block_hashes[0]) is m.block_pool.blocks[0]
    # After a real step, freeing keeps both blocks cached.
    b = make_request("b", a.all_token_ids)
    admit(m, b)
    m.free(b)
    assert m.block_pool.get_cached_block(h1) is not None
