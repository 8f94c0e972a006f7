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
"""

from __future__ import annotations

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.kv_cache_utils import update_block_hashes
from tokenmill.core.request import Request


class KVCacheManager:
    """Block tables of all requests over one `BlockPool`.

    Args:
        num_blocks: total KV-cache blocks.
        block_size: tokens per block.
        enable_caching: prefix caching on/off.
        max_model_len: longest sequence (prompt + output) in tokens.

    Attributes:
        prefix_cache_queries: cumulative tokens of requests looked up in the
            prefix cache (counted once per (re)admission).
        prefix_cache_hits: cumulative tokens of those found cached.

    Raises:
        ValueError: if `block_size` < 1 or `num_blocks` < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, max_model_len: int = 1 << 62) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}.")
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
        return hits, len(hits) * self.block_size

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
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.block_hash is not None and block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table as block ids (a new list; [] if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no block is in use; returns whether it did."""
        return self.block_pool.reset_prefix_cache()
