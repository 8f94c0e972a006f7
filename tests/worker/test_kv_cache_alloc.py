"""allocate_kv_caches on CPU: lazily committed zeros (platforms/memory.py `lazy_zeros`) that look exactly like
torch.zeros to the engine: shape, dtype, contiguity, zeros, writable, shared pairs with a sliding-window group."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from tokenmill.worker.kv_cache import KVCacheSpec, allocate_kv_caches

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_cpu_caches_are_zeroed_writable_and_blocks_are_independent(dtype):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=dtype)
    caches = allocate_kv_caches(spec, 5, CPU)
    assert len(caches) == 2 and caches[0].data_ptr() != caches[1].data_ptr()
    for c in caches:
        assert c.shape == (2, 5, 16, 2, 8) and c.dtype == dtype and c.device == CPU and c.is_contiguous()
        if sys.platform == "linux":  # lazy_zeros' anonymous mmap (torch.zeros is only 64-byte aligned)
            assert c.data_ptr() % mmap.PAGESIZE == 0
        assert int(c.view(torch.uint8).count_nonzero()) == 0
    caches[1][0, 3] = torch.ones(16, 2, 8).to(dtype)  # keys of block 3 in layer 1
    nonzero = [c.view(torch.uint8).ne(0).flatten(2).any(dim=2) for c in caches]  # [2, num_blocks] per layer
    assert nonzero[0].tolist() == [[False] * 5, [False] * 5]
    assert nonzero[1].tolist() == [[False, False, False, True, False], [False] * 5]
    assert caches[1][0, 3].float().eq(1.0).all()


def test_sliding_window_pairs_share_one_tensor_and_earlier_stages_get_placeholders():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=1, head_dim=4, block_size=16, dtype=torch.float32,
                       full_layers=(0, 2), swa_layers=(1, 3))
    caches = allocate_kv_caches(spec, 3, CPU)
    assert caches[0] is caches[1] and caches[2] is caches[3] and caches[0].data_ptr() != caches[2].data_ptr()
    caches[1][1, 2].fill_(5.0)
    assert float(caches[0][1, 2].sum()) == 5.0 * 16 * 4 and float(caches[2].abs().sum()) == 0.0

    staged = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16, dtype=torch.float32,
                         first_layer=3)
    caches = allocate_kv_caches(staged, 3, CPU)
    assert [tuple(c.shape) for c in caches] == [(0,)] * 3 + [(2, 3, 16, 1, 4)] * 2
