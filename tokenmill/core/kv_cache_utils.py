"""Block hashing for prefix caching (pure Python, deterministic across processes).

A block's hash chains its parent's hash with its own token ids, so equal
hashes mean equal whole prefixes, not just equal blocks:

    block 0: h0 = H(None, tokens[0:16],  (cache_salt,))
    block 1: h1 = H(h0,   tokens[16:32], None)
    block 2: h2 = H(h1,   tokens[32:48], None)

`H` is SHA-256 over a pickle of the tuple `(parent_hash, token_ids,
extra_keys)`, truncated to 64 bits. Python's built-in `hash` is not used
because string hashing is salted per process (PYTHONHASHSEED), and the server
runs the engine core in another process than the front end; SHA-256 gives the
same value everywhere. (vLLM v1 uses the same chained scheme,
`vllm/v1/core/kv_cache_utils.py`.)

Only full blocks are hashed: a partial block's tokens are still changing.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from tokenmill.core.request import Request

# Protocol fixed so the bytes (and so the hashes) never depend on the Python default.
_PICKLE_PROTOCOL = 4


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> int:
    """Hash one full block of tokens, chained to its parent block.

    Args:
        parent_hash: hash of the previous block of the same sequence, or None
            for the first block.
        token_ids: the block's `block_size` token ids.
        extra_keys: anything else that changes the block's KV or must isolate
            it (the request's `cache_salt` for the first block); None = none.
            Must be picklable plain data (str, int, tuples of those).

    Returns:
        A non-negative 64-bit int, the same in every process and Python run.
    """
    payload = pickle.dumps((parent_hash, tuple(token_ids), extra_keys), protocol=_PICKLE_PROTOCOL)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def block_extra_keys(request: Request, block_index: int) -> tuple[Any, ...] | None:
    """Extra hash keys of block `block_index` of `request`.

    The cache salt goes into the first block only: every later block chains
    from it, so one salted block isolates the whole sequence (tenant
    isolation: two salts never share a block).
    """
    if block_index == 0 and request.cache_salt is not None:
        return (request.cache_salt,)
    return None


def hash_request_tokens(block_size: int, request: Request) -> list[int]:
    """Hashes of every full block of `request.all_token_ids`, chained, in order.

    Args:
        block_size: tokens per block.
        request: supplies `all_token_ids` (prompt + outputs) and `cache_salt`.

    Returns:
        `len(all_token_ids) // block_size` hashes; a trailing partial block
        gets none.
    """
    hashes: list[int] = []
    _extend_hashes(block_size, request, hashes)
    return hashes


def update_block_hashes(block_size: int, request: Request) -> list[int]:
    """Extend `request.block_hashes` to cover every full block it now has.

    Tokens only ever get appended, so hashes already computed stay valid
    (also across preemption); only the new full blocks are hashed.

    Returns:
        `request.block_hashes` (the same list, extended in place).
    """
    _extend_hashes(block_size, request, request.block_hashes)
    return request.block_hashes


def _extend_hashes(block_size: int, request: Request, hashes: list[int]) -> None:
    tokens = request.all_token_ids
    num_full_blocks = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        block_tokens = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block_tokens, block_extra_keys(request, i))
        hashes.append(parent)
