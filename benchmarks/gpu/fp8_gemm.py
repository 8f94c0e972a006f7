"""Time the FP8 linear paths against bf16 `F.linear` on Llama-3.1-8B's linear shapes (one H200).

    python benchmarks/gpu/fp8_gemm.py                  # M in 1, 16, 256, 4096
    python benchmarks/gpu/fp8_gemm.py --m 1 16 --cc70  # also the weight-only path as planned for cc 7.0
    python benchmarks/gpu/fp8_gemm.py --graphs --sweep-gemv   # decode: the FP8 GEMV's tiles, M in 1, 2, 4, 8

Per (M, layer) it prints microseconds (median of `triton.testing.do_bench`, CUDA graphs off, so launch
overheads count as in an eager forward; with --graphs as the engine's decode steps run instead: calls
captured back to back in one CUDA graph, each on its own copy of the weights, the copies of the FP8
weight together over twice the L2, so weights come from HBM) for:
  bf16        F.linear(x, W_bf16)
  w8a8_smm    per-token quantization (Triton, one launch) + torch._scaled_mm row-wise, per-channel W
  w8a8_tri    the same product through the Triton fp8 tl.dot GEMM (split-K at M <= 16; the GEMV kept off)
  w8a8_gemv   the same product through the FP8 GEMV (fp8_gemv.py, M <= 4; as planned at M <= FP8_GEMV_M_MAX)
  block       per-token-group quantization + the Triton 128x128 block-scaled GEMM
  w8a16       weight-only FP8 (bits decoded in the kernel: the GEMV up to FP8_GEMV_M_MAX, then split-K / tiled;
              dequantize + cuBLAS above LARGE_M_MIN)
  w8a16_cc70  (--cc70) weight-only as planned for cc 7.0, fp16 x (the GEMV with integer decoding up to
              FP8_GEMV_M_MAX, FMA split-K up to 8 rows, else cuBLAS)
and `floor`, the time to read the FP8 weight once at 4.8 TB/s (H200 HBM3e peak: N * K bytes / 4.8e12).
torch + triton only; needs cc >= 8.9 for the W8A8 columns.

--sweep-gemv prints one table instead: per (M, layer) bf16 F.linear, the split-K tl.dot GEMM and the GEMV with
each of GEMV_CONFIGS (block_n, words per step, warps, warps per SM, prefetch; the split of K follows the warps
per SM as in `fp8_gemm.plan_fp8_gemm`), all W8A8 with per-token activation quantization (included) and per-channel
weights, bfloat16 x; "-" where a config does not take M (the GEMV takes M <= 4). The `planned` column is
FP8_GEMV_TILES / FP8_GEMV_WARPS_PER_SM.
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
from tokenmill.kernels.triton import fp8_gemm
from tokenmill.kernels.triton.fp8_gemm import fp8_linear_triton
from tokenmill.kernels.triton.fp8_gemv import fp8_gemv
from tokenmill.kernels.triton.fp8_quant import quantize_fp8_triton
from tokenmill.kernels.triton.numerics import use_libdevice
from tokenmill.kernels.triton.splitk import device_facts

from quant_gemm import L2_BYTES, graph_time_ms  # noqa: E402  (benchmarks/gpu, torch + triton only)

# Llama-3.1-8B: hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128 -> (name, N, K)
LAYERS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
HBM_BYTES_PER_S = 4.8e12
# (block_n, words per step, warps, warps per SM, prefetch) for --sweep-gemv; the first is the planner's M = 1 tile.
# 0 warps per SM: no split of K (no split-K reduction launch; programs only from N).
GEMV_CONFIGS = [(64, 16, 1, 12, False), (64, 16, 1, 12, True), (32, 16, 1, 16, False), (64, 16, 1, 24, False),
                (64, 8, 1, 16, False), (64, 32, 1, 8, False), (128, 16, 1, 8, False), (128, 16, 1, 8, True),
                (128, 16, 2, 12, False), (128, 8, 2, 16, False), (256, 16, 4, 16, False), (32, 16, 1, 0, True),
                (64, 16, 1, 0, True)]


def print_row(totals: dict, m: int, name: str, floor: float, times: dict[str, float], cols: list[str],
              width: int) -> None:
    """Print one linear's row (us per column, '-' where not timed) and add it to the per-layer `totals`."""
    for c, t in [("floor", floor), *times.items()]:
        totals[(m, c)] = totals.get((m, c), 0.0) + t
    print(f"{m:>5} {name:>8} {floor:7.1f} " + " ".join(f"{times[c]:{width}.1f}" if c in times else f"{'-':>{width}}"
                                                     for c in cols))


def print_layer_totals(totals: dict, ms: list[int], cols: list[str], width: int) -> None:
    """Print the per-decoder-layer sums of the four linears collected by `print_row`."""
    print("Per decoder layer (sum of the four linears):")
    for m in ms:
        print(f"{m:>5} {'layer':>8} {totals[(m, 'floor')]:7.1f} "
              + " ".join(f"{totals[(m, c)]:{width}.1f}" if (m, c) in totals else f"{'-':>{width}}" for c in cols))


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # ms -> us


