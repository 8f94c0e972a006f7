"""KVCacheManager: hands out KV-cache blocks per request and finds prefix-cache hits.

Each request owns an append-only block table (a list of `KVCacheBlock`).
Token position p lives in block `table[p // block_size]`, slot
`p % block_size`. A request holding `n` tokens of KV needs
`ceil(n / block_size)` blocks:

    block_size = 4, num_computed_tokens = 5, num_new_tokens = 6
    | b0: t0 t1 t2 t3 | b1: t4 t5 t6 t7 | b2: t8 t9 t10 __ |
      computed: t0..t4     new: t5..t10 -> 3 blocks needed

Prefix caching: once all tokens of a block are known (prompt tokens, or
output tokens already sampled), the block is entered into the pool's hash
map under its chained hash, even before the worker has written its KV: the
worker writes every new token's KV before any attention read in the same
layer, so a request scheduled in the same step may already share it.

Sliding-window group (`sliding_window` set: a model whose layers are half
full attention, half sliding window, as gpt-oss; vLLM's "hybrid allocator"
in its smallest form). Each request then has a second table for the
sliding-window layers, over the same pool: the worker pairs each
sliding-window layer with a full-attention layer on one KV tensor, so a
block id belongs to one group at a time. The second table keeps only the
blocks that a query at or after `num_computed_tokens` can still see: with
window W, a query at position p sees (p - W, p], so blocks wholly before
position `num_computed_tokens - W + 1` are freed when the request next
allocates (their entries become None; the worker keeps the stale ids, which
attention never reads):

    W = 6, block_size 4, num_computed_tokens 13, 3 new tokens (13..15)
    full table | b0 | b1 | b2 | b3 |
    swa table  | -- | -- | b6 | b7 |   first visible: 13 - 6 + 1 = 8 -> blocks before 8 // 4 = 2 freed

Prefix caching with a sliding-window group: each group has its own cache
entries (a sliding-window block holds other layers' KV than a full one), the
sliding-window group's under the block hash with bit 64 set (`_SWA_TAG`;
the chained hashes are 64-bit). A hit of n blocks needs the full group's
blocks 0..n-1 and, in the sliding-window group, only the blocks the first
computed query can see, (n * bs - W, n * bs - 1] (earlier entries are None):

    W = 6, block_size 4, n = 3: first query at 12 sees 7..12 -> blocks 1, 2
    full hits | b0 | b1 | b2 |        swa hits | -- | s1 | s2 |

`get_computed_blocks` returns the longest such n (full blocks) and keeps the
sliding-window part for the admitting `allocate_slots`.
"""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.kv_cache_utils import update_block_hashes
from tokenmill.core.request import Request

_SWA_TAG = 1 << 64  # sliding-window group cache key = block hash | _SWA_TAG (block hashes are 64-bit)


