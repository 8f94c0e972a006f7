"""Attention sinks (gpt-oss) with sliding windows: Triton paged attention and TORCH_SDPA vs a float64 reference.

A sink is one learned logit per head that joins each softmax denominator and
contributes no value. Large positive sinks (weights well above every score)
and very negative ones (no effect) are both checked. The Triton kernel runs
under TRITON_INTERPRET=1 on CPU (tiny shapes), at real sizes on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attention_reference import make_paged_batch, reference_attention

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels.triton.paged_attention_launch import paged_attention

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# sinks of 4 heads: a dominant one, a negligible one, two ordinary ones
SINKS = torch.tensor([3.0, -30.0, 0.5, -1.0])


def _triton(batch, **kw):
    return paged_attention(batch.query, batch.kv_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                           num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
                           max_seq_len=max(c + q for c, q in zip(batch.context_lens, batch.query_lens)),
                           out=torch.full_like(batch.query, float("nan")), **kw)


def _err(batch, out, **kw) -> float:
    ref = reference_attention(batch, **kw)
    assert not torch.isnan(out[: ref.shape[0]]).any()
    return (out[: ref.shape[0]].double().cpu() - ref).abs().max().item()


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_sinks_and_window(window, num_splits):
    gen = torch.Generator().manual_seed(7 + num_splits)
    # mixed: a fresh prompt longer than the window, decodes, a chunk after cached context
    batch = make_paged_batch([0, 3, 40, 21], [13, 1, 1, 5], num_heads=4, num_kv_heads=2, head_dim=16,
                             block_size=16, dtype=torch.float32, device=DEVICE, num_padding_tokens=2, generator=gen)
    sinks = SINKS.to(DEVICE)
    kw = dict(scale=0.4, sliding_window=window)
    out = _triton(batch, sinks=sinks, num_splits=num_splits, block_n=16, **kw)
    assert _err(batch, out, sinks=sinks, **kw) < 2e-5
    assert torch.all(out[-2:] == 0), "padding rows stay zero"
    # The sink matters: without it the result is different.
    assert _err(batch, out, **kw) > 1e-2


def test_triton_rejects_wrong_sink_count():
    gen = torch.Generator().manual_seed(1)
    batch = make_paged_batch([0], [3], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, device=DEVICE, generator=gen)
    with pytest.raises(ValueError, match="one logit per query head"):
        _triton(batch, scale=1.0, sinks=torch.zeros(2, device=DEVICE))


def _metadata(batch) -> AttentionMetadata:
    qsl = batch.query_start_loc.cpu().numpy()
    seq_lens = batch.seq_lens.cpu().numpy()
    n = int(qsl[-1])
    return AttentionMetadata(
        num_actual_tokens=n, num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
        max_seq_len=int(seq_lens.max()), query_start_loc=batch.query_start_loc.cpu(),
        seq_lens=batch.seq_lens.cpu(), block_table=batch.block_table.cpu(),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64),  # the cache already holds every key
        query_start_loc_cpu=qsl.astype(np.int32), seq_lens_cpu=seq_lens.astype(np.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv_tile_size", [8, 1024])
def test_torch_sdpa_sinks_and_window(dtype, window, kv_tile_size):
    """Decodes go through block_decode (the C kernel has no sink term), prefill chunks through the tiles
    (one tile, or several with the online softmax); fused SDPA is bypassed for sink layers."""
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([0, 3, 40, 21, 9], [11, 1, 1, 5, 1], num_heads=4, num_kv_heads=2, head_dim=16,
                             block_size=4, dtype=dtype, generator=gen)
    # TORCH_SDPA masks by adding -inf to scores, so unused slots must hold finite values (as in the engine).
    batch.kv_cache.nan_to_num_(0.0)
    backend = TorchSDPABackend(kv_tile_size=kv_tile_size)
    n = int(batch.query_start_loc[-1])
    kv = torch.zeros(n, 2, 16, dtype=dtype)
    out = backend.forward(batch.query, kv, kv, batch.kv_cache, _metadata(batch), scale=0.4,
                          sliding_window=window, sinks=SINKS)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert _err(batch, out, scale=0.4, sliding_window=window, sinks=SINKS) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_sinks_real_sizes(dtype, window):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs cc >= 8.0")
    gen = torch.Generator().manual_seed(11)
    ctx, q = [0, 700, 1000, 31, 2000, 5], [300, 1, 1, 64, 1, 129]
    # gpt-oss-20b's attention: 64 query heads, 8 KV heads, head_dim 64.
    batch = make_paged_batch(ctx, q, num_heads=64, num_kv_heads=8, head_dim=64, block_size=16, dtype=dtype,
                             device="cuda", num_padding_tokens=4, generator=gen)
    sinks = torch.randn(64, generator=gen).cuda()
    kw = dict(scale=64**-0.5, sliding_window=window)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    for splits in (1, 4):
        assert _err(batch, _triton(batch, sinks=sinks, num_splits=splits, **kw), sinks=sinks, **kw) < tol