def gemv_w8a8(x: torch.Tensor, w: fp8.Fp8Weight, config: tuple[int, int, int, int, bool]) -> torch.Tensor:
    """W8A8 through the GEMV with one of GEMV_CONFIGS: per-token quantization, then the GEMV (+ split-K sum)."""
    bn, kw, warps, per_sm, prefetch = config
    m, k = x.shape
    n = w.weight.shape[0]
    cap, sms = device_facts(x.device)
    split = fp8_gemm.choose_split_k(k, 4 * kw, triton.cdiv(n, bn), 1 if per_sm == 0 else None,
                                    max(1, per_sm // warps) * sms)
    xq, xs = quantize_fp8_triton(x)
    return fp8_gemv(xq, w.weight, w.scale, xs, None, x.dtype, triton.next_power_of_2(m), bn, 4 * kw, split, warps,
                    hw_cvt=cap >= (8, 9) and use_libdevice(x), prefetch=prefetch)


def time_calls(runs: dict, cols: list[str], copies: int, graphs: bool) -> dict[str, float]:
    """Microseconds per call of each column's function (i -> call on weight copy i)."""
    if graphs:
        return {c: graph_time_ms([functools.partial(runs[c], i) for i in range(copies)]) * 1e3 for c in cols}
    return {c: bench(functools.partial(runs[c], 0)) for c in cols}


def sweep_gemv(ms: list[int], graphs: bool) -> None:
    """The --sweep-gemv table (module docstring)."""
    configs = {f"c{i}": c for i, c in enumerate(GEMV_CONFIGS)}
    for name, c in configs.items():
        print(f"  {name}: block_n {c[0]}, {c[1]} words ({4 * c[1]} K columns) per step, {c[2]} warps, "
              + (f"{c[3]} warps per SM" if c[3] else "no split of K") + (", prefetch" if c[4] else ""))
    cols = ["bf16", "splitk", "planned", *configs]
    print(f"{'M':>5} {'layer':>8} {'floor':>7} " + " ".join(f"{c:>8}" for c in cols) + "   (us)")
    totals: dict[tuple[int, str], float] = {}
    for name, n, k in LAYERS:
        copies = min(16, -(-2 * L2_BYTES // (n * k))) if graphs else 1
        w16, wc = [], []
        for _ in range(copies):
            wf = torch.randn(n, k, device="cuda") * 0.02
            w16.append(wf.to(torch.bfloat16))
            wc.append(fp8.Fp8Weight(*fp8.quantize_fp8_per_row(wf)))
            del wf
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            runs = {
                "bf16": lambda i: F.linear(x, w16[i]),
                "splitk": lambda i: fp8_linear_triton(x, wc[i], use_scaled_mm=False, gemv_m_max=0),
                "planned": lambda i: fp8_linear_triton(x, wc[i], use_scaled_mm=False, gemv_m_max=4),
            }
            for c, cfg in configs.items():
                runs[c] = functools.partial(lambda cfg, i: gemv_w8a8(x, wc[i], cfg), cfg)
            active = [c for c in cols if m <= 4 or c in ("bf16", "splitk")]
            times = time_calls(runs, active, copies, graphs)
            print_row(totals, m, name, n * k / HBM_BYTES_PER_S * 1e6, times, cols, 8)
    print_layer_totals(totals, ms, cols, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=None, help="rows of x (default 1 16 256 4096; "
                        "--sweep-gemv: 1 2 4 8)")
    parser.add_argument("--cc70", action="store_true", help="also time the weight-only path planned for cc 7.0")
    parser.add_argument("--graphs", action="store_true", help="time inside CUDA graphs, weights from HBM")
    parser.add_argument("--sweep-gemv", action="store_true", help="the FP8 GEMV's tiles against split-K and bf16")
    args = parser.parse_args()
    torch.manual_seed(0)
    cap = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} cc {cap[0]}.{cap[1]}, torch {torch.__version__}, triton {triton.__version__}")
    if args.sweep_gemv:
        sweep_gemv(args.m or [1, 2, 4, 8], args.graphs)
        return
    args.m = args.m or [1, 16, 256, 4096]
    cols = ["bf16", "w8a8_smm", "w8a8_tri", "w8a8_gemv", "block", "w8a16"] + (["w8a16_cc70"] if args.cc70 else [])
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
                "w8a8_tri": lambda i: fp8_linear_triton(x, wc[i], use_scaled_mm=False, gemv_m_max=0),
                "w8a8_gemv": lambda i: fp8_linear_triton(x, wc[i], use_scaled_mm=False, gemv_m_max=4),
                "block": lambda i: fp8_linear_triton(x, wb[i]),
                "w8a16": lambda i: fp8_linear_triton(x, wc[i], quantize_activations=False),
                "w8a16_cc70": lambda i: fp8_linear_triton(xh, wc[i], quantize_activations=False,
                                                          capability=(7, 0)),
            }
            active = [c for c in cols if c != "w8a8_gemv" or m <= 4]
            times = time_calls(runs, active, copies, args.graphs)
            print_row(totals, m, name, n * k / HBM_BYTES_PER_S * 1e6, times, cols, 10)
    print_layer_totals(totals, args.m, cols, 10)


if __name__ == "__main__":
    main()
