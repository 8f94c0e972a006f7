"""The CPU C kernels against the PyTorch code they replace, per call (median ms), on synthetic tensors.

- decode attention, one layer: `cpu_decode.paged_decode_attention` vs `block_decode_attention`
  (SmolLM2-135M shapes: 9 query / 3 KV heads of 64; `--rows` decodes of 150-200 keys, block size 16,
  each row's blocks allocated one after another as the engine allocates them, or shuffled with --scatter);
- RMSNorm with the residual add, SiLU-and-mul and RoPE at `--rows` tokens (576 / 1536 wide, SmolLM2):
  `cpu_elementwise` vs the layers' `forward_torch` / `forward_cpu`.

    PYTHONPATH=. python benchmarks/cpu_kernels_bench.py --dtype bfloat16 --threads 2 --rows 64
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=64, help="Decode rows / tokens per call.")
    p.add_argument("--scatter", action="store_true", help="Shuffle the physical blocks of every row.")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    from tokenmill.attention.backends.block_decode import block_decode_attention, plan_block_decode
    from tokenmill.kernels.cpu import decode as cpu_decode
    from tokenmill.kernels.cpu import elementwise as cpu_elementwise
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.layernorm import RMSNorm
    from tokenmill.layers.rotary import get_rope

    lib, elt = cpu_decode.load_kernel(), cpu_elementwise.load()
    if lib is None or elt is None:
        raise SystemExit("the C kernels did not build here (no C compiler, or TOKENMILL_CPU_KERNELS=0)")

    rows, heads, kv_heads, head_dim, bs = args.rows, 9, 3, 64, 16
    rng = np.random.default_rng(0)
    seq_lens = rng.integers(150, 200, rows)
    per_row = -(-seq_lens // bs)
    ids = rng.permutation(int(per_row.sum())) if args.scatter else np.arange(int(per_row.sum()))
    table = np.zeros((rows, per_row.max()), np.int32)
    starts = np.cumsum(per_row) - per_row
    for i in range(rows):
        table[i, : per_row[i]] = ids[starts[i] : starts[i] + per_row[i]]
    cache = torch.randn(2, int(per_row.sum()), bs, kv_heads, head_dim).to(dtype)
    query = torch.randn(rows, heads, head_dim).to(dtype)
    out = torch.empty_like(query)
    lens = torch.from_numpy(seq_lens.astype(np.int64))
    c_attn = _median_ms(lambda: cpu_decode.paged_decode_attention(
        lib, query, cache, torch.from_numpy(table), torch.arange(rows), torch.arange(rows), lens, 0.125, out),
        args.reps)
    plan = plan_block_decode(table, np.arange(rows), np.arange(rows, dtype=np.int64), seq_lens.astype(np.int64),
                             bs, None)
    t_attn = _median_ms(lambda: block_decode_attention(query, cache, plan, 0.125, None), args.reps // 4)
    kv_mb = seq_lens.sum() * kv_heads * head_dim * 2 * cache.element_size() / 1e6

    norm = RMSNorm(576, 1e-5)
    norm.weight.data = norm.weight.data.to(dtype)
    x, res = torch.randn(rows, 576).to(dtype), torch.randn(rows, 576).to(dtype)
    act, gate_up = SiluAndMul(), torch.randn(rows, 3072).to(dtype)
    rope = get_rope(64, 8192, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(rows, 15 * 64).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    positions = torch.from_numpy(seq_lens.astype(np.int64) - 1)
    table_rows = [
        ("decode attention, one layer", c_attn, t_attn, f"{kv_mb:.1f} MB of K/V: {kv_mb / c_attn:.1f} GB/s in C"),
        ("RMSNorm + residual add", _median_ms(lambda: norm(x, res), args.reps),
         _median_ms(lambda: norm.forward_torch(x, res), args.reps), "576 wide"),
        ("SiLU-and-mul", _median_ms(lambda: act(gate_up), args.reps),
         _median_ms(lambda: act.forward_torch(gate_up), args.reps), "2 x 1536 wide"),
        ("RoPE (q and k)", _median_ms(lambda: rope(positions, q, k), args.reps),
         _median_ms(lambda: rope.forward_cpu(positions, q, k), args.reps), "9 + 3 heads of 64; vs forward_cpu"),
    ]
    print(f"{args.dtype}, {args.threads} threads, {rows} rows{' (scattered blocks)' if args.scatter else ''}: "
          "median ms per call")
    print(f"{'op':30s} {'C':>8s} {'PyTorch':>8s} {'speed-up':>8s}  note")
    for name, c_ms, t_ms, note in table_rows:
        print(f"{name:30s} {c_ms:8.3f} {t_ms:8.3f} {t_ms / c_ms:7.1f}x  {note}")


if __name__ == "__main__":
    main()
