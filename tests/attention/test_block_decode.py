"""Block-wise decode attention straight from the paged cache (CPU float32) vs a float64 reference.

The backend is built with use_cpu_kernel=False here: these tests are about the PyTorch path
(`block_decode`); the C kernel has its own tests (test_cpu_decode_kernel.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.attention.backends.block_decode import block_decode_attention, plan_block_decode
from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata

POISON = 1e3  # finite junk in unused cache slots and unowned blocks: a leak would change outputs a lot
BS = 4  # block size: small, so a dozen-token row spans several blocks


def _batch(tables: list[list[int]], seq_lens: list[int], num_blocks: int, num_kv_heads: int, head_dim: int, seed: int):
    """Decode-only metadata and a cache whose every slot is POISON except the rows' tokens (random)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, num_blocks, BS, num_kv_heads, head_dim), POISON)
    for table, n in zip(tables, seq_lens):
        for pos in range(n):
            b, o = table[pos // BS], pos % BS
            cache[:, b, o] = torch.randn(2, num_kv_heads, head_dim, generator=g)
    bt = np.zeros((len(tables), max(map(len, tables)) + 1), np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    n = len(tables)
    qsl = np.arange(n + 1, dtype=np.int32)
    sl = np.array(seq_lens, np.int32)
    # The new token of each row is already in the cache; slot -1 keeps forward() from rewriting it.
    md = AttentionMetadata(n, n, 1, int(sl.max()), torch.from_numpy(qsl), torch.from_numpy(sl), torch.from_numpy(bt),
                           torch.full((n,), -1, dtype=torch.int64), qsl, sl)
    return md, cache


def _reference(query, cache, tables, seq_lens, scale, window=None, cap=None):
    """[B, H, D] float64, one row at a time from the definition (HF's window: keys > p - W).

    tables: each row's physical block ids (a list or a tensor row); the block size is the cache's.
    Also the reference of the C kernel's tests (test_cpu_decode_kernel.py).
    """
    block_size, group = cache.shape[2], query.shape[1] // cache.shape[3]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, (table, n) in enumerate(zip(tables, seq_lens)):
        pos = torch.arange(n)
        keys = cache[:, torch.as_tensor(table).long()[pos // block_size], pos % block_size].double()  # [2, n, Hkv, D]
        k, v = keys[0].repeat_interleave(group, 1), keys[1].repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", query[i].double(), k) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        if window is not None:
            s[:, pos <= n - 1 - window] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


# Rows 0-2 were allocated one after another (a dense run 2..13 with block 7 unowned: another request's);
# all three share block 2 (a common prefix); row 3 lies in scattered blocks.
TABLES = [[2, 3, 4], [2, 5, 6, 8], [2, 9, 10, 11, 12, 13], [40, 31, 50]]
SEQ_LENS = [10, 16, 22, 9]


# Window 6 leaves too few blocks for a run (everything gathered); window 11 drops the shared block.
@pytest.mark.parametrize("window, cap, los", [(None, None, [2, -1]), (6, None, [-1]), (None, 5.0, [2, -1]),
                                              (11, 30.0, [2, -1])])
def test_matches_reference(window, cap, los):
    md, cache = _batch(TABLES, SEQ_LENS, 64, 2, 8, seed=0)
    query = torch.randn(len(TABLES), 6, 8, generator=torch.Generator().manual_seed(1))
    plan = plan_block_decode(md.block_table.numpy(), np.arange(4), np.arange(4), np.array(SEQ_LENS, np.int64), BS, window)
    # A run viewed in place (2 = its first block), and a gathered rest (-1): the shared block's later
    # uses and row 3's scattered blocks.
    assert [s.lo for s in plan.sources] == los
    out = block_decode_attention(query, cache, plan, 0.35, cap)
    torch.testing.assert_close(out.double(), _reference(query, cache, TABLES, SEQ_LENS, 0.35, window, cap),
                               atol=1e-5, rtol=1e-5)
    # Through the backend (its default on CPU float32), also with the grouped-gather path for comparison.
    for backend in (TorchSDPABackend(use_cpu_kernel=False), TorchSDPABackend(decode_from_cache=False)):
        got = backend.forward(query, query[:, :2], query[:, :2], cache.clone(), md, scale=0.35,
                              sliding_window=window, logits_soft_cap=cap)
        torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)


def test_runs_and_owners():
    """A run of >= 8 used blocks is a view; ids it skips get owner B (dropped); a far block is gathered."""
    table = np.array([[10, 11, 12, 13, 0, 0], [14, 16, 17, 18, 19, 500]])
    plan = plan_block_decode(table, np.arange(2), np.array([7, 3]), np.array([16, 24]), 4, None)
    view, rest = plan.sources
    assert (view.start, view.n, view.lo, view.block_ids) == (0, 10, 10, None)
    assert (rest.start, rest.n, rest.lo, rest.block_ids.tolist()) == (10, 1, -1, [500])
    assert plan.owner.tolist() == [0, 0, 0, 0, 1, 2, 1, 1, 1, 1, 1]  # block 15: no row (2 = B)
    assert plan.token.tolist() == [7, 7, 7, 7, 3, 7, 3, 3, 3, 3, 3]  # queries' token rows; B borrows row 0's
    # Row 0's block 13 holds keys 12..15, its query is at 15: all visible; block 15 (no row) is never masked;
    # row 1's last block (500) holds keys 20..23, all visible to its query at position 23.
    for b in (3, 5, 10):
        assert torch.equal(plan.bias[b], torch.zeros(1, 1, 4))
    # Row 1's second-to-last block (19) holds keys 16..19: visible; nothing past seq_len exists here.
    assert not torch.isinf(plan.bias).any()


def test_far_below_max_scores_underflow_to_zero():
    """Scores 1000s below the row max (exp underflows) give weight 0, no NaN."""
    md, cache = _batch(TABLES, SEQ_LENS, 64, 2, 8, seed=2)
    query = torch.randn(len(TABLES), 6, 8, generator=torch.Generator().manual_seed(3)) * 300
    plan = plan_block_decode(md.block_table.numpy(), np.arange(4), np.arange(4), np.array(SEQ_LENS, np.int64), BS, None)
    out = block_decode_attention(query, cache, plan, 1.0, None)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(query, cache, TABLES, SEQ_LENS, 1.0), atol=1e-5, rtol=1e-5)


def test_step_buffers_serve_every_layer():
    """Layers of one step share the plan and its buffers; each layer still gets its own queries and cache."""
    md, cache = _batch(TABLES, SEQ_LENS, 64, 2, 8, seed=4)
    backend = TorchSDPABackend(use_cpu_kernel=False)
    g = torch.Generator().manual_seed(5)
    for layer in range(3):
        layer_cache = cache * (1 + layer) if layer else cache  # POISON scales too: still junk
        query = torch.randn(len(TABLES), 6, 8, generator=g)
        out = backend.forward(query, query[:, :2], query[:, :2], layer_cache, md, scale=0.35)
        torch.testing.assert_close(out.double(), _reference(query, layer_cache, TABLES, SEQ_LENS, 0.35),
                                   atol=1e-5, rtol=1e-5)
    assert len(backend._plans) == 1  # planned once for the step


def test_bfloat16_cache_matches_reference():
    """A bfloat16 cache is read in place too: bfloat16 matmuls, float32 softmax, within bfloat16 error."""
    md, cache = _batch(TABLES, SEQ_LENS, 64, 2, 8, seed=6)
    cache = cache.bfloat16()
    query = torch.randn(len(TABLES), 6, 8, generator=torch.Generator().manual_seed(7)).bfloat16()
    ref = _reference(query, cache, TABLES, SEQ_LENS, 0.35)
    plan = plan_block_decode(md.block_table.numpy(), np.arange(4), np.arange(4), np.array(SEQ_LENS, np.int64), BS, None)
    out = block_decode_attention(query, cache, plan, 0.35, None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # The backend routes bfloat16 decodes here and returns bfloat16; the grouped-gather path agrees.
    got = TorchSDPABackend(use_cpu_kernel=False).forward(query, query[:, :2], query[:, :2], cache.clone(), md,
                                                         scale=0.35)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, out.bfloat16())
    gathered = TorchSDPABackend(decode_from_cache=False).forward(query, query[:, :2], query[:, :2], cache.clone(), md,
                                                                 scale=0.35)
    torch.testing.assert_close(got.double(), gathered.double(), atol=2e-2, rtol=2e-2)
