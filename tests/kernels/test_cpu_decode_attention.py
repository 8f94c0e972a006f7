"""The C decode-attention kernel (tokenmill/kernels/cpu/decode.py, decode_attention.c) vs a float64 reference.

Shapes cover the vector path (head_dim 64 / 128, 1-8 query heads per KV
head), the plain-C path (other head sizes and groups), partial blocks,
sliding windows, soft-capping, scattered and shared blocks. The kernel is
built by the system C compiler; without one these tests skip, and the
engine runs the PyTorch path (`block_decode`, tested in test_block_decode.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.attention.test_block_decode import _reference  # the float64 reference, one row at a time
from tokenmill.attention.backends.block_decode import block_decode_attention, plan_block_decode
from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels.cpu import decode as cpu_decode
from tokenmill.kernels.cpu import build as cpu_build

POISON = 1e3  # finite junk in every slot no row owns: a leak would change the outputs a lot


@pytest.fixture(scope="module")
def lib(require_cpu_kernel):
    return require_cpu_kernel(cpu_decode.load_kernel, cpu_decode._SOURCE)


def _batch(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed, shared_prefix_blocks=0):
    """Random rows in scattered blocks (optionally all sharing their first blocks); POISON elsewhere."""
    rng = np.random.default_rng(seed)
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks) + 8
    perm = rng.permutation(total).tolist()
    shared = [perm.pop() for _ in range(shared_prefix_blocks)]
    table = np.zeros((len(seq_lens), max(nblocks) + 2), np.int32)
    for i, nb in enumerate(nblocks):
        own = shared[:nb] + [perm.pop() for _ in range(max(0, nb - len(shared)))]
        table[i, :nb] = own
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((2, total, block_size, num_kv_heads, head_dim), POISON)
    for i, n in enumerate(seq_lens):
        for pos in range(n):
            b = table[i, pos // block_size]
            cache[:, b, pos % block_size] = torch.randn(2, num_kv_heads, head_dim, generator=g)
    return torch.from_numpy(table), cache.to(dtype)


def _run(lib, query, cache, table, seq_lens, scale, window=None, cap=None, rows=None, out=None):
    n = len(seq_lens)
    rows = torch.arange(n) if rows is None else rows
    out = torch.full_like(query, 7.0) if out is None else out
    cpu_decode.paged_decode_attention(lib, query, cache, table, torch.arange(n), rows,
                                      torch.tensor(seq_lens, dtype=torch.int64), scale, out, window, cap)
    return out


# Lengths around block and 16-key chunk edges, a one-key row, and a long one.
SEQ_LENS = [1, 15, 16, 17, 33, 70, 200]


@pytest.mark.parametrize("heads, head_dim", [((4, 4), 64), ((9, 3), 64), ((8, 2), 128), ((16, 2), 64),
                                             ((6, 1), 128), ((10, 1), 64), ((6, 2), 96), ((4, 2), 8)])
@pytest.mark.parametrize("block_size", [16, 32, 5])
def test_float32_matches_reference(lib, heads, head_dim, block_size):
    """Vector path (64/128, G <= 8) and plain-C path (G 10, head_dim 96 / 8) agree with float64."""
    num_heads, num_kv_heads = heads
    table, cache = _batch(SEQ_LENS, num_kv_heads, head_dim, block_size, torch.float32, seed=block_size + num_heads)
    query = torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    out = _run(lib, query, cache, table, SEQ_LENS, scale)
    torch.testing.assert_close(out.double(), _reference(query, cache, table, SEQ_LENS, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window, cap", [(6, None), (None, 5.0), (40, 2.0), (1, None)])
@pytest.mark.parametrize("head_dim", [64, 8])
def test_window_and_soft_cap(lib, window, cap, head_dim):
    table, cache = _batch(SEQ_LENS, 2, head_dim, 16, torch.float32, seed=3, shared_prefix_blocks=1)
    query = torch.randn(len(SEQ_LENS), 6, head_dim, generator=torch.Generator().manual_seed(4))
    out = _run(lib, query, cache, table, SEQ_LENS, 0.3, window, cap)
    ref = _reference(query, cache, table, SEQ_LENS, 0.3, window, cap)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_bfloat16_matches_reference_and_block_decode(lib, head_dim):
    """bfloat16 cache and query: within bfloat16 error of float64, and close to the PyTorch path."""
    table, cache = _batch(SEQ_LENS, 3, head_dim, 16, torch.bfloat16, seed=5, shared_prefix_blocks=2)
    query = torch.randn(len(SEQ_LENS), 9, head_dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    scale = head_dim**-0.5
    out = _run(lib, query, cache, table, SEQ_LENS, scale)
    assert out.dtype == torch.bfloat16
    ref = _reference(query, cache, table, SEQ_LENS, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    plan = plan_block_decode(table.numpy(), np.arange(len(SEQ_LENS)), np.arange(len(SEQ_LENS)),
                             np.array(SEQ_LENS, np.int64), 16, None)
    torch.testing.assert_close(out.double(), block_decode_attention(query, cache, plan, scale, None).double(),
                               atol=1e-2, rtol=1e-2)


def _round_bf16_reference(query, cache, table, seq_lens, scale):
    """float64, rounding where the kernel says it rounds: q.k to bfloat16, probabilities to bfloat16."""
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n)
        kv = cache[:, table[i].long()[pos // block_size], pos % block_size].double()
        k, v = kv[0].repeat_interleave(group, 1), kv[1].repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", query[i].double(), k).float().bfloat16().float() * scale
        p = s.softmax(-1).bfloat16().double()
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


def test_bfloat16_rounds_where_it_says(lib):
    """Within a few bfloat16 ulps of a reference that rounds at the documented points, and measurably
    farther from one that does not (so dropping a rounding would show)."""
    table, cache = _batch(SEQ_LENS, 2, 64, 16, torch.bfloat16, seed=20)
    query = (torch.randn(len(SEQ_LENS), 8, 64, generator=torch.Generator().manual_seed(21)) * 3).bfloat16()
    out = _run(lib, query, cache, table, SEQ_LENS, 0.125).double()
    near = (out - _round_bf16_reference(query, cache, table, SEQ_LENS, 0.125)).abs().max().item()
    far = (out - _reference(query, cache, table, SEQ_LENS, 0.125)).abs().max().item()
    assert near < 0.02 and near < far / 2, (near, far)


@pytest.mark.parametrize("window", [7, 40])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_window_starts_at_odd_keys(lib, window, head_dim):
    """bfloat16 P @ V takes keys in pairs (vdpbf16ps where the CPU has it): windows that start at odd
    positions inside a block, odd key counts and pairs that straddle two blocks stay within bfloat16 error."""
    table, cache = _batch(SEQ_LENS, 3, head_dim, 16, torch.bfloat16, seed=30)
    query = torch.randn(len(SEQ_LENS), 9, head_dim, generator=torch.Generator().manual_seed(31)).bfloat16()
    out = _run(lib, query, cache, table, SEQ_LENS, 0.125, window=window)
    ref = _reference(query, cache, table, SEQ_LENS, 0.125, window=window)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_strided_queries_and_permuted_rows(lib):
    """Queries as row-strided views of a fused qkv output; decode i reads block-table row req_idx[i]
    (not i) and its query/output row q_rows[i], as in a step that mixes prefills and decodes."""
    seq_lens = [40, 7, 90, 23]
    table, cache = _batch(seq_lens, 3, 64, 16, torch.float32, seed=22)
    num_heads, width = 9, (9 + 2 * 3) * 64
    qkv = torch.randn(10, width, generator=torch.Generator().manual_seed(23))
    query = qkv[:, : num_heads * 64].view(10, num_heads, 64)
    assert query.stride(0) == width
    perm = torch.tensor([2, 0, 3, 1])  # decode i uses table row perm[i]
    rows = torch.tensor([9, 3, 5, 0])
    lens = [seq_lens[j] for j in perm.tolist()]
    out = torch.full((10, num_heads, 64), 7.0)
    cpu_decode.paged_decode_attention(lib, query, cache, table, perm, rows, torch.tensor(lens), 0.125, out)
    ref = _reference(query[rows], cache, table[perm], lens, 0.125)
    torch.testing.assert_close(out[rows].double(), ref, atol=2e-6, rtol=1e-5)
    others = torch.tensor([1, 2, 4, 6, 7, 8])
    assert torch.equal(out[others], torch.full_like(out[others], 7.0))


def test_nan_keys_propagate(lib):
    """A NaN key makes its row's output NaN on every path (a corrupted cache must not go unnoticed)."""
    for head_dim in (64, 96):  # vector path, plain-C path
        table, cache = _batch([20], 1, head_dim, 16, torch.float32, seed=24)
        cache[0, table[0, 0], 5] = float("nan")
        out = _run(lib, torch.randn(1, 2, head_dim), cache, table, [20], 0.125)
        assert torch.isnan(out).all(), head_dim


