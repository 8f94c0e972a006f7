"""Sweep the paged-attention tile sizes on the GPU (decode and prefill shapes).

    python benchmarks/gpu/sweep_tiles.py            # the tile sweep
    python benchmarks/gpu/sweep_tiles.py --order    # default tiles, heavy-first vs request-order launch
    python benchmarks/gpu/sweep_tiles.py --mixed    # mixed steps, decodes in their own launch or not
    python benchmarks/gpu/sweep_tiles.py --long     # long context: a 16k chunk at 110k, decode splits at 126k
    python benchmarks/gpu/sweep_tiles.py --fp8      # full decode batch: bfloat16 vs fp8 caches

Prints, per shape, every (block_m, block_n, num_warps, num_stages) tried with
its median time, best first, so `choose_launch_config` defaults can be set
from measurements. Llama-3.1-8B attention shapes (32 q / 8 kv heads, d 128).
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton

import tokenmill.kernels.triton.paged_attention_launch as launch_mod
from tokenmill.kernels.triton.paged_attention_launch import paged_attention


def inputs(query_lens, ctx, h=32, kvh=8, d=128, bs=16, dtype=torch.bfloat16):
    """ctx: one context length for every request, or a list of one per request."""
    num_reqs = len(query_lens)
    ctx = [ctx] * num_reqs if isinstance(ctx, int) else ctx
    seq = [c + q for c, q in zip(ctx, query_lens, strict=True)]
    per = max(math.ceil(s / bs) for s in seq)
    nb = num_reqs * per
    cache = torch.randn(2, nb, bs, kvh, d, dtype=dtype, device="cuda")
    table = torch.randperm(nb, device="cuda").view(num_reqs, per).int()
    q = torch.randn(sum(query_lens), h, d, dtype=dtype, device="cuda")
    qsl = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(seq, dtype=torch.int32, device="cuda")
    return q, cache, table, seq_lens, qsl


def sweep(name, query_lens, ctx, grid):
    q, cache, table, seq_lens, qsl = inputs(query_lens, ctx)
    out = torch.empty_like(q)
    results = []
    for bm, bn, nw, ns in grid:
        def fn(bm=bm, bn=bn, nw=nw, ns=ns):
            paged_attention(q, cache, table, seq_lens, qsl, num_reqs=len(query_lens), max_query_len=max(query_lens),
                            scale=0.088, out=out, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            results.append((triton.testing.do_bench(fn, warmup=10, rep=50), bm, bn, nw, ns))
        except Exception as e:  # noqa: BLE001 - out of resources etc.
            print(f"  {name} bm{bm} bn{bn} w{nw} s{ns}: {type(e).__name__}", flush=True)
    results.sort()
    print(f"== {name}", flush=True)
    for ms, bm, bn, nw, ns in results[:8]:
        print(f"  {ms * 1000:8.1f} us  block_m {bm:3d} block_n {bn:3d} warps {nw} stages {ns}", flush=True)
    return results


def order_ab() -> None:
    """The default tiles in both launch orders (`paged_attention(heavy_first=...)`), one line per shape."""
    shapes = [("prefill 1024 ctx 0", [1024], 0), ("prefill 2048 ctx 0", [2048], 0),
              ("prefill 512 ctx 3584", [512], 3584), ("prefill 8 x 128 ctx 0", [128] * 8, 0),
              ("mixed 4x512 prefill + 128 decodes ctx 1024", [512] * 4 + [1] * 128, 1024),
              ("decode 64 x ctx 1024", [1] * 64, 1024)]
    print(f"{'shape':44s} {'heavy-first us':>15s} {'request order us':>17s} {'ratio':>6s}", flush=True)
    for name, query_lens, ctx in shapes:
        q, cache, table, seq_lens, qsl = inputs(query_lens, ctx)
        out = torch.empty_like(q)
        times = []
        for heavy in (True, False):
            def fn(heavy=heavy):
                paged_attention(q, cache, table, seq_lens, qsl, num_reqs=len(query_lens),
                                max_query_len=max(query_lens), max_seq_len=ctx + max(query_lens), scale=0.088,
                                out=out, heavy_first=heavy)
            times.append(triton.testing.do_bench(fn, warmup=20, rep=100) * 1000)
        print(f"{name:44s} {times[0]:15.1f} {times[1]:17.1f} {times[0] / times[1]:6.2f}", flush=True)


def mixed_ab() -> None:
    """Mixed steps with the decodes in their own 16-row launch (`paged_attention(split_decodes=True)`, the
    default) vs one 64-row launch, one line per shape; the last shapes have no decodes (the split's cost when
    there is nothing to split off: the decode launch's programs all return at once)."""
    shapes = [("255 decodes ctx 850 + 256 prefill ctx 0", [1] * 255 + [256], [850] * 255 + [0]),
              ("255 decodes ctx 850 + 256 prefill ctx 2048", [1] * 255 + [256], [850] * 255 + [2048]),
              ("64 decodes ctx 2000 + 512 prefill ctx 0", [1] * 64 + [512], [2000] * 64 + [0]),
              ("128 decodes ctx 1024 + 4x512 prefill ctx 1024", [512] * 4 + [1] * 128, 1024),
              ("64 spec decodes (q 4) ctx 1000 + 256 prefill", [4] * 64 + [256], [1000] * 64 + [0]),
              ("prefill only 1024 ctx 0", [1024], 0),
              ("prefill only 8 x 128 ctx 0", [128] * 8, 0)]
    print(f"{'shape':46s} {'split us':>9s} {'one launch us':>14s} {'ratio':>6s}", flush=True)
    for name, query_lens, ctx in shapes:
        q, cache, table, seq_lens, qsl = inputs(query_lens, ctx)
        out = torch.empty_like(q)
        max_seq_len = int(seq_lens.max())
        times, results = [], []
        for split in (True, False):
            def fn(split=split):
                paged_attention(q, cache, table, seq_lens, qsl, num_reqs=len(query_lens),
                                max_query_len=max(query_lens), max_seq_len=max_seq_len, scale=0.088, out=out,
                                split_decodes=split)
            fn()
            results.append(out.float())
            # Under a CUDA graph, as the engine runs mixed steps (up to 2048 tokens): the host's two launches
            # would otherwise be timed instead of the GPU's work for the small shapes.
            times.append(triton.testing.do_bench_cudagraph(fn, rep=100) * 1000)
        err = (results[0] - results[1]).abs().max().item()  # the same attention: bf16 rounding only
        print(f"{name:46s} {times[0]:9.1f} {times[1]:14.1f} {times[0] / times[1]:6.2f}   max diff {err:.1e}",
              flush=True)


def long_context() -> None:
    """Issue 24's long context, attention alone: the last 16,384-token prefill chunk of a 126k prompt (keys
    110,000 + 16,384) over a prefill tile grid, with TFLOP/s (causal: 4 * q * avg visible keys * heads * d); then
    one decode at 126k and at 1k context for several split counts (the CUDA graph fixes one for every length)."""
    q_len, ctx = 16384, 110000
    res = sweep(f"prefill {q_len} ctx {ctx}", [q_len], ctx, list(itertools.product([64, 128], [64, 128], [4, 8], [2, 3])))
    flop = 4 * q_len * (ctx + (q_len + 1) / 2) * 32 * 128
    for ms, bm, bn, nw, ns in res[:4]:
        print(f"  block_m {bm} block_n {bn} warps {nw} stages {ns}: {flop / (ms * 1e-3) / 1e12:.0f} TFLOP/s", flush=True)
    for c in (126000, 8192, 1024):
        q, cache, table, seq_lens, qsl = inputs([1], c)
        out = torch.empty_like(q)
        kv_bytes = 2 * (c + 1) * 8 * 128 * 2
        for splits in (8, 16, 32, 64):
            for bn in (64, 128):
                def fn(splits=splits, bn=bn):
                    paged_attention(q, cache, table, seq_lens, qsl, num_reqs=1, max_query_len=1, max_seq_len=c + 1,
                                    scale=0.088, out=out, num_splits=splits, block_n=bn)
                us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1000
                print(f"decode 1 x ctx {c:6d} splits {splits:2d} block_n {bn:3d}: {us:8.1f} us  "
                      f"{kv_bytes / (us * 1e-6) / 1e12:5.2f} TB/s", flush=True)


def fp8_ab() -> None:
    """A full offline decode batch (924 requests at ~900 context, Llama-3.1-8B heads) and a 2048-token prefill:
    bfloat16 cache vs fp8 e4m3 / e5m2 caches with bfloat16 queries (the kernel picks its fp8 decode itself)."""
    for name, query_lens, ctx in [("decode 924 x ctx 900", [1] * 924, 900), ("prefill 2048 ctx 0", [2048], 0)]:
        q, cache, table, seq_lens, qsl = inputs(query_lens, ctx)
        out = torch.empty_like(q)
        line = []
        for dt, native in ((None, True), (torch.float8_e4m3fn, True), (torch.float8_e5m2, True),
                           (torch.float8_e4m3fn, False)):
            c = cache if dt is None else (cache * 0.5).to(dt)
            def fn(c=c, native=native):
                launch_mod.FP8_NATIVE = native
                paged_attention(q, c, table, seq_lens, qsl, num_reqs=len(query_lens), max_query_len=max(query_lens),
                                max_seq_len=ctx + max(query_lens), scale=0.088, out=out, k_scale=2.0, v_scale=2.0)
            line.append(triton.testing.do_bench_cudagraph(fn, rep=100) * 1000)
        print(f"{name:24s} bf16 {line[0]:8.1f} us   e4m3 {line[1]:8.1f} us ({line[0] / line[1]:.2f}x)   "
              f"e5m2 {line[2]:8.1f} us ({line[0] / line[2]:.2f}x)   e4m3 bit decode {line[3]:8.1f} us", flush=True)
    launch_mod.FP8_NATIVE = True


def main() -> None:
    if "--long" in sys.argv[1:]:
        long_context()
        return
    if "--fp8" in sys.argv[1:]:
        fp8_ab()
        return
    if "--order" in sys.argv[1:]:
        order_ab()
        return
    if "--mixed" in sys.argv[1:]:
        mixed_ab()
        return
    decode_grid = list(itertools.product([16], [32, 64, 128], [2, 4, 8], [1, 2, 3]))
    prefill_grid = list(itertools.product([64, 128], [32, 64, 128], [4, 8], [1, 2, 3]))
    sweep("decode 64 x ctx 1024", [1] * 64, 1024, decode_grid)
    sweep("decode 256 x ctx 1024", [1] * 256, 1024, decode_grid)
    sweep("prefill 2048 ctx 0", [2048], 0, prefill_grid)
    sweep("prefill 512 ctx 3584", [512], 3584, prefill_grid)
    sweep("mixed 4x512 prefill + 128 decodes ctx 1024", [512] * 4 + [1] * 128, 1024, prefill_grid)


if __name__ == "__main__":
    main()
