"""TORCH_SDPA backend vs a naive float64 reference on random mixed batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend, write_kv_cache
from tokenmill.attention.metadata import AttentionMetadata

POISON = 1e3  # finite junk in unused cache slots: a leak would change outputs a lot


def _make_batch(ctx_lens, query_lens, block_size, num_kv_heads, head_dim, num_blocks, seed, pad_tokens=0):
    """Random cache + new tokens; returns (metadata, kv_cache, full_k, full_v) with full_k[i] = all keys of request i."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), POISON)
    seq_lens = [c + q for c, q in zip(ctx_lens, query_lens)]
    need = [-(-s // block_size) for s in seq_lens]
    perm = rng.permutation(num_blocks)
    max_blocks = max(need) + 2
    block_table = np.zeros((len(seq_lens), max_blocks), np.int32)
    full_k, full_v, new_k, new_v, slots = [], [], [], [], []
    used = 0
    for i, (c, s) in enumerate(zip(ctx_lens, seq_lens)):
        block_table[i, : need[i]] = perm[used : used + need[i]]
        used += need[i]
        k = torch.randn(s, num_kv_heads, head_dim, generator=g)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g)
        pos = np.arange(s)
        slot = block_table[i, pos // block_size].astype(np.int64) * block_size + pos % block_size
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, torch.from_numpy(slot[:c])] = k[:c]
        flat[1, torch.from_numpy(slot[:c])] = v[:c]
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[c:])
        new_v.append(v[c:])
        slots.append(slot[c:])
    key = torch.cat(new_k + [torch.zeros(pad_tokens, num_kv_heads, head_dim)])
    value = torch.cat(new_v + [torch.zeros(pad_tokens, num_kv_heads, head_dim)])
    slot_mapping = np.concatenate(slots + [np.full(pad_tokens, -1)])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    md = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        num_reqs=len(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array(seq_lens, np.int32),
    )
    return md, kv_cache, key, value, full_k, full_v