def test_far_below_max_scores_underflow_to_zero(lib):
    """Scores thousands below the row max give weight 0 (exp underflow), never NaN."""
    table, cache = _batch(SEQ_LENS, 2, 64, 16, torch.float32, seed=7)
    query = torch.randn(len(SEQ_LENS), 4, 64, generator=torch.Generator().manual_seed(8)) * 300
    out = _run(lib, query, cache, table, SEQ_LENS, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(query, cache, table, SEQ_LENS, 1.0), atol=1e-5, rtol=1e-5)


def test_writes_only_its_rows(lib):
    """Row i lands at out[q_rows[i]], read from query[q_rows[i]]; every other row of out is untouched."""
    seq_lens = [20, 45]
    table, cache = _batch(seq_lens, 2, 64, 16, torch.float32, seed=9)
    query = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(10))
    rows = torch.tensor([4, 1])
    out = _run(lib, query, cache, table, seq_lens, 0.125, rows=rows)
    ref = _reference(query[rows], cache, table, seq_lens, 0.125)
    torch.testing.assert_close(out[rows].double(), ref, atol=2e-6, rtol=1e-5)
    untouched = torch.tensor([0, 2, 3, 5])
    assert torch.equal(out[untouched], torch.full_like(out[untouched], 7.0))


def test_rejects_shapes_above_its_limits(lib):
    table, cache = _batch([5], 1, 8, 16, torch.float32, seed=11)
    query = torch.randn(1, cpu_decode.MAX_GROUP + 1, 8)
    assert not cpu_decode.kernel_supports(query, cache)
    with pytest.raises(ValueError, match="limits"):
        _run(lib, query, cache, table, [5], 1.0)
    with pytest.raises(ValueError, match="contiguous heads"):
        _run(lib, query[:, :1], cache, table, [5], 1.0, out=torch.empty(1, 8, 1))


