"""Triton varlen paged attention vs a float64 PyTorch reference.

CPU: runs under the Triton interpreter (see conftest.py), fp32, tiny shapes.
CUDA (when present): the same checks at real sizes in fp16/bf16.
"""

from __future__ import annotations

import random

import pytest
import torch
from attention_reference import make_paged_batch, reference_attention

from tokenmill.kernels.triton import attention_config as triton_attention_config
from tokenmill.kernels.triton.attention_config import (
    AttentionLaunchConfig,
    choose_decode_launch_config,
    choose_launch_config,
    choose_num_splits,
)
from tokenmill.kernels.triton.paged_attention_launch import paged_attention

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _run(batch, *, poison=True, **kwargs):
    out = torch.full_like(batch.query, float("nan")) if poison else None
    return paged_attention(
        batch.query,
        batch.kv_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        num_reqs=batch.num_reqs,
        max_query_len=batch.max_query_len,
        max_seq_len=max(c + q for c, q in zip(batch.context_lens, batch.query_lens, strict=True)),
        out=out,
        **kwargs,
    )


def _check(batch, out, atol, **attn_kwargs):
    assert not torch.isnan(out).any(), "some output element was never written"
    ref = reference_attention(batch, **attn_kwargs)
    n = ref.shape[0]
    err = (out[:n].double().cpu() - ref).abs().max().item()
    assert err < atol, f"max abs error {err} >= {atol}"
    if batch.num_padding_tokens:
        assert torch.all(out[n:] == 0), "padding rows must be zero"


def _random_lens(rng: random.Random, num_reqs: int, max_ctx: int, max_q: int) -> tuple[list[int], list[int]]:
    ctx, q = [], []
    for _ in range(num_reqs):
        kind = rng.random()
        q.append(1 if kind < 0.5 else rng.randint(1, max_q))  # half decodes
        ctx.append(0 if rng.random() < 0.2 else rng.randint(1, max_ctx))
    return ctx, q


