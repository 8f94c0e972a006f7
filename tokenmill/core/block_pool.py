"""BlockPool: every KV-cache block, the LRU free queue and the prefix-cache map.

Pure bookkeeping on block ids; the KV tensors live in the worker. A block is
in exactly one of two states:

- in use: `ref_cnt > 0` (one count per request whose block table holds it);
- free: `ref_cnt == 0` and in the free queue.

Lazy eviction: a freed block keeps its `block_hash` and stays in the
hash -> block map, so a later request with the same prefix can take it back
(`touch`, which pulls it out of the free queue) instead of recomputing it.
Only when a free block is taken for new data (`get_new_blocks`) is its old
hash dropped from the map. Allocation takes from the queue's head, frees go
to its tail, so the least recently freed block is evicted first (LRU).

Invariant kept by this module: `block.block_hash is not None` exactly when
`cached_block_hash_to_block[block.block_hash] is block`. When two blocks
end up with the same content (two requests that filled equal blocks at the
same time), the first one cached owns the hash and the second stays
unhashed; it is simply not shared.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One KV-cache block (`block_size` token slots in every layer's cache).

    Attributes:
        block_id: index into the worker's `[2, num_blocks, block_size, ...]`
            cache tensors, in [0, num_blocks). Block 0 is a real block.
        ref_cnt: number of requests whose block table holds this block.
        block_hash: chained hash of the block's tokens while it is in the
            prefix cache (full and cached), else None.
        prev_free_block / next_free_block: links of the free queue (None when
            not in it). Only `FreeKVCacheBlockQueue` touches them.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove.

    The links live in the blocks themselves, so removing a block from the
    middle (a prefix-cache hit on a free block) needs no search. Two sentinel
    blocks (id -1) bound the list:

        head <-> b3 <-> b7 <-> b1 <-> tail
                 ^ evicted next        ^ freed last

    Args:
        blocks: the initial free blocks, in eviction order.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next (the head).

        Raises:
            ValueError: if the queue is empty.
        """
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise ValueError("No free KV-cache block is left.")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block`, which must be in the queue (O(1))."""
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        assert block.prev_free_block is None and block.next_free_block is None, f"block {block.block_id} is already free"
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks in eviction order (head first); O(n), for tests and debugging."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All KV-cache blocks of one engine, their free queue and the prefix-cache map.

    Args:
        num_blocks: total blocks (the worker's cache has this many).
        enable_caching: keep full blocks in the hash map for prefix caching.

    Raises:
        ValueError: if `num_blocks` < 1.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got num_blocks={num_blocks}; give it more memory.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # block_hash -> the one cached block holding those tokens (free or in use)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what allocation can still take."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0), in [0, 1]."""
        return (self.num_blocks - self.get_num_free_blocks()) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The cached block with this hash (in use or free), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks for new data, least recently freed first.

        Each block's old hash (if it was still cached) is evicted from the
        map, and its ref_cnt becomes 1.

        Raises:
            ValueError: if fewer than `num_blocks` blocks are free (callers
                check `get_num_free_blocks()` first).
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot take {num_blocks} KV-cache blocks: only {self.get_num_free_blocks()} are free.")
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each of `blocks` (prefix-cache hits).

        A block that was free leaves the free queue, so it cannot be evicted
        while the new holder uses it.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 become free.

        Args:
            ordered_blocks: in the order they should be evicted. The manager
                passes a request's block table reversed (tail block first),
                because the tail of a sequence is the part least likely to be
                shared by another request's prefix.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock | None], block_hashes: list[int], num_cached_blocks: int,
                          num_full_blocks: int) -> None:
        """Enter blocks `[num_cached_blocks, num_full_blocks)` of a block table into the map.

        Args:
            blocks: a request's block table.
            block_hashes: the request's chained block hashes (at least
                `num_full_blocks` of them).
            num_cached_blocks: blocks of this table already handled.
            num_full_blocks: blocks of this table whose tokens are all known.

        A block that already has a hash (a prefix-cache hit) is left as it
        is; a block whose hash another block already owns stays uncached; a
        None entry (a sliding-window table's block freed out of the window)
        is skipped.
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= len(blocks) and num_full_blocks <= len(block_hashes)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block is None:
                continue
            if block.block_hash is not None:
                assert block.block_hash == block_hashes[i], "a cached block sits at a position with another hash"
                continue
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use.

        Returns:
            True if the cache was reset, False if some block is still in use.
        """
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop `block` from the prefix cache (its KV will never be written)."""
        self._evict_hash(block)

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        owner = self.cached_block_hash_to_block.pop(block.block_hash, None)
        assert owner is block, "hash map and block hash disagree"
        block.block_hash = None