def _decode_metadata(table, seq_lens):
    n = len(seq_lens)
    qsl = np.arange(n + 1, dtype=np.int32)
    sl = np.array(seq_lens, np.int32)
    # The new tokens are already in the cache; slot -1 keeps forward() from writing them again.
    return AttentionMetadata(n, n, 1, int(sl.max()), torch.from_numpy(qsl), torch.from_numpy(sl), table,
                             torch.full((n,), -1, dtype=torch.int64), qsl, sl)


def test_backend_mixed_step_with_fused_qkv(lib):
    """One step: a prefill chunk between decodes, queries as a strided view of a wider buffer (as the
    fused qkv split gives them); kernel == PyTorch path."""
    from tests.attention.test_torch_sdpa import _make_batch

    md, cache, key, value, _, _ = _make_batch([30, 0, 50, 9], [1, 12, 1, 1], 16, 2, 64, 16, seed=25)
    t = md.num_actual_tokens
    qkv = torch.randn(t, (8 + 4) * 64, generator=torch.Generator().manual_seed(26))
    query = qkv[:, : 8 * 64].view(t, 8, 64)
    for window in (None, 8):
        got = TorchSDPABackend().forward(query, key, value, cache.clone(), md, scale=0.125, sliding_window=window)
        want = TorchSDPABackend(use_cpu_kernel=False).forward(query, key, value, cache.clone(), md, scale=0.125,
                                                              sliding_window=window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backend_routes_cpu_decodes_to_the_kernel(lib):
    """TORCH_SDPA on CPU plans kernel rows (no block_decode plan) and matches its PyTorch path."""
    seq_lens = [30, 12, 61]
    table, cache = _batch(seq_lens, 2, 64, 16, torch.bfloat16, seed=12)
    md = _decode_metadata(table, seq_lens)
    query = torch.randn(len(seq_lens), 8, 64, generator=torch.Generator().manual_seed(13)).bfloat16()
    backend = TorchSDPABackend()
    got = backend.forward(query, query[:, :2], query[:, :2], cache, md, scale=0.125)
    assert backend._plans[0].decode_reqs is not None and backend._plans[0].block_decode is None
    torch_path = TorchSDPABackend(use_cpu_kernel=False)
    want = torch_path.forward(query, query[:, :2], query[:, :2], cache, md, scale=0.125)
    assert torch_path._plans[0].block_decode is not None
    torch.testing.assert_close(got.double(), want.double(), atol=1e-2, rtol=1e-2)


def test_env_switch_turns_the_kernel_off(monkeypatch):
    """TOKENMILL_CPU_KERNELS=0: no kernel, and the backend's decodes take the PyTorch path, still correct."""
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    assert cpu_decode.load_kernel() is None
    seq_lens = [9, 20]
    table, cache = _batch(seq_lens, 1, 64, 16, torch.float32, seed=14)
    query = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(15))
    backend = TorchSDPABackend()
    got = backend.forward(query, query[:, :1], query[:, :1], cache, _decode_metadata(table, seq_lens), scale=0.125)
    assert backend._plans[0].block_decode is not None and backend._plans[0].decode_reqs is None
    torch.testing.assert_close(got.double(), _reference(query, cache, table, seq_lens, 0.125), atol=1e-5, rtol=1e-5)


def test_build_failure_falls_back(monkeypatch, tmp_path):
    """A compiler that fails -> None (logged), not an exception; nothing half-written stays in the cache."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fake compiler: error' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENMILL_CPU_KERNELS", raising=False)
    assert cpu_decode.load_kernel() is None
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []


def test_plain_c_path_without_avx512(plain_c_kernels):
    """The source built for a CPU without AVX-512 (x86-64-v3) runs its plain-C loops, also right."""
    plain = cpu_decode.load_kernel()
    assert plain is not None
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2e-2)):
        table, cache = _batch(SEQ_LENS, 3, 64, 16, dtype, seed=30)
        query = torch.randn(len(SEQ_LENS), 9, 64, generator=torch.Generator().manual_seed(31)).to(dtype)
        out = _run(plain, query, cache, table, SEQ_LENS, 0.125, window=40)
        ref = _reference(query, cache, table, SEQ_LENS, 0.125, window=40)
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
