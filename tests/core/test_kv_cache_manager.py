"""KVCacheManager: block tables, growth, freeing (tail first), all blocks back."""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager

BS = 16


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def make_manager(num_blocks: int = 12, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=caching, max_model_len=1024)


def test_allocate_rounds_up_to_blocks(make_request):
    m = make_manager()
    r = make_request("a", 20)
    assert m.allocate_slots(r, 20) == [0, 1]
    assert m.get_block_ids("a") == [0, 1]
    assert [m.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    assert m.usage == 2 / 12


def test_grow_across_block_boundary(make_request):
    m = make_manager()
    r = make_request("a", 15)
    assert m.allocate_slots(r, 15) == [0]
    r.num_computed_tokens = 15
    r.append_output_token_ids([5])
    # Token 15 still fits block 0.
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens = 16
    r.append_output_token_ids([6])
    # Token 16 opens block 1.
    assert m.allocate_slots(r, 1) == [1]
    assert m.get_block_ids("a") == [0, 1]


def test_allocate_fails_without_side_effects(make_request):
    m = make_manager(num_blocks=3)
    a = make_request("a", 32)
    assert m.allocate_slots(a, 32) == [0, 1]
    b = make_request("b", 40, start=5000)
    assert m.allocate_slots(b, 40) is None
    assert m.get_block_ids("b") == [] and m.num_free_blocks == 1
    assert m.prefix_cache_queries == 32  # b's failed admission is not counted


def test_free_returns_blocks_tail_first(make_request):
    m = make_manager(num_blocks=6)
    a = make_request("a", 48)
    assert m.allocate_slots(a, 48) == [0, 1, 2]
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    assert m.get_block_ids("a") == [] and m.usage == 0.0
    m.free(a)  # twice: nothing happens
    assert m.num_free_blocks == 6


def test_every_block_back_after_many_requests(make_request):
    m = make_manager(num_blocks=12, caching=False)
    reqs = [make_request(f"r{i}", 10 + 7 * i, start=100 * i) for i in range(5)]
    for r in reqs:
        assert m.allocate_slots(r, r.num_tokens) is not None
    held = sorted(i for r in reqs for i in m.get_block_ids(r.request_id))
    assert held == list(range(len(held)))  # distinct ids, none lost
    for r in reqs:
        m.free(r)
    assert m.num_free_blocks == 12
    assert all(b.ref_cnt == 0 for b in m.block_pool.blocks)


def test_noop_end_tracks_blocks_held_and_next_block_to_cache(make_request):
    m = make_manager()
    r = make_request("a", 20)  # 20 prompt tokens: block 0 full (cached), block 1 partial
    assert m.allocate_slots(r, 20) == [0, 1]
    # 2 blocks hold 32 slots, but token 31 fills block 1, which is not cached yet.
    assert m.noop_end["a"] == 31
    for t in range(20, 31):  # decodes of tokens 20..30: nothing to do
        r.num_computed_tokens = t
        r.append_output_token_ids([t])
        assert m.allocate_slots(r, 1) == [] and m.num_cached_block["a"] == 1
    r.num_computed_tokens = 31
    r.append_output_token_ids([31])  # token 31 fills block 1: it is cached now
    assert m.allocate_slots(r, 1) == [] and m.num_cached_block["a"] == 2
    assert m.noop_end["a"] == 32  # the next token needs a new block
    m.free(r)
    assert "a" not in m.noop_end


def test_noop_end_without_caching_is_the_blocks_held(make_request):
    m = make_manager(caching=False)
    r = make_request("a", 20)
    assert m.allocate_slots(r, 20) == [0, 1]
    assert m.noop_end["a"] == 32
