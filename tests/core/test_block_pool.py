"""BlockPool and its O(1) LRU free queue: exact block ids, ref counts, lazy eviction."""

from __future__ import annotations

import pytest

from tokenmill.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_free_queue_popleft_append_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    q.remove(blocks[3])  # from the middle
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 2, 4, 0]
    assert q.num_free_blocks == 4
    for expected in (1, 2, 4, 0):
        assert q.popleft().block_id == expected
    with pytest.raises(ValueError):
        q.popleft()


def test_get_new_blocks_in_order_and_usage():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    # A failed request takes nothing.
    assert pool.get_num_free_blocks() == 1


def test_free_blocks_order_is_eviction_order():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)  # 0, 1, 2
    pool.free_blocks(reversed(got))
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 5, 2]


def test_lazy_eviction_keeps_hash_until_reuse():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b0], [111], 0, 1)
    pool.free_blocks([b0])
    # Free but still a hit.
    assert b0.ref_cnt == 0 and b0.block_hash == 111
    assert pool.get_cached_block(111) is b0
    # Taking block 1 (head of the queue) leaves block 0 cached.
    (b1,) = pool.get_new_blocks(1)
    assert b1.block_id == 1 and pool.get_cached_block(111) is b0
    # Block 0 is now the only free block: reusing it evicts its hash.
    (again,) = pool.get_new_blocks(1)
    assert again is b0 and b0.block_hash is None
    assert pool.get_cached_block(111) is None


def test_touch_removes_free_block_from_queue_and_counts_refs():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b0, b1], [10, 20], 0, 2)
    pool.free_blocks([b1, b0])
    assert free_ids(pool) == [2, 1, 0]
    pool.touch([b0])
    assert b0.ref_cnt == 1 and free_ids(pool) == [2, 1]
    pool.touch([b0])  # a second holder: not in the queue, just one more ref
    assert b0.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b0])
    assert b0.ref_cnt == 1 and free_ids(pool) == [2, 1]
    pool.free_blocks([b0])
    assert free_ids(pool) == [2, 1, 0]


def test_duplicate_hash_keeps_first_owner():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [5], 0, 1)
    pool.cache_full_blocks([b], [5], 0, 1)
    assert pool.get_cached_block(5) is a and b.block_hash is None
    # Evicting the unhashed twin must not drop the owner's entry.
    pool.free_blocks([b, a])
    pool.get_new_blocks(2)  # takes 2, then b
    assert pool.get_cached_block(5) is a


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2], 0, 2)
    assert all(b.block_hash is None for b in blocks)
    assert pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [9], 0, 1)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(9) is None and blocks[0].block_hash is None


def test_bad_num_blocks():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
