"""KVCacheManager with a sliding-window group: the second table frees blocks as the window moves.

block_size 4, window 6: a query at position p sees (p - 6, p], so when a request
next allocates with num_computed_tokens c, its sliding-window blocks wholly
before position c - 5 go back to the pool. Exact block ids follow the pool's
free queue (taken from the head, freed to the tail).
"""

from __future__ import annotations

from tokenmill.core.kv_cache_manager import KVCacheManager

BS, WINDOW = 4, 6


def make_manager(num_blocks: int = 12) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=False, max_model_len=256, sliding_window=WINDOW)


def step(m: KVCacheManager, r, n: int) -> tuple[list[int], list[int]] | None:
    """Allocate n tokens (as the scheduler does), then mark them computed and sampled."""
    ids = m.allocate_slots(r, n)
    if ids is None:
        return None
    swa = m.pop_new_swa_block_ids(r.request_id)
    r.num_computed_tokens += n
    if r.num_computed_tokens >= r.num_tokens:
        r.append_output_token_ids([7])
    return ids, swa


def test_window_blocks_are_freed_as_the_window_moves(make_request):
    m = make_manager()
    r = make_request("a", 10, max_tokens=64)
    assert step(m, r, 8) == ([0, 1], [2, 3])  # chunk 0..7: both tables from 0
    assert step(m, r, 2) == ([4], [5])  # 8..9: first visible 3 -> nothing freed yet
    assert m.get_block_ids("a") == [0, 1, 4] and m.get_block_ids("a", swa=True) == [2, 3, 5]
    assert step(m, r, 1) == ([], []) and step(m, r, 1) == ([], [])  # 10, 11: inside held blocks
    # 12: first visible 12 - 6 + 1 = 7 -> swa block of 0..3 (id 2) freed, to the queue's tail
    assert step(m, r, 1) == ([6], [7])
    assert m.get_block_ids("a", swa=True) == [0, 3, 5, 7]  # freed entries read as 0 (never read)
    assert m.num_swa_blocks("a") == 3 and m.num_free_blocks == 12 - 4 - 3
    for _ in range(3):  # 13..15
        step(m, r, 1)
    # 16: first visible 11 -> entries 0..1 (ids 3) freed; takes 8 (full) and 9 (swa)
    assert step(m, r, 1) == ([8], [9])
    assert m.num_swa_blocks("a") == 3 and m.get_block_ids("a") == [0, 1, 4, 6, 8]
    m.free(r)
    assert m.num_free_blocks == 12 and m.swa_tables == {} and m.req_to_blocks == {}


