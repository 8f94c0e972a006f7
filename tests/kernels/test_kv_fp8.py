"""fp8 KV cache (`--kv-cache-dtype fp8*`): the cache write and the attention read, Triton and TORCH_SDPA.

Error bounds checked here (q = queries, K/V the 16-bit keys/values, K~/V~ their fp8 round trip
`dequantize_kv(quantize_kv(x, s), s)`, scores scaled by `scale`):

1. Against a float64 reference that attends over the same quantized cache (K~, V~): only float
   rounding differs. Triton in the interpreter and TORCH_SDPA, float32: max abs error < 2e-5
   (the 16-bit cache's tests use the same bound); the GPU test, bfloat16 queries: < 2e-2.
2. Against the 16-bit cache (K, V), per request, for every output element:

       |o~ - o| <= max|V~ - V| + (exp(2 eps) - 1) max|V| + 2e-5,
       eps = scale * max over rows, heads, keys j of sum_d |q_d| |K~_jd - K_jd|

   since each score moves by at most eps (a soft-cap only shrinks moves), every softmax weight by at
   most a factor exp(+-eps) in its numerator and in its denominator (sinks included), and
   o~ - o = sum p~_j (v~_j - v_j) + sum (p~_j - p_j) v_j. It holds for any data; with unit-normal K/V
   the measured errors are ~10x below it (e4m3's half-ulp is 2^-4 relative, e5m2's 2^-3).

CPU: Triton under TRITON_INTERPRET=1 on tiny shapes; the GPU test runs real sizes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_reference import PagedBatch, make_paged_batch, reference_attention

from tokenmill.attention.backends.torch_sdpa import TorchSDPABackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels.cpu import decode as cpu_decode
from tokenmill.kernels.kv_fp8 import dequantize_kv, quantize_kv
from tokenmill.kernels.triton.paged_attention_launch import paged_attention
from tokenmill.kernels.triton.reshape_and_cache import reshape_and_cache

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOAT_ATOL = 2e-5


def _quantized(batch: PagedBatch, dtype: torch.dtype, k_scale: float, v_scale: float):
    """(fp8 cache, float64 dequantized cache) of the batch's cache; unused (NaN) slots stay NaN."""
    q8 = torch.stack([quantize_kv(batch.kv_cache[0], k_scale, dtype), quantize_kv(batch.kv_cache[1], v_scale, dtype)])
    deq = torch.stack([dequantize_kv(q8[0], k_scale, torch.float64), dequantize_kv(q8[1], v_scale, torch.float64)])
    return q8, deq


