"""Time the quantized linear paths at batch-sized M (64..4096 rows) against bf16 on Llama-3.1-8B's shapes (one H200),
with several tile configurations of the unpacking tensor-core GEMM (`quant_gemm_tc.py`) side by side.

    python benchmarks/gpu/large_m_paths.py                       # bf16, q4_deq, q4 and the TC_CANDIDATES below
    python benchmarks/gpu/large_m_paths.py --m 256 1024 --tc-tiles 128x128x64w8s4g 256x128x64w8s3i
    python benchmarks/gpu/large_m_paths.py --cols bf16 q4_deq q4 smm smm_fast fp8_tri q4_tiled --json-out r.json
    python benchmarks/gpu/large_m_paths.py --dry-run             # CPU: Triton interpreter, tiny shapes, plumbing only

Why: offline on the H200 (1000 prompts, mean decode batch ~540 requests) the FP8 W8A8 checkpoint ran at 10,862
output tok/s and the AWQ one at 9,199, both below bf16's 11,778 (session 12, visit 1), so at these M their
linears are no faster than bf16's. Per (M, layer) this prints microseconds per call (CUDA graph of back-to-back
calls, each on its own weight copy so weights come from HBM: `quant_gemm.graph_time_ms`) for the columns in
--cols:

  bf16        F.linear(x, W_bf16)
  smm         W8A8 per-token quantization (Triton) + torch._scaled_mm row-wise, use_fast_accum=False (every
              128-deep partial sum promoted to float32; the engine's path before session 12)
  smm_fast    the same with use_fast_accum=True (the engine's path above SMALL_M_MAX since session 12)
  fp8_tri     the same product through the Triton fp8 tl.dot GEMM (use_scaled_mm=False)
  q4          int4 group-128 with zero points as planned (`quant_linear`; dequantize + cuBLAS while TC_M_MAX = 0)
  q4_tiled    the same with the Triton tiled tensor-core GEMM forced (large_m_min raised past M)
  q4_deq      dequantize once + cuBLAS alone (the planned large-M path, for reference)

then one column per --tc-tiles entry t0, t1, ... (legend printed first): `quant_gemm_tc` with that tile,
written BMxBNxBK w<warps> s<stages>, g (unpack "gather") or i ("index"), and s for the weight tile in shared
memory (operand "shared"; without it "register"), e.g. 128x128x64w8s4g, 128x128x32w8s4gs. Each tc
output is checked once against q4_deq's (a "!" after the time marks a relative error above 2e-2; "-" a
configuration that failed to launch, e.g. too much shared memory). Then per decoder layer (the four linears
summed) the ratio of each path to bf16, the fastest tc tile per M and whether it beats q4_deq, and a
TC_TILES / TC_M_MAX suggestion for `quant_gemm_tc.py` / `quant_linear.py`. torch + triton only; W8A8 columns
need cc >= 8.9.

--dry-run runs the same code on the CPU under the Triton interpreter (float16, one tiny layer, one call timed
with a wall clock: the numbers mean nothing), so argument parsing, the tile specs and the table are exercised
without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenmill.kernels import fp8  # noqa: E402
from tokenmill.kernels.triton.fp8_gemm import fp8_linear_triton  # noqa: E402
from tokenmill.kernels.triton.fp8_quant import quantize_fp8_triton  # noqa: E402
from tokenmill.kernels.triton.quant_gemm_tc import TcTiles, quant_gemm_tc  # noqa: E402
from tokenmill.kernels.triton.quant_linear import dequantize_weight, quant_linear  # noqa: E402

from quant_gemm import L2_BYTES, LLAMA_8B_SHAPES, graph_time_ms, random_w4  # noqa: E402

LAYERS = [(name, n, k) for name, (n, k) in LLAMA_8B_SHAPES.items()]  # Llama-3.1-8B's four linears
BASE_COLS = ["bf16", "smm", "smm_fast", "fp8_tri", "q4", "q4_tiled", "q4_deq"]
W8A8_COLS = {"smm", "smm_fast", "fp8_tri"}
# The tensor-core GEMM's candidate tiles, all without spills on sm_90a (quant_gemm_tc.py's docstring has what
# the compile showed for them: with W in registers, ptxas C7515 (wgmmas serialized; overlap only from other
# CTAs) or bank-conflicted word reads (64x128x32w8s3i, 128x64x32w4s4i); with W in shared memory ("...s"),
# back-to-back wgmmas then a full wait each K step).
TC_CANDIDATES = ["64x64x32w4s4i", "128x128x16w8s4i", "128x128x32w8s3i", "128x128x32w4s3i", "64x128x32w8s3i",
                 "128x64x32w4s4i", "128x128x32w8s4g", "64x128x64w4s4g", "256x128x64w8s3g", "128x128x32w8s4gs",
                 "64x128x64w4s4gs", "128x64x64w4s4gs", "128x128x64w8s4gs", "256x128x64w8s3gs"]
TILE_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)([gi])(s?)")


def parse_tile(spec: str) -> TcTiles:
    """'128x128x64w8s4g' -> TcTiles(128, 128, 64, 8, 4, "gather"): after the stages g (gather) or i (index),
    then s for operand "shared" (the weight tile in shared memory) or nothing for "register".

    Raises:
        argparse.ArgumentTypeError: the spec does not have that form.
    """
    mt = TILE_SPEC.fullmatch(spec)
    if not mt:
        raise argparse.ArgumentTypeError(f"tile {spec!r} is not BMxBNxBK w<warps> s<stages> g|i [s], "
                                         "e.g. 128x128x64w8s4g or 128x128x64w8s4gs.")
    bm, bn, bk, warps, stages = (int(v) for v in mt.groups()[:5])
    return TcTiles(bm, bn, bk, warps, stages, "gather" if mt.group(6) == "g" else "index",
                   "shared" if mt.group(7) else "register")


def tile_spec(t: TcTiles) -> str:
    """The inverse of `parse_tile`."""
    shared = "s" if t.operand == "shared" else ""
    return f"{t.block_m}x{t.block_n}x{t.block_k}w{t.warps}s{t.stages}{t.unpack[0]}{shared}"


def smm(x: torch.Tensor, w: fp8.Fp8Weight, fast: bool) -> torch.Tensor:
    """Per-token quantization + torch._scaled_mm row-wise (the engine's large-M W8A8 path), fast accumulation or not."""
    xq, xs = quantize_fp8_triton(x)
    return torch._scaled_mm(xq, w.weight.t(), scale_a=xs.float().reshape(-1, 1).contiguous(),
                            scale_b=w.scale.float().reshape(1, -1).contiguous(), out_dtype=x.dtype,
                            use_fast_accum=fast)


def wall_time_ms(calls: list) -> float:
    """Dry run: wall-clock ms of the first call (the Triton interpreter; only exercises the plumbing)."""
    start = time.perf_counter()
    calls[0]()
    return (time.perf_counter() - start) * 1e3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=None, help="rows (default 64..4096; dry run 5 37)")
    ap.add_argument("--reps", type=int, default=8, help="calls per CUDA graph")
    ap.add_argument("--cols", nargs="+", choices=BASE_COLS, default=None,
                    help="non-tc paths to time (default bf16 q4_deq q4; dry run bf16 q4_deq)")
    ap.add_argument("--tc-tiles", nargs="*", type=parse_tile, default=None,
                    help="quant_gemm_tc tiles, BMxBNxBK w<warps> s<stages> g|i (default TC_CANDIDATES)")
    ap.add_argument("--json-out", default=None, help="write the per-layer and per-M results here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes: plumbing only")
    args = ap.parse_args(argv)
    if args.m is None:
        args.m = [5, 37] if args.dry_run else [64, 128, 256, 512, 1024, 2048, 4096]
    if args.cols is None:
        args.cols = ["bf16", "q4_deq"] if args.dry_run else ["bf16", "q4_deq", "q4"]
    if "bf16" not in args.cols:
        args.cols.insert(0, "bf16")  # every ratio is against it
    if args.dry_run and set(args.cols) & W8A8_COLS:
        ap.error("--dry-run has no W8A8 columns (torch._scaled_mm needs a GPU).")
    if args.tc_tiles is None:
        args.tc_tiles = [parse_tile(s) for s in (["16x32x32w4s1g", "16x32x32w4s1i"] if args.dry_run
                                                 else TC_CANDIDATES)]
    return args