# (num_heads, num_kv_heads, head_dim, block_size, sliding_window, soft_cap)
CASES = [
    (2, 2, 16, 16, None, None),  # MHA
    (4, 2, 16, 16, None, None),  # GQA 2
    (8, 2, 16, 32, None, None),  # GQA 4
    (4, 1, 16, 16, None, None),  # MQA
    (4, 2, 24, 16, None, None),  # head_dim padded to 32
    (4, 2, 16, 16, 7, None),  # window
    (4, 1, 16, 32, 20, 5.0),  # window + softcap, MQA
    (2, 1, 64, 16, None, 3.0),  # head_dim 64, softcap
    (4, 2, 64, 32, 33, None),  # head_dim 64, window crossing blocks
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window,cap", CASES)
def test_random_mixed_batches(num_heads, num_kv_heads, head_dim, block_size, window, cap):
    rng = random.Random(hash((num_heads, num_kv_heads, head_dim, block_size, window, cap)) % 1000)
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    for trial in range(4):
        ctx, q = _random_lens(rng, rng.randint(1, 4), max_ctx=150, max_q=9)
        batch = make_paged_batch(
            ctx, q, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            block_size=block_size, dtype=torch.float32, device=DEVICE,
            num_padding_tokens=trial % 3, generator=gen,
        )
        kw = {"scale": head_dim**-0.5, "sliding_window": window, "logits_soft_cap": cap}
        _check(batch, _run(batch, **kw), atol=2e-5, **kw)
        if trial == 0:  # the single launch of a mixed step (split_decodes=False) too, once per case
            _check(batch, _run(batch, split_decodes=False, **kw), atol=2e-5, **kw)


@pytest.mark.parametrize("heavy_first,split_decodes", [(False, True), (True, False)])
def test_edge_lengths_and_tile_shapes(heavy_first, split_decodes):
    """Chunk of 1 at context 0, chunks ending exactly on a block edge, a long
    chunk spanning several query blocks, an empty request, and KV tiles smaller
    than a block; in both launch orders and with the decodes in their own launch
    or not (neither may change a result; the defaults, True / True, run in the
    other tests)."""
    gen = torch.Generator().manual_seed(1)
    ctx = [0, 0, 15, 0, 16, 31, 5]
    q = [1, 16, 1, 0, 16, 2, 21]
    batch = make_paged_batch(ctx, q, num_heads=4, num_kv_heads=2, head_dim=16, block_size=32,
                             dtype=torch.float32, device=DEVICE, num_padding_tokens=3, generator=gen)
    kw = {"scale": 0.3}
    for block_m, block_n in [(None, None), (16, 16), (64, 128), (32, 32)]:
        out = _run(batch, block_m=block_m, block_n=block_n, heavy_first=heavy_first, split_decodes=split_decodes, **kw)
        _check(batch, out, atol=2e-5, **kw)


@pytest.mark.skipif(CUDA, reason="wraps the interpreted kernel launch")
def test_mixed_step_launches_write_disjoint_rows(monkeypatch):
    """split_decodes: the decode launch (ROLE 1) writes exactly the rows of the requests with 1..BLOCK_Q_dec new
    tokens, the prefill launch (ROLE 2) exactly the others' and the padding rows (also when the padding is no
    longer than a decode); the empty request has no rows. Each launch writes into its own NaN buffer here."""
    import tokenmill.kernels.triton.paged_attention_launch as module

    kernel, written = module.paged_attention_kernel, {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(dst, *args, **kw):
                own = torch.full_like(dst, float("nan"))
                kernel[grid](own, *args, **kw)
                rows = ~torch.isnan(own).all(-1)  # [num_tokens, num_heads]
                assert kw["ROLE"] not in written
                written[kw["ROLE"]] = rows
                dst[rows] = own[rows]
            return launch

    monkeypatch.setattr(module, "paged_attention_kernel", Recorder())
    gen = torch.Generator().manual_seed(6)
    # 8 q / 2 kv heads: decode tiles hold 16 // 4 = 4 tokens, prefill tiles 16
    ctx, q = [0, 5, 20, 0, 33, 9], [7, 1, 3, 0, 4, 5]
    batch = make_paged_batch(ctx, q, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, num_padding_tokens=3, generator=gen)
    assert choose_launch_config(1, 4, 16).block_q == 4
    kw = {"scale": 0.25, "sliding_window": 6}
    _check(batch, _run(batch, **kw), atol=2e-5, **kw)
    assert sorted(written) == [1, 2]
    decode = torch.zeros(sum(q) + 3, dtype=torch.bool)
    for start, n in zip(batch.query_start_loc.tolist(), q, strict=False):
        decode[start : start + n] = 1 <= n <= 4
    assert torch.equal(written[1], decode[:, None].expand(-1, 8))
    assert torch.equal(written[2], ~decode[:, None].expand(-1, 8))


@pytest.mark.slow  # the Triton interpreter over many splits: the slowest kernel test on CPU
@pytest.mark.parametrize(
    "num_splits,extra", [(2, {}), (3, {"sliding_window": 50, "logits_soft_cap": 3.0}), (8, {})]
)
def test_split_kv_matches_reference(num_splits, extra):
    """Flash-decoding path: splits past the end of short ranges are empty and
    must not disturb the merge; padding rows still come out 0."""
    gen = torch.Generator().manual_seed(10 + num_splits)
    ctx = [0, 3, 40, 150, 90]
    q = [1, 1, 1, 1, 2]
    batch = make_paged_batch(ctx, q, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, device=DEVICE, num_padding_tokens=2, generator=gen)
    kw = dict(scale=0.3, **extra)
    _check(batch, _run(batch, num_splits=num_splits, block_n=16, **kw), atol=2e-5, **kw)


def test_decode_only_batch_uses_small_tiles():
    gen = torch.Generator().manual_seed(2)
    ctx = [0, 1, 17, 40, 63]
    batch = make_paged_batch(ctx, [1] * len(ctx), num_heads=8, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, device=DEVICE, generator=gen)
    assert choose_launch_config(1, 4, 16).block_m == 16
    kw = {"scale": 0.25, "sliding_window": 16}
    _check(batch, _run(batch, **kw), atol=2e-5, **kw)


def test_fp16_matches_reference():
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([0, 20, 3], [5, 1, 9], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float16, device=DEVICE, num_padding_tokens=1, generator=gen)
    kw = {"scale": 0.25, "logits_soft_cap": 4.0}
    out = _run(batch, **kw)
    assert out.dtype == torch.float16
    _check(batch, out, atol=3e-3, **kw)


def test_launch_config_rules():
    cfg = choose_launch_config(1, 4, 128)
    assert (cfg.block_m, cfg.block_q, cfg.qpk_pad, cfg.head_dim_pad) == (16, 4, 4, 128)
    cfg = choose_launch_config(500, 3, 96)  # 3 heads per kv head pad to 4; 96 pads to 128
    assert (cfg.block_m, cfg.block_q, cfg.qpk_pad, cfg.head_dim_pad) == (64, 16, 4, 128)
    cfg = choose_launch_config(1, 32, 64)  # MQA with 32 heads: a tile holds one token
    assert (cfg.block_m, cfg.block_q) == (32, 1)
    assert choose_launch_config(100, 1, 256).block_n == 32
    # The decode launch of a mixed step: Llama-3.1-8B's 4 heads per kv head -> 4 tokens (16 rows) beside 16.
    dec = choose_decode_launch_config(256, choose_launch_config(256, 4, 128), 4, 128)
    assert (dec.block_m, dec.block_q, dec.block_n, dec.num_warps) == (16, 4, 64, 4)
    assert choose_decode_launch_config(4, choose_launch_config(4, 4, 128), 4, 128) is None  # decode step
    assert choose_decode_launch_config(256, choose_launch_config(256, 64, 128), 64, 128) is None  # 1 token both
    assert choose_decode_launch_config(256, choose_launch_config(256, 4, 128, block_m=16), 4, 128) is None
    assert choose_decode_launch_config(256, choose_launch_config(256, 1, 64), 1, 64, block_n=16).block_n == 16


def test_long_prefill_tiles():
    assert choose_launch_config(8192, 4, 128, large_tiles=True) == AttentionLaunchConfig(32, 4, 128, 128, 8, 2)
    assert choose_launch_config(8191, 4, 128, large_tiles=True).block_m == 64  # below LONG_PREFILL_QUERY
    assert choose_launch_config(16384, 4, 128).block_m == 64  # a device without large_tiles (cc < 9.0)
    assert choose_launch_config(16384, 4, 256, large_tiles=True).block_m == 64  # head_dim 256: registers
    assert choose_launch_config(16384, 4, 128, num_stages=1, large_tiles=True).block_n == 64  # sm_7x
    assert choose_launch_config(16384, 4, 128, block_n=32, large_tiles=True).block_n == 32  # overrides win


def test_small_shared_memory_tiles():
    """cc 7.5 (64 KiB of shared memory a block): head_dim 256 prefill tiles shrink; decode and head_dim 128 keep
    theirs (the sm_75 compile in test_triton_compile_sm70.py checks the sizes)."""
    small = choose_launch_config(512, 4, 256, num_stages=1, small_shared=True)
    assert (small.block_m, small.block_n, small.num_warps) == (32, 16, 4)
    assert choose_launch_config(512, 4, 256, num_stages=1).block_m == 64  # V100: 96 KiB
    assert choose_launch_config(1, 4, 256, num_stages=1, small_shared=True) == choose_launch_config(1, 4, 256, num_stages=1)
    assert choose_launch_config(512, 4, 128, num_stages=1, small_shared=True) == choose_launch_config(512, 4, 128,
                                                                                                       num_stages=1)


def test_split_count_rules(monkeypatch):
    monkeypatch.setattr(triton_attention_config, "_num_sms", lambda index: 132)  # H100/H200
    cuda = torch.device("cuda", 0)
    assert choose_num_splits(cuda, 1, 1, 8, 8192) == 16  # 8 programs: split to the cap
    assert choose_num_splits(cuda, 1, 8, 8, 8192) == 5  # ceil(264 / 64)
    assert choose_num_splits(cuda, 1, 64, 8, 1024) == 1  # 512 programs fill the GPU
    assert choose_num_splits(cuda, 1, 1, 8, 300) == 1  # too short to split
    assert choose_num_splits(cuda, 512, 1, 8, 8192) == 1  # prefill steps never split
    assert choose_num_splits(torch.device("cpu"), 1, 1, 8, 8192) == 1
    # Past LONG_DECODE_SEQ: four programs an SM, up to 64 splits.
    assert choose_num_splits(cuda, 1, 1, 8, 16384) == 16
    assert choose_num_splits(cuda, 1, 1, 8, 16385) == 64  # ceil(528 / 8) = 66, capped
    assert choose_num_splits(cuda, 1, 4, 8, 126000) == 17  # ceil(528 / 32)
    assert choose_num_splits(cuda, 1, 80, 8, 126000) == 1  # 640 programs


def test_rejects_bad_head_ratio():
    gen = torch.Generator().manual_seed(4)
    batch = make_paged_batch([0], [1], num_heads=3, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, generator=gen)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _run(batch, scale=1.0)


@pytest.mark.parametrize("gpt_oss,split_decodes", [(False, True), (True, True), (True, False)])
def test_mixed_cuda_graph_metadata_gives_the_same_rows(gpt_oss, split_decodes):
    """The kernel under a mixed CUDA graph's metadata (worker/cuda_graph.py: R requests, the extra ones empty,
    the tokens past the live ones the kernel's padding request, stale block-table rows) gives the live rows
    exactly what the step's own metadata gives, and zeros for the padding rows; unused cache slots hold NaN, so
    a read of one would show. gpt_oss: a sliding-window layer with sinks (the padding rows must stay 0 although
    the sink joins every row's denominator). 4 heads per kv head: requests of <= 4 tokens run in the decode
    launch (split_decodes), and so would the 4 padding tokens but for the padding request's exception."""
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch([0, 5, 20, 33], [7, 1, 3, 1], num_heads=8, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, generator=gen)
    t, r, size = 12, 7, 16
    kw = {"scale": 0.25, "split_decodes": split_decodes}
    if gpt_oss:
        kw.update(sliding_window=6, sinks=torch.randn(8, generator=gen))
    ref = paged_attention(batch.query[:t], batch.kv_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                          num_reqs=4, max_query_len=7, **kw)
    assert torch.allclose(ref, reference_attention(batch, **{k: v for k, v in kw.items() if k != "split_decodes"})
                          .float(), atol=2e-5)
    query = torch.cat([batch.query[:t], torch.randn(size - t, 8, 16, generator=gen)])
    num_blocks = batch.kv_cache.shape[1]
    stale = torch.randint(0, num_blocks, (r - 4, batch.block_table.shape[1]), generator=gen, dtype=torch.int32)
    table = torch.cat([batch.block_table, stale])
    qsl = torch.cat([batch.query_start_loc, torch.full((r - 4,), t, dtype=torch.int32)])
    seq_lens = torch.cat([batch.seq_lens, torch.zeros(r - 4, dtype=torch.int32)])
    out = torch.full_like(query, float("nan"))
    paged_attention(query, batch.kv_cache, table, seq_lens, qsl, num_reqs=r, max_query_len=size, out=out, **kw)
    assert torch.equal(out[:t], ref)
    assert torch.all(out[t:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_long_decodes_split_kv(dtype):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs cc >= 8.0")
    gen = torch.Generator().manual_seed(5)
    ctx = [0, 5, 700, 4000, 8191]
    batch = make_paged_batch(ctx, [1] * 5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=dtype, device="cuda", num_padding_tokens=3, generator=gen)
    assert choose_num_splits(batch.query.device, 1, 5, 8, 8192) > 1
    kw = {"scale": 128**-0.5}
    _check(batch, _run(batch, **kw), atol=2e-2 if dtype == torch.bfloat16 else 4e-3, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (256, 64)])
@pytest.mark.parametrize("window,cap", [(None, None), (256, None), (None, 30.0)])
def test_cuda_real_sizes(dtype, head_dim, block_size, window, cap):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs cc >= 8.0")
    gen = torch.Generator().manual_seed(head_dim + block_size)
    ctx = [0, 700, 1000, 31, 2000, 5]
    q = [300, 1, 1, 64, 1, 129]
    batch = make_paged_batch(ctx, q, num_heads=32, num_kv_heads=4, head_dim=head_dim, block_size=block_size,
                             dtype=dtype, device="cuda", num_padding_tokens=4, generator=gen)
    kw = {"scale": head_dim**-0.5, "sliding_window": window, "logits_soft_cap": cap}
    _check(batch, _run(batch, **kw), atol=2e-2 if dtype == torch.bfloat16 else 4e-3, **kw)


@pytest.mark.gpu
def test_gpu_long_prefill_tiles_match_the_default_tiles():
    """A 9,000-token chunk at 3,000 tokens of context takes the 128 x 128 tiles on cc >= 9.0 (else the default):
    the same attention as the 64 x 64 tiles, which the reference tests cover, up to bfloat16 rounding."""
    if not CUDA:
        pytest.skip("needs a GPU")
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch([3000], [9000], num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=torch.bfloat16, device="cuda", generator=gen)

    def run(**kw):
        return paged_attention(batch.query, batch.kv_cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                               num_reqs=1, max_query_len=9000, max_seq_len=12000, scale=128**-0.5,
                               out=torch.full_like(batch.query, float("nan")), **kw)

    large, small = run(), run(block_m=64, block_n=64, num_warps=4)
    assert not torch.isnan(large).any()
    err = (large.float() - small.float()).abs().max().item()
    assert err < 2e-2, f"128 x 128 tiles vs 64 x 64: {err}"
