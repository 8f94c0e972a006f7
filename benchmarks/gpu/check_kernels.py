"""Check and time tokenmill's Triton attention kernels on a CUDA GPU.

Run from the repo root on the GPU machine (no network needed):

    python benchmarks/gpu/check_kernels.py            # checks + timings
    python benchmarks/gpu/check_kernels.py --quick    # fewer check cases
    python benchmarks/gpu/check_kernels.py --json-out results.json

1. Correctness: the paged-attention kernel vs the float64 reference of
   tests/kernels/attention_reference.py at real sizes (fp16/bf16, head sizes
   64/128/256, block sizes 16/32/64, GQA 8:1, windows, soft-cap), the KV write
   vs direct indexing, and a CUDA-graph capture/replay of the backend.
2. Timings (triton.testing.do_bench, median ms): decode-heavy batches
   (Llama-3.1-8B shapes: 32 q heads, 8 kv heads, head_dim 128) reported as
   GB/s of K/V read against the H200's 4.8 TB/s peak (about 4.3 TB/s seen in
   copies, docs/gpu_notes.md); a prefill chunk reported as TFLOP/s; each also
   with the TOKENMILL_FORCE_CC70 launch settings (fp16, num_stages 1);
   torch SDPA on the same (unpaged) shapes as a yardstick.

Every case is wrapped: a failure prints its traceback and the run goes on.
A table at the end lists every case.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

import torch
import torch.nn.functional as F

PEAK_HBM_GBPS = 4800.0  # H200 datasheet; ~4300 measured for device copies
PEAK_BF16_TFLOPS = 989.0  # H100/H200 dense bf16 datasheet; ~790 measured on random data


@dataclass
class Row:
    section: str
    case: str
    status: str  # ok | FAIL | ERROR
    value: float | None = None  # max error, or ms
    unit: str = ""
    extra: str = ""


ROWS: list[Row] = []


def record(row: Row) -> None:
    ROWS.append(row)
    v = "" if row.value is None else f"{row.value:.4g} {row.unit}"
    print(f"[{row.section}] {row.case}: {row.status} {v} {row.extra}", flush=True)


def guarded(section: str, case: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and continue
        traceback.print_exc()
        record(Row(section, case, "ERROR", extra=f"{type(e).__name__}: {str(e)[:160]}"))


# ---------------------------------------------------------------- correctness


def check_attention(dtype, head_dim, block_size, window, cap, num_stages):
    from attention_reference import make_paged_batch, reference_attention

    from tokenmill.kernels.triton.paged_attention_launch import paged_attention

    gen = torch.Generator().manual_seed(head_dim * 1000 + block_size)
    ctx = [0, 700, 1000, 31, 2000, 5, 64, 0]
    q = [300, 1, 1, 64, 1, 129, 1, 1]
    batch = make_paged_batch(ctx, q, num_heads=32, num_kv_heads=4, head_dim=head_dim, block_size=block_size,
                             dtype=dtype, device="cuda", num_padding_tokens=5, generator=gen)
    batch_8to1 = make_paged_batch(ctx, q, num_heads=64, num_kv_heads=8, head_dim=head_dim, block_size=block_size,
                                  dtype=dtype, device="cuda", num_padding_tokens=0, generator=gen)
    # decode-only: takes the split-KV path (few requests, long contexts)
    decodes = make_paged_batch([0, 5, 700, 4000, 8191], [1] * 5, num_heads=32, num_kv_heads=8, head_dim=head_dim,
                               block_size=block_size, dtype=dtype, device="cuda", num_padding_tokens=3, generator=gen)
    worst = 0.0
    for b in (batch, batch_8to1, decodes):
        kw = {"scale": head_dim**-0.5, "sliding_window": window, "logits_soft_cap": cap}
        out = torch.full_like(b.query, float("nan"))
        max_seq_len = max(c + n for c, n in zip(b.context_lens, b.query_lens, strict=True))
        paged_attention(b.query, b.kv_cache, b.block_table, b.seq_lens, b.query_start_loc, num_reqs=b.num_reqs,
                        max_query_len=b.max_query_len, max_seq_len=max_seq_len, out=out, num_stages=num_stages, **kw)
        torch.cuda.synchronize()
        if torch.isnan(out).any():
            raise AssertionError("NaN in output: an element was not written (or overflowed)")
        ref = reference_attention(b, **kw)
        n = ref.shape[0]
        worst = max(worst, (out[:n].double().cpu() - ref).abs().max().item())
        if b.num_padding_tokens and not torch.all(out[n:] == 0):
            raise AssertionError("padding rows not zero")
    return worst


def run_checks(quick: bool) -> None:
    dtypes = [torch.float16, torch.bfloat16]
    variants = [(None, None), (256, None), (None, 30.0), (100, 50.0)]
    for dtype in dtypes:
        for head_dim in (64, 128, 256):
            for block_size in (16, 32, 64):
                for window, cap in variants[:2] if quick else variants:
                    for stages, tag in ((2, ""), (1, " cc70-settings")):
                        if tag and (dtype == torch.bfloat16 or block_size != 16):
                            continue  # cc70 settings: fp16 only; one block size is enough
                        name = f"{str(dtype)[6:]} d{head_dim} bs{block_size} win={window} cap={cap}{tag}"
                        tol = 2e-2 if dtype == torch.bfloat16 else 4e-3

                        def one(name=name, dtype=dtype, head_dim=head_dim, block_size=block_size,
                                window=window, cap=cap, stages=stages, tol=tol):
                            err = check_attention(dtype, head_dim, block_size, window, cap, stages)
                            record(Row("check", name, "ok" if err < tol else "FAIL", err, "max|err|"))

                        guarded("check", name, one)
    guarded("check", "kv write", check_kv_write)
    guarded("check", "cuda graph decode", check_cuda_graph)


def check_kv_write():
    from tokenmill.kernels.triton.reshape_and_cache import reshape_and_cache

    num_tokens, kvh, d, bs, nb = 4096, 8, 128, 16, 2048
    for dtype in (torch.float16, torch.bfloat16):
        cache = torch.full((2, nb, bs, kvh, d), float("nan"), dtype=dtype, device="cuda")
        k = torch.randn(num_tokens, kvh, d, dtype=dtype, device="cuda")
        v = torch.randn(num_tokens, kvh, d, dtype=dtype, device="cuda")
        slots = torch.randperm(nb * bs, device="cuda")[:num_tokens]
        slots[::7] = -1
        reshape_and_cache(k, v, cache, slots)
        flat = cache.view(2, nb * bs, kvh, d)
        real = slots >= 0
        ok = torch.equal(flat[0, slots[real]], k[real]) and torch.equal(flat[1, slots[real]], v[real])
        untouched = torch.ones(nb * bs, dtype=torch.bool, device="cuda")
        untouched[slots[real]] = False
        ok = ok and bool(torch.isnan(flat[:, untouched]).all())
        record(Row("check", f"kv write {str(dtype)[6:]}", "ok" if ok else "FAIL"))


def check_cuda_graph():
    """Capture backend.forward for a padded decode batch; replay with new data."""
    from tokenmill.attention.backends.triton_attn import TritonAttentionBackend
    from tokenmill.attention.metadata import AttentionMetadata

    torch.manual_seed(0)
    num_reqs, padded, h, kvh, d, bs, max_blocks = 24, 32, 32, 8, 128, 16, 80
    nb = padded * max_blocks + 1
    dtype = torch.bfloat16
    cache = torch.randn(2, nb, bs, kvh, d, dtype=dtype, device="cuda")
    q = torch.zeros(padded, h, d, dtype=dtype, device="cuda")
    k = torch.zeros(padded, kvh, d, dtype=dtype, device="cuda")
    v = torch.zeros_like(k)
    qsl = torch.zeros(padded + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(padded, dtype=torch.int32, device="cuda")
    table = torch.zeros(padded, max_blocks, dtype=torch.int32, device="cuda")
    slots = torch.full((padded,), -1, dtype=torch.int64, device="cuda")
    backend = TritonAttentionBackend()

    def fill(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        lens = torch.randint(1, max_blocks * bs, (num_reqs,), generator=g, device="cuda", dtype=torch.int32)
        seq_lens.zero_()
        seq_lens[:num_reqs] = lens
        qsl.copy_(torch.arange(padded + 1, dtype=torch.int32, device="cuda").clamp(max=num_reqs))
        table.copy_(torch.randperm(nb - 1, device="cuda")[: padded * max_blocks].view(padded, max_blocks).int() + 1)
        pos = (lens - 1).long()
        slots.fill_(-1)
        slots[:num_reqs] = table[torch.arange(num_reqs, device="cuda"), pos // bs].long() * bs + pos % bs
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda", dtype=torch.float32).to(dtype))

    def md():
        return AttentionMetadata(num_actual_tokens=num_reqs, num_reqs=num_reqs, max_query_len=1, max_seq_len=max_blocks * bs,
                                 query_start_loc=qsl[: num_reqs + 1], seq_lens=seq_lens, block_table=table,
                                 slot_mapping=slots, query_start_loc_cpu=None, seq_lens_cpu=None)

    fill(1)
    backend.forward(q, k, v, cache, md(), scale=d**-0.5)  # warm-up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(q, k, v, cache, md(), scale=d**-0.5)
    worst = 0.0
    for seed in (2, 3):
        fill(seed)
        graph.replay()
        eager = backend.forward(q, k, v, cache, md(), scale=d**-0.5)
        torch.cuda.synchronize()
        worst = max(worst, (static_out.float() - eager.float()).abs().max().item())
    record(Row("check", "cuda graph decode replay vs eager", "ok" if worst == 0.0 else "FAIL", worst, "max|diff|"))


# -------------------------------------------------------------------- timings


def decode_inputs(num_reqs, ctx, h, kvh, d, bs, dtype):
    seq = ctx + 1
    blocks_per = math.ceil(seq / bs)
    nb = num_reqs * blocks_per
    cache = torch.randn(2, nb, bs, kvh, d, dtype=dtype, device="cuda")
    table = torch.randperm(nb, device="cuda").view(num_reqs, blocks_per).int()
    q = torch.randn(num_reqs, h, d, dtype=dtype, device="cuda")
    qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_reqs,), seq, dtype=torch.int32, device="cuda")
    return q, cache, table, seq_lens, qsl


def time_decode(num_reqs, ctx, dtype, num_stages, label, num_splits=None):
    import triton

    from tokenmill.kernels.triton.paged_attention_launch import paged_attention

    h, kvh, d, bs = 32, 8, 128, 16
    q, cache, table, seq_lens, qsl = decode_inputs(num_reqs, ctx, h, kvh, d, bs, dtype)
    out = torch.empty_like(q)

    def fn():
        paged_attention(q, cache, table, seq_lens, qsl, num_reqs=num_reqs, max_query_len=1, scale=d**-0.5,
                        out=out, num_stages=num_stages, max_seq_len=ctx + 1, num_splits=num_splits)

    ms = triton.testing.do_bench(fn, warmup=50, rep=200)
    kv_bytes = num_reqs * (ctx + 1) * kvh * d * 2 * q.element_size()
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    record(Row("decode", label, "ok", ms, "ms", f"{gbps:.0f} GB/s KV read ({100 * gbps / PEAK_HBM_GBPS:.0f}% of 4.8 TB/s)"))
    # yardstick: torch SDPA (flash/cudnn/mem-efficient as torch picks) on contiguous K/V, same bytes
    if num_stages == 2 and num_splits is None:
        kk = torch.randn(num_reqs, kvh, ctx + 1, d, dtype=dtype, device="cuda")
        vv = torch.randn_like(kk)
        qq = q.view(num_reqs, h, 1, d)
        ms2 = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True), warmup=50, rep=200)
        record(Row("decode", label + " [torch SDPA, unpaged]", "ok", ms2, "ms", f"{kv_bytes / (ms2 * 1e-3) / 1e9:.0f} GB/s"))


def time_prefill(chunk, ctx, dtype, num_stages, label):
    import triton

    from tokenmill.kernels.triton.paged_attention_launch import paged_attention

    h, kvh, d, bs = 32, 8, 128, 16
    seq = ctx + chunk
    nb = math.ceil(seq / bs)
    cache = torch.randn(2, nb, bs, kvh, d, dtype=dtype, device="cuda")
    table = torch.randperm(nb, device="cuda").view(1, nb).int()
    q = torch.randn(chunk, h, d, dtype=dtype, device="cuda")
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([seq], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def fn():
        paged_attention(q, cache, table, seq_lens, qsl, num_reqs=1, max_query_len=chunk, scale=d**-0.5,
                        out=out, num_stages=num_stages)

    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    visible = chunk * ctx + chunk * (chunk + 1) / 2  # (query, key) pairs under the causal mask
    flops = 4 * h * d * visible  # QK^T and PV, 2 flops per multiply-add
    tflops = flops / (ms * 1e-3) / 1e12
    record(Row("prefill", label, "ok", ms, "ms", f"{tflops:.0f} TFLOP/s ({100 * tflops / PEAK_BF16_TFLOPS:.0f}% of 989)"))
    if num_stages == 2 and ctx == 0:
        qq = q.view(1, chunk, h, d).transpose(1, 2)
        kk = torch.randn(1, kvh, chunk, d, dtype=dtype, device="cuda")
        vv = torch.randn_like(kk)
        ms2 = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True), warmup=25, rep=100
        )
        record(Row("prefill", label + " [torch SDPA, unpaged]", "ok", ms2, "ms",
                   f"{flops / (ms2 * 1e-3) / 1e12:.0f} TFLOP/s"))


def time_kv_write(num_tokens, dtype, label):
    import triton

    from tokenmill.kernels.triton.reshape_and_cache import reshape_and_cache

    kvh, d, bs = 8, 128, 16
    nb = num_tokens // bs * 2
    cache = torch.empty(2, nb, bs, kvh, d, dtype=dtype, device="cuda")
    k = torch.randn(num_tokens, kvh, d, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(nb * bs, device="cuda")[:num_tokens]
    ms = triton.testing.do_bench(lambda: reshape_and_cache(k, v, cache, slots), warmup=25, rep=100)
    moved = 2 * 2 * k.numel() * k.element_size()  # read k, v; write both
    record(Row("kv_write", label, "ok", ms, "ms", f"{moved / (ms * 1e-3) / 1e9:.0f} GB/s"))


def run_timings() -> None:
    for num_reqs in (64, 256):
        for dtype, stages, tag in ((torch.bfloat16, 2, "bf16"), (torch.float16, 1, "fp16 cc70-settings")):
            label = f"{num_reqs} reqs x ctx 1024, 32q/8kv d128, {tag}"
            guarded("decode", label, lambda n=num_reqs, dt=dtype, s=stages, lb=label: time_decode(n, 1024, dt, s, lb))
    for num_reqs in (1, 8):  # latency-bound: split-KV vs none
        for splits, tag in ((None, "bf16 split-KV auto"), (1, "bf16 no split")):
            label = f"{num_reqs} reqs x ctx 8192, 32q/8kv d128, {tag}"
            guarded("decode", label, lambda n=num_reqs, s=splits, lb=label: time_decode(n, 8192, torch.bfloat16, 2, lb, s))
    for chunk, ctx in ((2048, 0), (512, 3584)):
        for dtype, stages, tag in ((torch.bfloat16, 2, "bf16"), (torch.float16, 1, "fp16 cc70-settings")):
            label = f"chunk {chunk} after ctx {ctx}, 32q/8kv d128, {tag}"
            guarded("prefill", label, lambda c=chunk, x=ctx, dt=dtype, s=stages, lb=label: time_prefill(c, x, dt, s, lb))
    for n in (256, 8192):
        label = f"{n} tokens, 8kv d128 bf16"
        guarded("kv_write", label, lambda n=n, lb=label: time_kv_write(n, torch.bfloat16, lb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer correctness cases")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-timings", action="store_true")
    parser.add_argument("--json-out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA GPU visible: nothing to check (CPU tests: pytest tests/kernels).")
        return 1
    import triton

    print(f"device {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}", flush=True)
    if not args.skip_checks:
        run_checks(args.quick)
    if not args.skip_timings:
        run_timings()
    print("\n| section | case | status | value | notes |\n|---|---|---|---|---|")
    for r in ROWS:
        v = "" if r.value is None else f"{r.value:.4g} {r.unit}"
        print(f"| {r.section} | {r.case} | {r.status} | {v} | {r.extra} |")
    bad = [r for r in ROWS if r.status != "ok"]
    print(f"\n{len(ROWS) - len(bad)} ok, {len(bad)} failed or errored")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in ROWS], indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
