"""Time the FP8 linear paths against bf16 `F.linear` on Llama-3.1-8B's linear shapes (one H200).

    python benchmarks/gpu/fp8_gemm.py                  # M in 1, 16, 256, 4096
    python benchmarks/gpu/fp8_gemm.py --m 1 16 --cc70  # also the weight-only path as planned for cc 7.0

Per (M, layer) it prints microseconds (median of `triton.testing.do_bench`, CUDA graphs off, so launch
overheads count as in an eager forward; with --graphs as the engine's decode steps run instead: calls
captured back to back in one CUDA graph, each on its own copy of the weights, the copies of the FP8
weight together over twice the L2, so weights come from HBM) for:
  bf16        F.linear(x, W_bf16)
  w8a8_smm    per-token quantization (Triton, one launch) + torch._scaled_mm row-wise, per-channel W
  w8a8_tri    the same product through the Triton fp8 GEMM (fallback path)
  block       per-token-group quantization + the Triton 128x128 block-scaled GEMM
  w8a16       weight-only FP8 (bits decoded in the kernel; dequantize + cuBLAS above LARGE_M_MIN)
  w8a16_cc70  (--cc70) weight-only as planned for cc 7.0, fp16 x (FMA split-K up to 8 rows, else cuBLAS)
and `floor`, the time to read the FP8 weight once at 4.8 TB/s (H200 HBM3e peak: N * K bytes / 4.8e12).
torch + triton only; needs cc >= 8.9 for the W8A8 columns.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
import triton

from tokenmill.kernels import fp8
from tokenmill.kernels.triton.fp8_gemm import fp8_linear_triton

from quant_gemm import L2_BYTES, graph_time_ms  # noqa: E402  (benchmarks/gpu, torch + triton only)

# Llama-3.1-8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128 -> (name, N, K)
LAYERS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
HBM_BYTES_PER_S = 4.8e12


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # ms -> us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--cc70", action="store_true", help="also time the weight-only path planned for cc 7.0")
    parser.add_argument("--graphs", action="store_true", help="time inside CUDA graphs, weights from HBM")
    args = parser.parse_args()
    torch.manual_seed(0)
    cap = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} cc {cap[0]}.{cap[1]}, torch {torch.__version__}, triton {triton.__version__}")
    cols = ["bf16", "w8a8_smm", "w8a8_tri", "block", "w8a16"] + (["w8a16_cc70"] if args.cc70 else [])
    print(f"{'M':>5} {'layer':>8} {'floor':>7} " + " ".join(f"{c:>10}" for c in cols) + "   (us)")
    totals = {}
    for name, n, k in LAYERS:
        copies = min(16, -(-2 * L2_BYTES // (n * k))) if args.graphs else 1
        w16, wc, wb = [], [], []
        for _ in range(copies):
            wf = torch.randn(n, k, device="cuda") * 0.02
            w16.append(wf.to(torch.bfloat16))
            wc.append(fp8.Fp8Weight(*fp8.quantize_fp8_per_row(wf)))
            q, s = fp8.quantize_fp8_block(wf)
            wb.append(fp8.Fp8Weight(q, s, (128, 128)))
            del wf
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xh = x.half()
            runs = {
                "bf16": lambda i: F.linear(x, w16[i]),
                "w8a8_smm": lambda i: fp8_linear_triton(x, wc[i]),
                "w8a8_tri": lambda i: fp8_linear_triton(x, wc[i], use_scaled_mm=False),
                "block": lambda i: fp8_linear_triton(x, wb[i]),
                "w8a16": lambda i: fp8_linear_triton(x, wc[i], quantize_activations=False),
                "w8a16_cc70": lambda i: fp8_linear_triton(xh, wc[i], quantize_activations=False,
                                                          capability=(7, 0)),
            }
            if args.graphs:
                times = {c: graph_time_ms([functools.partial(runs[c], i) for i in range(copies)]) * 1e3
                         for c in cols}
            else:
                times = {c: bench(functools.partial(runs[c], 0)) for c in cols}
            floor = n * k / HBM_BYTES_PER_S * 1e6
            for c, t in [("floor", floor), *times.items()]:
                totals[(m, c)] = totals.get((m, c), 0.0) + t
            print(f"{m:>5} {name:>8} {floor:7.1f} " + " ".join(f"{times[c]:10.1f}" for c in cols))
    print("Per decoder layer (sum of the four linears):")
    for m in args.m:
        print(f"{m:>5} {'layer':>8} {totals[(m, 'floor')]:7.1f} " + " ".join(f"{totals[(m, c)]:10.1f}" for c in cols))


if __name__ == "__main__":
    main()