def _reference(query, md, full_k, full_v, scale, window, cap):
    """Float64, one query at a time, straight from the definition."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    num_heads = query.shape[1]
    for i in range(md.num_reqs):
        start, end = int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1])
        seq_len = int(md.seq_lens_cpu[i])
        k, v = full_k[i].double(), full_v[i].double()
        group = num_heads // k.shape[1]
        for j, t in enumerate(range(start, end)):
            p = seq_len - (end - start) + j
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(num_heads):
                kk, vv = k[lo : p + 1, h // group], v[lo : p + 1, h // group]
                s = kk @ query[t, h].double() * scale
                if cap is not None:
                    s = cap * torch.tanh(s / cap)
                out[t, h] = torch.softmax(s, 0) @ vv
    return out


CASES = [
    # (ctx_lens, query_lens): prefill chunks with prior context, fresh prompts, decodes
    ([0, 21, 0, 40, 7], [9, 13, 1, 1, 1]),
    ([50, 0, 3, 64], [1, 37, 1, 30]),
    ([30, 5, 70, 12, 33], [1, 1, 1, 1, 1]),  # decodes only, lengths out of order
]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 3.0), (24, 2.0)])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(block_size, heads, window, cap, case):
    num_heads, num_kv_heads = heads
    head_dim = 8
    ctx, ql = case
    md, cache, key, value, fk, fv = _make_batch(ctx, ql, block_size, num_kv_heads, head_dim, 40, seed=block_size + num_heads)
    query = torch.randn(md.num_actual_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    ref = _reference(query, md, fk, fv, scale, window, cap)
    # decode_group_keys 48: decodes of different lengths share groups (padding masked) or get one each.
    for backend in (TorchSDPABackend(), TorchSDPABackend(kv_tile_size=1, decode_tile_budget=1, use_sdpa_prefill=False),
                    TorchSDPABackend(decode_group_keys=48)):
        c = cache.clone()
        out = backend.forward(query, key, value, c, md, scale=scale, sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_writes_new_kv_and_skips_padding():
    md, cache, key, value, _, _ = _make_batch([5, 0], [3, 1], 16, 2, 4, 12, seed=3, pad_tokens=2)
    before = cache.clone()
    query = torch.randn(key.shape[0], 2, 4)
    out = TorchSDPABackend().forward(query, key, value, cache, md, scale=0.5)
    flat, flat_before = cache.view(2, -1, 2, 4), before.view(2, -1, 2, 4)
    slots = md.slot_mapping[: md.num_actual_tokens]
    torch.testing.assert_close(flat[0, slots], key[: md.num_actual_tokens])
    torch.testing.assert_close(flat[1, slots], value[: md.num_actual_tokens])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])  # padding (-1) wrote nowhere
    assert torch.equal(out[md.num_actual_tokens :], torch.zeros_like(out[md.num_actual_tokens :]))


def test_write_kv_cache_skips_minus_one_anywhere():
    cache = torch.zeros(2, 3, 4, 1, 2)
    key = torch.arange(6.0).view(3, 1, 2) + 1
    write_kv_cache(key, -key, cache, torch.tensor([5, -1, 0]))
    flat = cache.view(2, -1, 1, 2)
    assert torch.equal(flat[0, 5], key[0]) and torch.equal(flat[0, 0], key[2])
    assert int((flat[0] != 0).any(-1).any(-1).sum()) == 2


def test_long_context_is_tiled():
    """A tiled run never multiplies by more than one tile of keys, and matches the one-tile run."""
    block_size, tile = 16, 32
    md, cache, key, value, _, _ = _make_batch([300, 250, 0], [20, 1, 1], block_size, 2, 8, 64, seed=5)
    query = torch.randn(md.num_actual_tokens, 4, 8)
    big = TorchSDPABackend(kv_tile_size=10_000, use_sdpa_prefill=False)
    small = TorchSDPABackend(kv_tile_size=tile, decode_tile_budget=2 * tile, use_sdpa_prefill=False)
    ref = big.forward(query, key, value, cache.clone(), md, scale=0.3, sliding_window=None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out = small.forward(query, key, value, cache.clone(), md, scale=0.3, sliding_window=None)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Score matmuls are bmm(q [.., rows, D], k [.., D, keys]): their key width is bounded by the tile.
    key_lens = [ev.input_shapes[1][-1] for ev in prof.events() if ev.name == "aten::bmm" and ev.input_shapes[1][-2] == 8]
    assert key_lens and max(key_lens) <= tile, key_lens
    assert math.isfinite(float(out.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_reference(dtype):
    md, cache, key, value, fk, fv = _make_batch([0, 21, 40, 7, 300], [9, 13, 1, 1, 1], 16, 2, 64, 64, seed=9, pad_tokens=3)
    query = torch.randn(key.shape[0], 8, 64)
    ref = _reference(query, md, fk, fv, 0.125, 32, None)
    dev = torch.device("cuda")
    md_dev = AttentionMetadata(
        md.num_actual_tokens, md.num_reqs, md.max_query_len, md.max_seq_len, md.query_start_loc.to(dev),
        md.seq_lens.to(dev), md.block_table.to(dev), md.slot_mapping.to(dev), md.query_start_loc_cpu, md.seq_lens_cpu,
    )
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for backend in (TorchSDPABackend(), TorchSDPABackend(kv_tile_size=16, decode_tile_budget=32)):
        out = backend.forward(query.to(dev, dtype), key.to(dev, dtype), value.to(dev, dtype),
                              cache.to(dev, dtype), md_dev, scale=0.125, sliding_window=32)
        n = md.num_actual_tokens
        torch.testing.assert_close(out[:n].double().cpu(), ref[:n], atol=tol, rtol=tol)


def test_plan_is_reused_across_layers_and_windows():
    """Layers with different windows in one step (Gemma-3 style) each get their own plan, built once."""
    md, cache, key, value, fk, fv = _make_batch([30, 12], [1, 1], 16, 2, 8, 16, seed=4, pad_tokens=2)
    query = torch.randn(key.shape[0], 4, 8)
    be = TorchSDPABackend()
    for window in (None, 6, None, 6):
        out = be.forward(query, key, value, cache.clone(), md, scale=0.3, sliding_window=window)
        ref = _reference(query, md, fk, fv, 0.3, window, None)
        torch.testing.assert_close(out[:2].double(), ref[:2], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert [p.window for p in be._plans] == [None, 6]


def test_sync_free_padding_redirect_writes_only_valid_slots():
    from tokenmill.attention.backends.torch_sdpa import _redirect_padding

    key = torch.arange(8.0).view(4, 1, 2) + 1
    slots, k, _ = _redirect_padding(torch.tensor([-1, 7, -1, 9]), key, -key)
    assert slots.tolist() == [7, 7, 7, 9]
    cache = torch.zeros(2, 3, 4, 1, 2)
    flat = cache.view(2, -1, 1, 2)
    flat[0].index_copy_(0, slots, k)
    assert torch.equal(flat[0, 7], key[1]) and torch.equal(flat[0, 9], key[3])
    assert int((flat[0] != 0).any(-1).any(-1).sum()) == 2