def _bounds(batch: PagedBatch, deq: torch.Tensor, scale: float) -> list[float]:
    """The per-request bound of the module docstring (item 2), float64."""
    table, bs = batch.block_table.cpu(), batch.kv_cache.shape[2]
    cache, q_all = batch.kv_cache.double().cpu(), batch.query.double().cpu()
    qpk = q_all.shape[1] // cache.shape[3]
    bounds, start = [], 0
    for i, (ctx, qlen) in enumerate(zip(batch.context_lens, batch.query_lens, strict=True)):
        pos = torch.arange(ctx + qlen)
        blocks = table[i][pos // bs].long()
        k, v = cache[0, blocks, pos % bs], cache[1, blocks, pos % bs]  # [S, Hkv, D]
        dk = (deq[0, blocks, pos % bs] - k).abs().repeat_interleave(qpk, dim=1)  # [S, H, D]
        dv = (deq[1, blocks, pos % bs] - v).abs()
        q = q_all[start : start + qlen].abs()  # [Q, H, D]
        eps = scale * torch.einsum("qhd,khd->qhk", q, dk).max().item()
        bounds.append(dv.max().item() + math.expm1(2 * eps) * v.abs().max().item() + FLOAT_ATOL)
        start += qlen
    return bounds


def _triton(batch: PagedBatch, cache: torch.Tensor, **kw) -> torch.Tensor:
    return paged_attention(batch.query, cache, batch.block_table, batch.seq_lens, batch.query_start_loc,
                           num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
                           max_seq_len=max(c + q for c, q in zip(batch.context_lens, batch.query_lens, strict=True)),
                           out=torch.full_like(batch.query, float("nan")), **kw)


def _check_both(batch, out, deq, scale, **attn_kw):
    """Bound 1 against the dequantized cache, bound 2 against the 16-bit one; returns the max error vs 16-bit."""
    assert not torch.isnan(out).any(), "an output element was never written (or an unused slot leaked)"
    original = batch.kv_cache
    batch.kv_cache = deq
    same = reference_attention(batch, scale=scale, **attn_kw)
    batch.kv_cache = original
    exact = reference_attention(batch, scale=scale, **attn_kw)
    n = same.shape[0]
    got = out[:n].double().cpu()
    err_same = (got - same).abs().max().item()
    assert err_same < FLOAT_ATOL, f"vs the same quantized cache: {err_same} >= {FLOAT_ATOL}"
    worst = 0.0
    start = 0
    for qlen, bound in zip(batch.query_lens, _bounds(batch, deq, scale), strict=True):
        err = (got[start : start + qlen] - exact[start : start + qlen]).abs().max().item()
        assert err <= bound, f"vs the 16-bit cache: {err} > bound {bound}"
        worst = max(worst, err)
        start += qlen
    return worst


# (context lens, query lens, heads, kv heads, head_dim, block_size, attention options)
CASES = [
    ([0, 37, 5], [9, 1, 4], 4, 2, 16, 16, {}),
    ([20, 0], [1, 12], 4, 1, 16, 32, {"sliding_window": 7, "logits_soft_cap": 5.0}),
    ([45, 3], [1, 1], 4, 2, 16, 16, {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0]), "num_splits": 3}),
    # a mixed step (decodes of 1 and 2 tokens beside a chunk of 9) as one launch; the first two cases use two
    ([0, 37, 5], [9, 1, 2], 8, 2, 16, 16, {"split_decodes": False}),
]


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_paged_attention_reads_fp8(dtype, case):
    ctx, ql, h, hkv, d, bs, opts = CASES[case]
    gen = torch.Generator().manual_seed(10 + case)
    batch = make_paged_batch(ctx, ql, num_heads=h, num_kv_heads=hkv, head_dim=d, block_size=bs,
                             dtype=torch.float32, num_padding_tokens=2, generator=gen)
    k_scale, v_scale = (0.02, 0.05) if dtype == torch.float8_e4m3fn else (1.0, 0.5)
    q8, deq = _quantized(batch, dtype, k_scale, v_scale)
    scale = d**-0.5
    out = _triton(batch, q8, scale=scale, k_scale=k_scale, v_scale=v_scale, **opts)
    attn_kw = {k: v for k, v in opts.items() if k not in ("num_splits", "split_decodes")}
    worst = _check_both(batch, out, deq, scale, **attn_kw)
    assert worst > 0.0, "fp8 storage changed nothing: the cache was not quantized"
    assert torch.all(out[sum(ql):] == 0), "padding rows must be zero"


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_triton_bfloat16_queries_run_float16_dots(dtype):
    """bfloat16 queries over an fp8 cache: the kernel's Q_F16 path (dots in float16, each query row scaled by a
    power of two first). Rows of very different magnitudes (x 3e4, x 1e-3) check the per-row scaling: without
    it the large rows would overflow float16 and the small ones lose their bits."""
    ctx, ql, h, hkv, d, bs = [0, 37, 5], [9, 1, 4], 4, 2, 16, 16
    gen = torch.Generator().manual_seed(3)
    batch = make_paged_batch(ctx, ql, num_heads=h, num_kv_heads=hkv, head_dim=d, block_size=bs,
                             dtype=torch.float32, num_padding_tokens=2, generator=gen)
    batch.query[:3] *= 3e4  # |q| past float16's 65504: only the per-row power-of-two scaling keeps them finite
    batch.query[9] *= 1e-3
    batch.query = batch.query.to(torch.bfloat16)
    k_scale, v_scale = 0.02, 0.05
    q8, deq = _quantized(batch, dtype, k_scale, v_scale)
    scale = d**-0.5
    out = _triton(batch, q8, scale=scale, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    batch.kv_cache = deq
    ref = reference_attention(batch, scale=scale)
    n = ref.shape[0]
    err = (out[:n].double() - ref).abs().max().item()
    assert err < 2e-2, f"bfloat16 queries, fp8 cache, vs float64 over the same cache: {err}"
    assert torch.all(out[n:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_triton_cache_write_matches_torch_rounding(dtype):
    """reshape_and_cache writes exactly `quantize_kv`'s bits: subnormals, ties, saturation, both signs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, 2, 16, generator=gen) * torch.logspace(-7, 6, 48)[:, None, None]
    max_code = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    x[0, 0, :8] = torch.tensor([0.0, -0.0, max_code, 1e9, -1e9, 2.0**-10, 3 * 2.0**-10, 1.0 + 1 / 16])
    cache = torch.zeros(2, 4, 16, 2, 16, dtype=dtype)
    slots = torch.randperm(64, generator=gen)[:48]
    slots[5] = -1  # padding: never written
    reshape_and_cache(x, -x, cache, slots, 0.5, 2.0)
    bits = cache.view(torch.uint8).view(2, 64, 2, 16)
    keep = slots >= 0
    assert torch.equal(bits[0, slots[keep]], quantize_kv(x[keep], 0.5, dtype).view(torch.uint8))
    assert torch.equal(bits[1, slots[keep]], quantize_kv(-x[keep], 2.0, dtype).view(torch.uint8))
    unwritten = torch.ones(64, dtype=torch.bool)
    unwritten[slots[keep]] = False
    assert torch.all(bits[:, unwritten] == 0)


def _sdpa_inputs(batch: PagedBatch, cache: torch.Tensor):
    """Metadata, new keys/values [T, Hkv, D] (read back from `cache`, float) and their slots for TORCH_SDPA."""
    bs = cache.shape[2]
    flat = cache.view(2, -1, *cache.shape[3:])
    table = batch.block_table.cpu()
    slots = []
    for i, (ctx, qlen) in enumerate(zip(batch.context_lens, batch.query_lens, strict=True)):
        pos = torch.arange(ctx, ctx + qlen)
        slots.append(table[i][pos // bs].long() * bs + pos % bs)
    slot_mapping = torch.cat(slots + [torch.full((batch.num_padding_tokens,), -1)]).to(cache.device)
    real = slot_mapping.clamp(min=0)
    key, value = flat[0, real].clone(), flat[1, real].clone()
    qsl, seq_lens = batch.query_start_loc.cpu().numpy(), batch.seq_lens.cpu().numpy()
    md = AttentionMetadata(num_actual_tokens=int(qsl[-1]), num_reqs=batch.num_reqs, max_query_len=batch.max_query_len,
                           max_seq_len=int(seq_lens.max()), query_start_loc=batch.query_start_loc,
                           seq_lens=batch.seq_lens, block_table=batch.block_table, slot_mapping=slot_mapping,
                           query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return md, key, value


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window,cap", [(None, None), (9, 3.0)])
def test_torch_sdpa_writes_and_reads_fp8(dtype, window, cap):
    """TORCH_SDPA (CPU): fresh prompts, chunks with context, decodes; fused-SDPA and tiled prefills, C-kernel
    and gathered decodes."""
    gen = torch.Generator().manual_seed(7)
    batch = make_paged_batch([0, 21, 40, 7], [9, 13, 1, 1], num_heads=4, num_kv_heads=2, head_dim=8,
                             block_size=16, dtype=torch.float32, generator=gen)
    batch.kv_cache = batch.kv_cache.nan_to_num(nan=1e3)  # finite junk: the gather paths read whole blocks
    md, key, value = _sdpa_inputs(batch, batch.kv_cache)
    k_scale, v_scale = 0.03, 0.02
    q8, deq = _quantized(batch, dtype, k_scale, v_scale)
    scale = 8**-0.5
    # Decodes: the C kernel (when it builds), then the grouped gathers; prefills: fused SDPA, then tiles.
    for backend in (TorchSDPABackend(), TorchSDPABackend(kv_tile_size=1, decode_tile_budget=1, use_sdpa_prefill=False,
                                                         use_cpu_kernel=False)):
        cache = q8.clone()
        flat = cache.view(torch.uint8).view(2, -1, 2, 8)
        flat[:, md.slot_mapping] = 0  # the new tokens' slots: the backend must write them
        out = backend.forward(batch.query, key, value, cache, md, scale=scale, sliding_window=window,
                              logits_soft_cap=cap, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(cache.view(torch.uint8), q8.view(torch.uint8)), "the write differs from quantize_kv"
        _check_both(batch, out, deq, scale, sliding_window=window, logits_soft_cap=cap)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 8])  # the AVX-512 path (64 / 128) and the plain-C one
def test_cpu_decode_kernel_reads_fp8(require_cpu_kernel, dtype, q_dtype, head_dim):
    """The C decode kernel over an fp8 cache vs float64 over the same dequantized cache (bound 1; bfloat16
    queries and outputs: 2e-2, as its bfloat16 test); float32: measurably off the unquantized result."""
    from tests.attention.test_block_decode import _reference
    from tests.kernels.test_cpu_decode_attention import SEQ_LENS, _batch, _run

    lib = require_cpu_kernel(cpu_decode.load_kernel, cpu_decode._SOURCE)
    table, cache = _batch(SEQ_LENS, 2, head_dim, 16, torch.float32, seed=head_dim)
    k_scale, v_scale = 0.05, 0.02
    q8 = torch.stack([quantize_kv(cache[0], k_scale, dtype), quantize_kv(cache[1], v_scale, dtype)])
    deq = torch.stack([dequantize_kv(q8[0], k_scale, torch.float64), dequantize_kv(q8[1], v_scale, torch.float64)])
    query = torch.randn(len(SEQ_LENS), 6, head_dim, generator=torch.Generator().manual_seed(2)).to(q_dtype)
    scale = head_dim**-0.5
    out = torch.full_like(query, 7.0)
    n = len(SEQ_LENS)
    cpu_decode.paged_decode_attention(lib, query, q8, table, torch.arange(n), torch.arange(n),
                                      torch.tensor(SEQ_LENS), scale, out, k_scale=k_scale, v_scale=v_scale)
    same = _reference(query, deq, table, SEQ_LENS, scale)
    err = (out.double() - same).abs().max().item()
    assert err < (FLOAT_ATOL if q_dtype == torch.float32 else 2e-2), err
    if q_dtype == torch.float32:
        exact = _reference(query, cache, table, SEQ_LENS, scale)
        assert (out.double() - exact).abs().max().item() > 1e-4, "fp8 storage changed nothing"
        # ... and the same kernel on the float32 cache still matches float64 (the fp8 branch left it alone).
        torch.testing.assert_close(_run(lib, query, cache, table, SEQ_LENS, scale).double(), exact, atol=2e-6,
                                   rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_real_sizes_fp8(dtype, window, q_dtype):
    """Llama-3.1-8B attention shapes (32 heads, 8 KV heads, head_dim 128, block 16), 16-bit queries:
    decodes up to 2k keys (split-KV) and prefill chunks, written by reshape_and_cache then read. On cc >= 8.9
    the kernel decodes with the fp8 conversion instructions (KV_NATIVE), below with bit operations."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 needs cc >= 8.0 (the fp8 path itself is the same bit decode on every GPU)")
    rng = np.random.default_rng(0)
    ctx = [int(c) for c in rng.integers(0, 2048, 12)]
    ql = [1] * 8 + [int(q) for q in rng.integers(2, 200, 4)]
    gen = torch.Generator().manual_seed(0)
    batch = make_paged_batch(ctx, ql, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype=torch.float32, device="cuda", generator=gen)
    k_scale, v_scale = 0.01, 0.01
    q8, deq = _quantized(batch, dtype, k_scale, v_scale)
    cache = q8.clone()
    md, key, value = _sdpa_inputs(batch, batch.kv_cache)  # the new tokens' float K/V, written in fp8 below
    cache.view(torch.uint8).view(2, -1, 8, 128)[:, md.slot_mapping] = 0
    reshape_and_cache(key, value, cache, md.slot_mapping, k_scale, v_scale)
    torch.cuda.synchronize()
    assert torch.equal(cache.view(torch.uint8), q8.view(torch.uint8))
    batch.query = batch.query.to(q_dtype)
    out = _triton(batch, cache, scale=128**-0.5, k_scale=k_scale, v_scale=v_scale, sliding_window=window)
    assert not torch.isnan(out).any()
    original = batch.kv_cache
    batch.kv_cache = deq
    ref = reference_attention(batch, scale=128**-0.5, sliding_window=window)
    batch.kv_cache = original
    err = (out.double().cpu() - ref).abs().max().item()
    assert err < 2e-2, f"{q_dtype} fp8-KV attention vs float64 over the same cache: {err}"
