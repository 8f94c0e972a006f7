"""Triton KV-cache write vs direct indexing; slot -1 must leave the cache untouched."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.triton.reshape_and_cache import reshape_and_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 16), (3, 24, 32), (1, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_writes_slots_and_skips_padding(num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(num_kv_heads * 100 + head_dim)
    num_blocks, num_tokens = 5, 11
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    # Key/value as views with a token stride wider than heads * dim, as after a fused QKV split.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 5, 10]] = -1  # padding tokens
    kv_dev = kv_cache.to(DEVICE)
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), kv_dev, slots.to(DEVICE))
    got = kv_dev.cpu()

    flat = got.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    real = slots >= 0
    assert torch.equal(flat[0, slots[real]], key[real])
    assert torch.equal(flat[1, slots[real]], value[real])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.isnan(flat[:, untouched]).all(), "a slot not in slot_mapping was written"


def test_empty_batch_is_a_no_op():
    kv_cache = torch.zeros(2, 2, 16, 1, 16, device=DEVICE)
    empty = torch.zeros(0, 1, 16, device=DEVICE)
    reshape_and_cache(empty, empty, kv_cache, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.count_nonzero(kv_cache) == 0
