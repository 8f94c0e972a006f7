"""Time the quantized linear paths at batch-sized M (64..4096 rows) against bf16 on Llama-3.1-8B's shapes (one H200).

    python benchmarks/gpu/large_m_paths.py [--m 64 128 256 512 1024 2048 4096]

Why: offline on the H200 (1000 prompts, mean decode batch ~540 requests) the FP8 W8A8 checkpoint ran at 10,862
output tok/s and the AWQ one at 9,199, both below bf16's 11,778 (session 12, visit 1), so at these M their
linears are no faster than bf16's. Per (M, layer) this prints microseconds per call (CUDA graph of back-to-back
calls, each on its own weight copy so weights come from HBM: `quant_gemm.graph_time_ms`) for:

  bf16        F.linear(x, W_bf16)
  smm         W8A8 per-token quantization (Triton) + torch._scaled_mm row-wise, use_fast_accum=False (every
              128-deep partial sum promoted to float32; the engine's path before session 12)
  smm_fast    the same with use_fast_accum=True (the wgmma accumulator holds the whole K loop; the engine's
              path above SMALL_M_MAX since session 12, fp8_gemm.SCALED_MM_FAST_ACCUM)
  fp8_tri     the same product through the Triton fp8 tl.dot GEMM (use_scaled_mm=False)
  q4          int4 group-128 with zero points as planned (`quant_linear`: dequantize + cuBLAS above LARGE_M_MIN)
  q4_tiled    the same with the Triton tiled tensor-core GEMM forced (large_m_min raised past M)
  q4_deq      dequantize once + cuBLAS alone (the planned large-M path, for reference)
  q4_tc       the unpacking tensor-core GEMM (`quant_gemm_tc.py`) with its planned tiles (TC_TILES)
  tc_64x256   the same with 64 x 256 x 32 tiles, 8 warps, 4 stages

and a per-decoder-layer sum of the four linears. torch + triton only; W8A8 columns need cc >= 8.9.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

from tokenmill.kernels import fp8
from tokenmill.kernels.triton.fp8_gemm import fp8_linear_triton
from tokenmill.kernels.triton.fp8_quant import quantize_fp8_triton
from tokenmill.kernels.triton.quant_gemm_tc import quant_gemm_tc
from tokenmill.kernels.triton.quant_linear import dequantize_weight, quant_linear

from quant_gemm import L2_BYTES, LLAMA_8B_SHAPES, graph_time_ms, random_w4  # noqa: E402

LAYERS = [(name, n, k) for name, (n, k) in LLAMA_8B_SHAPES.items()]  # Llama-3.1-8B's four linears
COLS = ["bf16", "smm", "smm_fast", "fp8_tri", "q4", "q4_tiled", "q4_deq", "q4_tc", "tc_64x256"]


def smm(x: torch.Tensor, w: fp8.Fp8Weight, fast: bool) -> torch.Tensor:
    """Per-token quantization + torch._scaled_mm row-wise (the engine's large-M W8A8 path), fast accumulation or not."""
    xq, xs = quantize_fp8_triton(x)
    return torch._scaled_mm(xq, w.weight.t(), scale_a=xs.float().reshape(-1, 1).contiguous(),
                            scale_b=w.scale.float().reshape(1, -1).contiguous(), out_dtype=x.dtype,
                            use_fast_accum=fast)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=8, help="calls per CUDA graph")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call")
    print(f"{'M':>5} {'layer':>8} " + " ".join(f"{c:>9}" for c in COLS))
    totals: dict[tuple[int, str], float] = {}
    for name, n, k in LAYERS:
        # Copies of each format's weight that together fill twice the L2 (the int4 weight is half a byte per
        # element), up to one per call of a graph: every call reads its weight from HBM.
        copies = {f: max(2, min(args.reps, -(-2 * L2_BYTES // int(n * k * b)))) for f, b in
                  (("bf16", 2), ("fp8", 1), ("int4", 0.5))}
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies["bf16"])]
        w8 = [fp8.Fp8Weight(*fp8.quantize_fp8_per_row(w16[i % len(w16)].float())) for i in range(copies["fp8"])]
        w4 = [random_w4(n, k, torch.bfloat16) for _ in range(copies["int4"])]
        fmt = {"bf16": w16, "smm": w8, "smm_fast": w8, "fp8_tri": w8}
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            runs = {
                "bf16": lambda i: F.linear(x, w16[i]),
                "smm": lambda i: smm(x, w8[i], False),
                "smm_fast": lambda i: smm(x, w8[i], True),
                "fp8_tri": lambda i: fp8_linear_triton(x, w8[i], use_scaled_mm=False),
                "q4": lambda i: quant_linear(x, w4[i]),
                "q4_tiled": lambda i: quant_linear(x, w4[i], large_m_min=1 << 30),
                "q4_deq": lambda i: F.linear(x, dequantize_weight(w4[i], x.dtype)),
                "q4_tc": lambda i: quant_gemm_tc(x, w4[i]),
                "tc_64x256": lambda i: quant_gemm_tc(x, w4[i], tiles=(64, 256, 32, 8, 4)),
            }
            times = {}
            for c in COLS:
                try:
                    nw = len(fmt.get(c, w4))
                    times[c] = graph_time_ms([lambda c=c, i=i: runs[c](i % nw) for i in range(args.reps)]) * 1e3
                except Exception as e:  # a path that does not take this shape: say so, keep going
                    print(f"  {c} at M={m} {name}: {type(e).__name__}: {str(e)[:120]}")
            for c, t in times.items():
                totals[(m, c)] = totals.get((m, c), 0.0) + t
            print(f"{m:>5} {name:>8} " + " ".join(f"{times[c]:9.1f}" if c in times else f"{'-':>9}" for c in COLS),
                  flush=True)
        del w16, w8, w4, fmt
        torch.cuda.empty_cache()
    print("Per decoder layer (sum of the four linears), us, and the ratio to bf16:")
    for m in args.m:
        b = totals.get((m, "bf16"))
        print(f"{m:>5} {'layer':>8} " + " ".join(
            f"{totals[(m, c)]:9.1f}" if (m, c) in totals else f"{'-':>9}" for c in COLS)
            + "   " + " ".join(f"{c}={b / totals[(m, c)]:.2f}x" for c in COLS[1:] if b and (m, c) in totals))


if __name__ == "__main__":
    main()