def summarize(args: argparse.Namespace, tc_names: list[str], totals: dict[tuple[int, str], float],
              bad: set[tuple[int, str]]) -> list[dict]:
    """Print the per-layer table, the winner per M and a TC_TILES suggestion; return the rows for --json-out."""
    cols = args.cols + tc_names
    print("\nPer decoder layer (sum of the four linears), us; then bf16 / path (higher is faster):")
    print(f"{'M':>5} " + " ".join(f"{c:>9}" for c in cols))
    rows = []
    for m in args.m:
        print(f"{m:>5} " + " ".join(f"{totals[(m, c)]:9.1f}" if (m, c) in totals else f"{'-':>9}" for c in cols))
    print(f"{'M':>5} " + " ".join(f"{c:>9}" for c in cols))
    for m in args.m:
        b = totals.get((m, "bf16"))
        print(f"{m:>5} " + " ".join(f"{b / totals[(m, c)]:8.2f}x" if b and (m, c) in totals else f"{'-':>9}"
                                    for c in cols))
    print("\nWinner per M (tc tiles whose output mismatched q4_deq are left out):")
    print(f"{'M':>5} {'best tc':>18} {'us':>8} {'x bf16':>7} {'x q4_deq':>9} {'winner':>18}")
    best_by_m = {}
    for m in args.m:
        tc_ok = [(totals[(m, c)], c) for c in tc_names if (m, c) in totals and (m, c) not in bad]
        every = [(totals[(m, c)], c) for c in args.cols if (m, c) in totals] + tc_ok
        if not tc_ok or not every:
            print(f"{m:>5} {'-':>18}")
            continue
        t, c = min(tc_ok)
        spec = tile_spec(args.tc_tiles[tc_names.index(c)])
        b, d = totals.get((m, "bf16")), totals.get((m, "q4_deq"))
        win = min(every)[1]
        win = tile_spec(args.tc_tiles[tc_names.index(win)]) if win in tc_names else win
        best_by_m[m] = (spec, t < d if d else False)
        print(f"{m:>5} {spec:>18} {t:8.1f} {b / t if b else 0:6.2f}x {d / t if d else 0:8.2f}x {win:>18}")
        rows.append(dict(m=m, best_tc=spec, best_tc_us=t, bf16_us=b, q4_deq_us=d,
                         per_path_us={c: totals[(m, c)] for c in cols if (m, c) in totals},
                         tc_specs={n: tile_spec(tl) for n, tl in zip(tc_names, args.tc_tiles)}))
    beats = [m for m, (_, ok) in best_by_m.items() if ok]
    if best_by_m:
        print("\nSuggested quant_gemm_tc.TC_TILES (best tile per measured M; the last row catches larger M):")
        ms = sorted(best_by_m)
        for i, m in enumerate(ms):
            top = "1 << 62" if i == len(ms) - 1 else str(m)
            t = parse_tile(best_by_m[m][0])
            print(f"    ({top}, TcTiles({t.block_m}, {t.block_n}, {t.block_k}, {t.warps}, {t.stages}, {t.unpack!r}, "
                  f"{t.operand!r})),")
        print(f"quant_linear.TC_M_MAX: tc beat q4_deq at M = {beats or 'none'} (TC_M_MAX covers M above "
              "LARGE_M_MIN up to the largest M of an unbroken run of wins).")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run needs TRITON_INTERPRET=1 before triton is imported (the command line "
                             "sets it; a caller sets it itself).")
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
        import conftest  # noqa: F401  (the kernel tests' interpreter workaround for NumPy >= 2.3)
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float16 if args.dry_run else torch.bfloat16  # the interpreter's bfloat16 tl.dot is wrong
    layers = [("tiny", 48, 256)] if args.dry_run else LAYERS
    timer = wall_time_ms if args.dry_run else graph_time_ms
    reps = 1 if args.dry_run else args.reps
    tc_names = [f"t{i}" for i in range(len(args.tc_tiles))]
    cols = args.cols + tc_names
    torch.manual_seed(0)
    where = "CPU dry run (Triton interpreter; times mean nothing)" if args.dry_run else torch.cuda.get_device_name()
    print(f"{where}, torch {torch.__version__}; us per call, {dtype}")
    for name, t in zip(tc_names, args.tc_tiles):
        print(f"  {name} = {tile_spec(t)}  {t}")
    print(f"{'M':>5} {'layer':>8} " + " ".join(f"{c:>9}" for c in cols))
    totals: dict[tuple[int, str], float] = {}
    counts: dict[tuple[int, str], int] = {}
    bad: set[tuple[int, str]] = set()
    per_layer = []
    for name, n, k in layers:
        # Copies of each format's weight that together fill twice the L2 (the int4 weight is half a byte per
        # element), up to one per call of a graph: every call reads its weight from HBM.
        copies = {f: 1 if args.dry_run else max(2, min(reps, -(-2 * L2_BYTES // int(n * k * b))))
                  for f, b in (("bf16", 2), ("fp8", 1), ("int4", 0.5))}
        w16 = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies["bf16"])]
        w8 = ([fp8.Fp8Weight(*fp8.quantize_fp8_per_row(w16[i % len(w16)].float())) for i in range(copies["fp8"])]
              if set(args.cols) & W8A8_COLS else [])
        w4 = [random_w4(n, k, dtype, device=dev) for _ in range(copies["int4"])]
        fmt = {"bf16": w16, "smm": w8, "smm_fast": w8, "fp8_tri": w8}
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            runs = {
                "bf16": lambda i: F.linear(x, w16[i]),
                "smm": lambda i: smm(x, w8[i], False),
                "smm_fast": lambda i: smm(x, w8[i], True),
                "fp8_tri": lambda i: fp8_linear_triton(x, w8[i], use_scaled_mm=False),
                "q4": lambda i: quant_linear(x, w4[i]),
                "q4_tiled": lambda i: quant_linear(x, w4[i], large_m_min=1 << 30),
                "q4_deq": lambda i: F.linear(x, dequantize_weight(w4[i], x.dtype)),
            }
            for c, t in zip(tc_names, args.tc_tiles):
                runs[c] = lambda i, t=t: quant_gemm_tc(x, w4[i], tiles=t)
            ref = F.linear(x, dequantize_weight(w4[0], x.dtype)).float()
            times = {}
            for c in cols:
                try:
                    if c in tc_names:
                        err = (runs[c](0).float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
                        if not err <= 2e-2:  # NaN counts as bad
                            bad.add((m, c))
                    nw = len(fmt.get(c, w4))
                    times[c] = timer([lambda c=c, i=i: runs[c](i % nw) for i in range(reps)]) * 1e3
                except Exception as e:  # a path that does not take this shape: say so, keep going
                    print(f"  {c} at M={m} {name}: {type(e).__name__}: {str(e)[:160]}")
            for c, t in times.items():
                totals[(m, c)] = totals.get((m, c), 0.0) + t
                counts[(m, c)] = counts.get((m, c), 0) + 1
            print(f"{m:>5} {name:>8} " + " ".join(
                (f"{times[c]:8.1f}" + ("!" if (m, c) in bad else " ")) if c in times else f"{'-':>9}" for c in cols),
                flush=True)
            per_layer.append(dict(m=m, layer=name, us=times))
        del w16, w8, w4, fmt
        if not args.dry_run:
            torch.cuda.empty_cache()
    # A path that failed on some layer has no per-layer total (a partial sum would look fast).
    totals = {key: t for key, t in totals.items() if counts[key] == len(layers)}
    rows = summarize(args, tc_names, totals, bad)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(dict(per_layer=per_layer, per_m=rows,
                                                       mismatched=sorted(f"M={m} {c}" for m, c in bad)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