class KVCacheManager:
    """Block tables of all requests over one `BlockPool`.

    Args:
        num_blocks: total KV-cache blocks.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        max_model_len: longest sequence (prompt + output) in tokens.
        sliding_window: the window of the sliding-window layer group (module
            docstring), or None for one group.

    Attributes:
        prefix_cache_queries: cumulative tokens of requests looked up in the
            prefix cache (counted once per (re)admission).
        prefix_cache_hits: cumulative tokens of those found cached.

    Raises:
        ValueError: if `block_size` < 1 or `num_blocks` < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, max_model_len: int = 1 << 62,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}.")
        self.sliding_window = sliding_window
        # req_id -> sliding-window group table (None = freed, out of the window)
        self.swa_tables: dict[str, list[KVCacheBlock | None]] = {}
        # req_id -> sliding-window block ids appended by its latest allocate_slots (pop_new_swa_block_ids)
        self._new_swa_ids: dict[str, list[int]] = {}
        # req_id -> sliding-window part of the hit found by its latest get_computed_blocks (taken on admission)
        self._swa_hits: dict[str, list[KVCacheBlock | None]] = {}
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # req_id -> block table
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> leading blocks of its table already entered into the hash map
        self.num_cached_block: dict[str, int] = {}
        # req_id -> the largest span end (num_computed_tokens + num_new_tokens)
        # for which allocate_slots has nothing to do: the blocks held cover it
        # and no block that is not cached yet fills below it.
        #   block_size 4, 3 blocks held, 2 cached -> min(3 * 4, 3 * 4 - 1) = 11
        # The scheduler reads it to skip the call on most decode steps.
        self.noop_end: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of the request's leading full blocks already cached.

        The last token of the request is never served from the cache (the
        model must run on it to produce the next token's logits), so a prompt
        that is entirely cached backs off by one block: a 32-token prompt
        with block_size 16 hits at most 16 tokens.

        Does not take references; pass the blocks to `allocate_slots`, which
        does. Call only for a request that holds no blocks (new or preempted).

        With a sliding-window group the hit also needs that group's blocks in
        the window before it (module docstring); their list is kept for the
        admitting `allocate_slots`.

        Returns:
            (blocks, num_computed_tokens): the hit blocks in order and
            `len(blocks) * block_size`; ([], 0) with caching off, or for a
            request that wants prompt_logprobs and has generated nothing yet.
        """
        if not self.enable_caching or (request.sampling_params.prompt_logprobs is not None
                                       and not request.output_token_ids):
            # Prompt logprobs need the logits of every prompt position (worker/prompt_logprobs.py).
            return [], 0
        block_hashes = update_block_hashes(self.block_size, request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.sliding_window is not None:
            hits, self._swa_hits[request.request_id] = self._window_hits(block_hashes, hits)
        return hits, len(hits) * self.block_size

    def _window_hits(self, block_hashes: list[int],
                     full_hits: list[KVCacheBlock]) -> tuple[list[KVCacheBlock], list[KVCacheBlock | None]]:
        """The longest n <= len(full_hits) whose window blocks are cached in the sliding-window group:
        (full_hits[:n], swa table prefix of n entries, None before the window)."""
        assert self.sliding_window is not None
        block_size = self.block_size
        for n in range(len(full_hits), 0, -1):
            first = max(0, n * block_size - self.sliding_window + 1) // block_size
            window = [self.block_pool.get_cached_block(h | _SWA_TAG) for h in block_hashes[first:n]]
            if all(b is not None for b in window):
                return full_hits[:n], [None] * first + window
        return [], []

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Spans of the request's tokens (all in token positions):

            | num_computed_tokens | num_new_computed_tokens | num_new_tokens |
              already held blocks   prefix-cache hits (free)  to compute now

        Args:
            request: its `num_computed_tokens` must match the blocks it holds.
            num_new_tokens: tokens to compute this step (> 0).
            num_new_computed_tokens: tokens covered by `new_computed_blocks`
                (only on admission).
            new_computed_blocks: prefix-cache hits from `get_computed_blocks`.

        Returns:
            Ids of the blocks appended to the request's block table (hits
            first, then fresh blocks; [] when none were needed), or None when
            too few blocks are free, in which case nothing was allocated or
            referenced.
        """
        assert num_new_tokens > 0
        block_size = self.block_size
        req_id = request.request_id
        num_end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        assert num_end <= self.max_model_len, "scheduled past max_model_len"
        if num_end <= self.noop_end.get(req_id, -1) and not new_computed_blocks:
            return []  # most decode steps
        if self.sliding_window is not None:
            return self._allocate_hybrid(request, num_end, num_new_computed_tokens, new_computed_blocks)
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is None:
            new_computed_blocks = self._admit(request, num_new_computed_tokens, new_computed_blocks, num_end)
            if new_computed_blocks is None:
                return None
            req_blocks = self.req_to_blocks[request.request_id]
            new_block_ids = [b.block_id for b in req_blocks]
        else:
            # A running request (the common case: one decode token).
            assert not new_computed_blocks, "prefix-cache hits are only taken on admission"
            num_fresh = -(-num_end // block_size) - len(req_blocks)
            new_block_ids = []
            if num_fresh > 0:
                if num_fresh > self.block_pool.get_num_free_blocks():
                    return None
                fresh = self.block_pool.get_new_blocks(num_fresh)
                req_blocks.extend(fresh)
                new_block_ids = [b.block_id for b in fresh]

        if self.enable_caching:
            # Tokens of the scheduled span are prompt or already-sampled tokens: known now.
            num_full_blocks = min(num_end, request.num_tokens) // block_size
            num_cached = self.num_cached_block[request.request_id]
            if num_full_blocks > num_cached:
                block_hashes = update_block_hashes(block_size, request)
                self.block_pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full_blocks)
                self.num_cached_block[request.request_id] = num_full_blocks
        self._set_noop_end(req_id, len(req_blocks))
        return new_block_ids

    def _allocate_hybrid(self, request: Request, num_end: int, num_new_computed_tokens: int,
                         new_computed_blocks: list[KVCacheBlock] | None) -> list[int] | None:
        """allocate_slots with a sliding-window group: on admission take both groups' hits; free the blocks
        that slid out of the window; then take fresh blocks for both tables, or nothing."""
        req_id, block_size = request.request_id, self.block_size
        assert self.sliding_window is not None
        hits = new_computed_blocks or []
        swa_hits = self._swa_hits.pop(req_id, []) if hits else []
        assert len(swa_hits) == len(hits) and num_new_computed_tokens == len(hits) * block_size
        assert not hits or req_id not in self.req_to_blocks, "prefix-cache hits are only taken on admission"
        req_blocks = self.req_to_blocks.get(req_id, [])
        swa = self.swa_tables.get(req_id, [])
        first_visible = max(0, request.num_computed_tokens - self.sliding_window + 1)
        gone = [b for b in swa[: first_visible // block_size] if b is not None]
        if gone:
            for j in range(first_visible // block_size):
                swa[j] = None
            self.block_pool.free_blocks(reversed(gone))
        num_needed = -(-num_end // block_size)
        num_full = num_needed - len(req_blocks) - len(hits)
        num_swa = num_needed - len(swa) - len(swa_hits)
        held = [b for b in hits + swa_hits if b is not None]
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in held if b.ref_cnt == 0)
        if max(num_full, 0) + max(num_swa, 0) > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None
        # Touch the hits before taking fresh blocks so taking cannot evict them.
        self.block_pool.touch(held)
        req_blocks = self.req_to_blocks.setdefault(req_id, req_blocks)
        swa = self.swa_tables.setdefault(req_id, swa)
        if req_id not in self.num_cached_block:
            self.num_cached_block[req_id] = 0
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        req_blocks.extend(hits)
        swa.extend(swa_hits)
        new_ids = [b.block_id for b in hits]
        if num_full > 0:
            fresh = self.block_pool.get_new_blocks(num_full)
            req_blocks.extend(fresh)
            new_ids += [b.block_id for b in fresh]
        swa_ids: list[int] = []
        if num_swa > 0:
            fresh = self.block_pool.get_new_blocks(num_swa)
            swa.extend(fresh)
            swa_ids = [b.block_id for b in fresh]
        self._new_swa_ids[req_id] = swa_ids
        if self.enable_caching:
            num_full_blocks = min(num_end, request.num_tokens) // block_size
            num_cached = self.num_cached_block[req_id]
            if num_full_blocks > num_cached:
                block_hashes = update_block_hashes(block_size, request)
                self.block_pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full_blocks)
                swa_hashes = [h | _SWA_TAG for h in block_hashes[:num_full_blocks]]
                self.block_pool.cache_full_blocks(swa, swa_hashes, num_cached, num_full_blocks)
                self.num_cached_block[req_id] = num_full_blocks
        self._set_noop_end(req_id, len(req_blocks))
        return new_ids

    def pop_new_swa_block_ids(self, req_id: str) -> list[int]:
        """Sliding-window block ids appended by the request's latest allocate_slots ([] if none or no group)."""
        return self._new_swa_ids.pop(req_id, [])

    def num_swa_blocks(self, req_id: str) -> int:
        """Blocks the request holds in its sliding-window table."""
        return sum(1 for b in self.swa_tables.get(req_id, ()) if b is not None)

    def _set_noop_end(self, req_id: str, num_blocks: int) -> None:
        end = num_blocks * self.block_size
        if self.enable_caching:
            # One token short of filling the first block not cached yet.
            first_uncached_fills_at = (self.num_cached_block[req_id] + 1) * self.block_size
            end = end if end < first_uncached_fills_at else first_uncached_fills_at - 1
        self.noop_end[req_id] = end

    def _admit(
        self, request: Request, num_new_computed_tokens: int, new_computed_blocks: list[KVCacheBlock] | None, num_end: int
    ) -> list[KVCacheBlock] | None:
        """First allocation of a request: take its hits and fresh blocks, or nothing."""
        hits = new_computed_blocks or []
        assert num_new_computed_tokens == len(hits) * self.block_size
        num_fresh = -(-num_end // self.block_size) - len(hits)
        # Hits sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_fresh > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None
        # Touch the hits before taking fresh blocks so taking cannot evict them.
        self.block_pool.touch(hits)
        self.req_to_blocks[request.request_id] = hits + self.block_pool.get_new_blocks(num_fresh)
        self.num_cached_block[request.request_id] = 0
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        return hits

    def free(self, request: Request) -> None:
        """Release all blocks of `request` (tail block first into the LRU queue).

        Freed blocks keep their hashes, so they remain prefix-cache hits
        until reused. Freeing a request that holds nothing does nothing.

        Blocks were cached when scheduled, before their KV was written. If a
        request is freed with a step scheduled but not run (the scheduler
        undoing a preemption victim), blocks past its `num_computed_tokens`
        were cached but will never be written: they leave the cache here.

            num_computed_tokens = 20, block_size = 16
            | b0: 0..15 computed | b1: 16..31 cached this step, unwritten |
                 stays cached       uncached on free (only holder)
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self.noop_end.pop(request.request_id, None)
        self._new_swa_ids.pop(request.request_id, None)
        self._swa_hits.pop(request.request_id, None)
        swa = self.swa_tables.pop(request.request_id, None)
        if swa:
            for block in swa[request.num_computed_tokens // self.block_size :]:
                if block is not None and block.block_hash is not None and block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
            self.block_pool.free_blocks(reversed([b for b in swa if b is not None]))
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str, swa: bool = False) -> list[int]:
        """The request's block table as block ids (a new list; [] if it holds none); `swa`: its
        sliding-window table, freed entries as 0 (never read)."""
        if swa:
            return [b.block_id if b is not None else 0 for b in self.swa_tables.get(req_id, ())]
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no block is in use; returns whether it did."""
        return self.block_pool.reset_prefix_cache()