def test_a_long_decode_holds_the_window_not_the_sequence(make_request):
    m = make_manager(num_blocks=40)
    r = make_request("a", 5, max_tokens=200)
    step(m, r, 5)
    for _ in range(95):  # up to 100 tokens
        step(m, r, 1)
        n = r.num_computed_tokens
        assert len(m.get_block_ids("a")) == -(-n // BS)
        # held: blocks from the one of position n - 1 - 5 (the window before the next query) to the last
        assert m.num_swa_blocks("a") <= -(-WINDOW // BS) + 1
    assert m.num_free_blocks == 40 - 25 - m.num_swa_blocks("a")
    m.free(r)
    assert m.num_free_blocks == 40


def test_allocation_failure_takes_nothing_and_preempted_requests_start_over(make_request):
    m = make_manager(num_blocks=5)
    a = make_request("a", 8, max_tokens=8)
    assert step(m, a, 8) == ([0, 1], [2, 3])
    b = make_request("b", 8, max_tokens=8, start=5000)
    assert m.allocate_slots(b, 8) is None  # needs 4, 1 free
    assert m.get_block_ids("b") == [] and m.num_swa_blocks("b") == 0 and m.num_free_blocks == 1
    m.free(a)  # preempted: both tables back
    assert m.num_free_blocks == 5
    b2 = make_request("b2", 8, max_tokens=8, start=6000)
    assert step(m, b2, 8) is not None and m.num_free_blocks == 1


def test_which_models_get_two_groups():
    from types import SimpleNamespace

    from tokenmill.worker.kv_cache import blocks_per_sequence, sliding_window_group

    alternating = ["sliding_attention", "full_attention"] * 12
    assert sliding_window_group(SimpleNamespace(layer_types=alternating, sliding_window=128)) == 128  # gpt-oss
    assert sliding_window_group(SimpleNamespace(layer_types=alternating, sliding_window=128), 2) is None  # pp
    gemma = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert sliding_window_group(SimpleNamespace(layer_types=gemma, sliding_window=512)) is None  # 5:1
    off = SimpleNamespace(layer_types=alternating, sliding_window=128, use_sliding_window=False)
    assert sliding_window_group(off) is None
    assert sliding_window_group(SimpleNamespace(layer_types=None, sliding_window=4096)) is None  # Mistral
    # 4096 tokens, block 16, window 128, chunks of 2048: 256 full + min(256, ceil(2175 / 16) + 1) = 393
    assert blocks_per_sequence(4096, 16, 128, 2048) == 393
    assert blocks_per_sequence(4096, 16) == 256 and blocks_per_sequence(100, 16, 128) == 7 + 7


def test_fits_check_counts_both_groups():
    import pytest

    from tokenmill.worker.kv_cache import check_max_model_len_fits

    check_max_model_len_fits(15, BS, 40, window=WINDOW, chunk=8)  # 10 full + min(10, ceil(13 / 4) + 1 = 5)
    # 10 blocks: a 20-token sequence takes 5 + 5, a 21-token one 6 + 5
    with pytest.raises(ValueError, match="The largest max_model_len that fits is 20"):
        check_max_model_len_fits(10, BS, 40, window=WINDOW, chunk=8)


def _caching_manager(num_blocks: int = 24) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching=True, max_model_len=256, sliding_window=WINDOW)


def _run_prompt(m: KVCacheManager, r) -> tuple[list[int], list[int]]:
    """Admit r with its prefix-cache hits, compute its whole prompt in one step, sample one token."""
    hits, num_hit = m.get_computed_blocks(r)
    ids = m.allocate_slots(r, r.num_tokens - num_hit, num_hit, hits)
    assert ids is not None
    swa = m.pop_new_swa_block_ids(r.request_id)
    r.num_computed_tokens = r.num_tokens
    r.append_output_token_ids([7])
    return ids, swa


def test_prefix_hits_take_the_full_blocks_and_the_window_before_them(make_request):
    """Two groups with prefix caching: a hit of n blocks takes full blocks 0..n-1 and only the sliding-window
    blocks a query at n * 4 can see ((n * 4 - 6, n * 4 - 1]); each group has its own cache entries."""
    m = _caching_manager()
    a = make_request("a", list(range(100, 114)), max_tokens=8)  # 14 tokens: 3 full blocks
    assert _run_prompt(m, a) == ([0, 1, 2, 3], [4, 5, 6, 7])
    m.free(a)  # queue: 8..23, then swa 7 6 5 4, then full 3 2 1 0
    b = make_request("b", list(range(100, 112)) + [1, 2, 3, 4], max_tokens=8)  # same first 3 blocks
    hits, num_hit = m.get_computed_blocks(b)
    # at most (16 - 1) // 4 = 3 blocks; the window of a query at 12 is 7..11 -> swa blocks 1, 2 (ids 5, 6)
    assert [blk.block_id for blk in hits] == [0, 1, 2] and num_hit == 12
    assert m.allocate_slots(b, 4, 12, hits) == [0, 1, 2, 8]
    assert m.pop_new_swa_block_ids("b") == [9]
    assert m.get_block_ids("b", swa=True) == [0, 5, 6, 9]  # entry 0 is out of the window: never held
    assert m.num_swa_blocks("b") == 3 and m.prefix_cache_hits == 12 and m.prefix_cache_queries == 14 + 16
    b.num_computed_tokens = 16
    m.free(b)
    assert m.num_free_blocks == 24 and not m.swa_tables and not m._swa_hits


def test_a_missing_window_block_shortens_the_hit(make_request):
    """The full group alone would hit 3 blocks; with the sliding-window copy of block 2 gone only 2 remain
    (a query at 8 sees 3..7: swa blocks 0 and 1)."""
    m = _caching_manager()
    a = make_request("a", list(range(100, 114)), max_tokens=8)
    _run_prompt(m, a)
    m.free(a)
    m.block_pool.uncache_block(m.block_pool.blocks[6])  # a's sliding-window block 2
    b = make_request("b", list(range(100, 116)), max_tokens=8)
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert m.allocate_slots(b, 8, 8, hits) == [0, 1, 8, 9]
    assert m.get_block_ids("b", swa=True) == [4, 5, 10, 11] and m.pop_new_swa_block_ids("b") == [10, 11]


def test_unwritten_blocks_of_a_preempted_request_leave_both_caches(make_request):
    """Blocks cached when scheduled but freed before their step ran (num_computed_tokens behind) are
    uncached in both groups, so no later request hits KV that was never written."""
    m = _caching_manager()
    a = make_request("a", list(range(100, 114)), max_tokens=8)
    assert m.allocate_slots(a, 14) == [0, 1, 2, 3]
    m.free(a)  # num_computed_tokens 0: nothing was written
    assert m.block_pool.cached_block_hash_to_block == {}
    b = make_request("b", list(range(100, 114)), max_tokens=8)
    assert m.get_computed_blocks(b) == ([], 0)
