"""Sweep the launch settings of tokenmill's int4 kernels on one CUDA GPU (needs only torch + triton).

Run from the repo root on the GPU machine:

    python benchmarks/gpu/sweep_quant.py --json-out sweep.json            # dense + MoE, bf16 (~3-4 min)
    python benchmarks/gpu/sweep_quant.py --cc70 --json-out sweep70.json   # TOKENMILL_FORCE_CC70=1 paths, fp16
    python benchmarks/gpu/sweep_quant.py --skip-moe --ms 1,4,16           # a subset

Dense: for each Llama-3.1-8B linear shape (W4A16 group 128 with zero
points) and M in {1, 2, 4, ..., 1024}, a compact grid of
`QuantLinearPlan`s per path: "gemv" (M <= 8), "splitk" (16-row tl.dot
tiles, M <= 64), "tiled" (M >= 16), each with and without the single-dot
tile (`one_dot`), and "cublas" (dequantize + F.linear); split_k is left to
`finish_plan` (programs per SM). MoE: `GroupedQuantConfig`s of the grouped
kernel for Qwen3-30B-A3B's experts (E 128, H 2048, I 768, top-8) at T in
{1, 16, 256, 2048} tokens. Every config's result is compared once with
dequantize-then-matmul (max abs error; a config past the tolerance is
reported "bad" and never picked); configs that fail to compile are skipped.
The Triton variants are compiled first in a pool of worker processes
(`--jobs`), which fills Triton's on-disk cache for the timing process.

Timing as benchmarks/gpu/quant_gemm.py: a CUDA graph of REPS calls, each on
another copy of the weights (together > 2x the L2, so weights come from
HBM), replayed a few times; median ms per call. Printed per (shape, M):
bf16 (fp16 with --cc70) F.linear, the default plan, the best config of
every path, the best overall and its speed-up over F.linear.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

if "--cc70" in sys.argv:
    os.environ["TOKENMILL_FORCE_CC70"] = "1"  # before tokenmill caches the device facts

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The shapes, copy sizing and CUDA-graph timer of the kernel table (one home for how a call is timed).
from quant_gemm import L2_BYTES, LLAMA_8B_SHAPES, MOE_TOKENS, REPS  # noqa: E402
from quant_gemm import graph_time_ms as _graph_time_ms  # noqa: E402

# Five replays per point (the table takes seven): the sweep times ~1,000 configurations.
graph_time_ms = functools.partial(_graph_time_ms, replays=5)
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MS_CC70 = (1, 2, 4, 8, 16)
MOE = dict(e=128, h=2048, i=768, top_k=8)


# ---------------------------------------------------------------------------------------------------------
# The grids (each <= 12 configs per path per (shape, M)).


def dense_grid(m: int, cc70: bool) -> list[dict]:
    """Plan fields (QuantLinearPlan kwargs) to try at M rows."""
    out = []
    if m <= 16:
        bm = max(1, 1 << (m - 1).bit_length())
        # (block_n, words per K step, warps, stages, programs per SM for the split-K count); float32 partial
        # sums per thread = bm * block_n * words / (32 * warps), kept <= 64.
        for bn, bkw, warps, stages, spm in [(64, 16, 2, 1, 8), (64, 16, 2, 1, 4), (64, 16, 2, 1, 16),
                                            (32, 16, 1, 1, 8), (32, 16, 1, 1, 16), (128, 16, 4, 1, 8),
                                            (128, 16, 2, 1, 8), (64, 32, 2, 1, 8), (32, 32, 2, 1, 8),
                                            (128, 8, 4, 1, 8), (64, 16, 4, 1, 8), (256, 16, 4, 1, 8),
                                            (64, 16, 2, 2, 8), (16, 16, 1, 1, 16)]:
            if bm * bn * bkw > 64 * 32 * warps:
                continue
            out.append(dict(path="gemv", block_m=bm, block_n=bn, block_k=bkw * 8, use_dot=False, num_warps=warps,
                            num_stages=1 if cc70 else stages, spm=spm))
    if cc70:
        if m <= 8:
            bm = max(1, 1 << (m - 1).bit_length())
            for bn, warps in [(32, 2), (64, 4), (128, 4)]:
                out.append(dict(path="splitk", block_m=bm, block_n=bn, block_k=128, use_dot=False, num_warps=warps,
                                num_stages=1))
        out.append(dict(path="cublas"))
        return out
    if m <= 64:
        bm = max(16, 1 << (m - 1).bit_length())
        # The tensor-core GEMV (quant_dot.py): (block_n, block_k, warps, stages, programs per SM).
        for bn, bk, warps, stages, spm in [(128, 128, 4, 4, 4), (128, 128, 4, 3, 8), (256, 128, 8, 3, 4),
                                           (64, 128, 4, 4, 8), (128, 64, 4, 4, 4), (256, 128, 8, 4, 2),
                                           (64, 128, 2, 4, 8)]:
            out.append(dict(path="dot", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                            spm=spm))
        for bn, warps, stages, one in [(64, 4, 3, False), (128, 4, 3, False), (64, 2, 3, False)]:
            out.append(dict(path="splitk", block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages,
                            one_dot=one))
    if m >= 64:
        # The tensor-core kernel with M tiles (x gathered in the nibble order): does it beat dequantize + cuBLAS?
        for bm, bn, warps, stages in [(64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (64, 256, 8, 3)]:
            out.append(dict(path="dot", block_m=bm, block_n=bn, block_k=128, num_warps=warps, num_stages=stages,
                            spm=2))
    if m >= 32:
        cap_m = max(32, 1 << (m - 1).bit_length())
        for bm, bn, warps, stages, one in [(32, 128, 4, 3, False), (64, 128, 4, 3, False), (128, 128, 8, 3, False),
                                           (128, 256, 8, 3, True)]:
            if bm <= cap_m:
                out.append(dict(path="tiled", block_m=bm, block_n=bn, block_k=128, num_warps=warps,
                                num_stages=stages, one_dot=one))
    out.append(dict(path="cublas"))
    return out


def moe_grid(t: int) -> list[dict]:
    """GroupedQuantConfig kwargs to try at T tokens."""
    pairs = t * MOE["top_k"]
    cands = [(16, 32, 128, 4, 2, False), (16, 64, 128, 4, 2, False), (16, 32, 128, 4, 3, False),
             (16, 64, 256, 4, 3, False), (16, 64, 128, 4, 3, True), (16, 128, 128, 8, 3, True),
             (32, 64, 128, 4, 3, False), (32, 128, 128, 4, 3, True), (64, 64, 128, 4, 3, False),
             (64, 128, 128, 8, 3, True), (64, 64, 128, 8, 3, True), (128, 128, 128, 8, 3, True)]
    out = []
    for bm, bn, bk, warps, stages, one in cands:
        if bm > 16 and pairs <= 128:
            continue  # decode: most tiles hold one or two pairs
        out.append(dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, one_dot=one))
    out = out[:10]
    # The tiles without the PTX dequantization (on by default where quant_dot.dot_supported), for comparison.
    out += [dict(out[0], ptx_deq=False), dict(out[-1], ptx_deq=False)]
    return out


# ---------------------------------------------------------------------------------------------------------
# Weights, plans, calls


def random_w4(n: int, k: int, dtype: torch.dtype, experts: int | None = None):
    from tokenmill.kernels.quant_pack import QuantTensors

    lead = () if experts is None else (experts,)
    ng = -(-k // 128)
    qweight = torch.randint(-2**31, 2**31 - 1, (*lead, n, -(-k // 8)), dtype=torch.int32, device="cuda")
    scales = (torch.rand(*lead, n, ng, device="cuda") * 0.01 + 0.001).to(dtype)
    qzeros = torch.randint(0, 16, (*lead, n, ng), dtype=torch.uint8, device="cuda")
    return QuantTensors(qweight, scales, qzeros, None, 4, 128, k)


def quant_bytes(n: int, k: int) -> int:
    return n * (k // 8) * 4 + n * (k // 128) * 3


def make_plan(cfg: dict, m: int, n: int, k: int, sms: int):
    """The finished QuantLinearPlan of `cfg` (its "spm": programs per SM wanted when picking split_k)."""
    from tokenmill.kernels.triton.quant_linear import QuantLinearPlan, finish_plan

    fields = {key: v for key, v in cfg.items() if key != "spm"}
    return finish_plan(QuantLinearPlan(**fields), m, n, k, sms, programs_per_sm=cfg.get("spm"))


def dense_call(x, w, cfg):
    from tokenmill.kernels.triton.quant_linear import quant_linear
    from tokenmill.kernels.triton.splitk import device_facts

    _, sms = device_facts(x.device)
    return quant_linear(x, w, plan=make_plan(cfg, x.shape[0], w.qweight.shape[0], w.in_features, sms))


def moe_call(x, w13, w2, weights, ids, cfg):
    from tokenmill.kernels.triton.fused_moe_quant import GroupedQuantConfig, fused_experts_quant_triton

    return fused_experts_quant_triton(x, w13, w2, weights, ids, config=GroupedQuantConfig(**cfg) if cfg else None)


def moe_inputs(t: int, dtype: torch.dtype, seed: int = 0):
    from tokenmill.layers.fused_moe.reference import select_experts

    gen = torch.Generator(device="cuda").manual_seed(seed + t)
    x = torch.randn(t, MOE["h"], device="cuda", dtype=dtype, generator=gen)
    weights, ids = select_experts(torch.randn(t, MOE["e"], device="cuda", generator=gen), MOE["top_k"], True)
    return x, weights, ids


# ---------------------------------------------------------------------------------------------------------
# Parallel compile (fills Triton's disk cache)

_WORKER: dict = {}


def _warm(task: tuple) -> str | None:
    """Run one config once in a worker process (compiles it); returns an error line or None."""
    kind, key, m, cfg, dtype_name = task
    dtype = getattr(torch, dtype_name)
    try:
        if kind == "dense":
            n, k = LLAMA_8B_SHAPES[key]
            if ("w", key) not in _WORKER:
                _WORKER[("w", key)] = random_w4(n, k, dtype)
            dense_call(torch.randn(m, k, device="cuda", dtype=dtype), _WORKER[("w", key)], cfg)
        else:
            if "moe" not in _WORKER:
                _WORKER["moe"] = (random_w4(2 * MOE["i"], MOE["h"], dtype, MOE["e"]),
                                  random_w4(MOE["h"], MOE["i"], dtype, MOE["e"]))
            x, weights, ids = moe_inputs(m, dtype)
            moe_call(x, *_WORKER["moe"], weights, ids, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped later
        return f"{kind} {key} m={m} {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def compile_key(kind: str, key: str, m: int, cfg: dict, sms: int) -> tuple:
    """Configs that compile to the same Triton variants (so one worker call warms them all)."""
    if kind == "moe":
        return ("moe", m > 0, tuple(sorted(cfg.items())))
    if cfg["path"] == "cublas":
        return ("cublas",)
    n, k = LLAMA_8B_SHAPES[key]
    plan = make_plan(cfg, m, n, k, sms)
    gm = 128 % plan.block_k == 0 or plan.block_k % 128 == 0
    return ("dense", plan.path, plan.block_m, plan.block_n, plan.block_k, plan.split_k > 1, plan.use_dot,
            plan.num_warps, plan.num_stages, plan.one_dot, gm)


def warm_all(tasks: list[tuple], jobs: int) -> set:
    """Compile every distinct variant of `tasks` in `jobs` processes; returns the set of failed task indices."""
    from tokenmill.kernels.triton.splitk import device_facts

    _, sms = device_facts(torch.device("cuda"))
    reps: dict = {}
    for i, (kind, key, m, cfg, _) in enumerate(tasks):
        reps.setdefault(compile_key(kind, key, m, cfg, sms), []).append(i)
    t0 = time.time()
    failed = set()
    firsts = [idx[0] for idx in reps.values()]
    ctx = mp.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            for i, err in zip(firsts, pool.map(_warm, [tasks[i] for i in firsts])):
                if err:
                    print(f"  compile/run failed, skipped: {err}", flush=True)
                    failed.update(reps[compile_key(*tasks[i][:4], sms)])
    except Exception as exc:  # noqa: BLE001 - a crashed worker: the timing process compiles what is left
        print(f"  compile pool failed ({type(exc).__name__}: {exc}); compiling in the timing process", flush=True)
    print(f"compiled {len(firsts)} variants for {len(tasks)} configs in {time.time() - t0:.0f} s "
          f"({jobs} processes)", flush=True)
    return failed


# ---------------------------------------------------------------------------------------------------------
def cfg_label(cfg: dict) -> str:
    if cfg.get("path") == "cublas":
        return "cublas"
    parts = [f"{cfg.get('block_m', 0)}x{cfg.get('block_n', 0)}x{cfg.get('block_k', 0)}", f"w{cfg.get('num_warps')}",
             f"s{cfg.get('num_stages')}"]
    if cfg.get("split_k"):
        parts.append(f"k{cfg['split_k']}")
    if cfg.get("one_dot"):
        parts.append("1dot")
    if cfg.get("ptx_deq") is False:
        parts.append("no-ptx")
    return " ".join(parts)


def sweep_dense(ms, dtype, cc70: bool, jobs: int, shapes) -> list[dict]:
    from tokenmill.kernels.triton.quant_linear import dequantize_weight, plan_quant_linear
    from tokenmill.kernels.triton.splitk import device_facts

    cap, sms = device_facts(torch.device("cuda"))
    tasks = [("dense", name, m, cfg, str(dtype).split(".")[-1]) for name in shapes for m in ms
             for cfg in dense_grid(m, cc70)]
    failed = warm_all(tasks, jobs)
    rows = []
    ti = 0
    for name in shapes:
        n, k = LLAMA_8B_SHAPES[name]
        wbytes = quant_bytes(n, k)
        q_copies = max(2, min(REPS, -(-2 * L2_BYTES // wbytes)))
        d_copies = max(2, min(REPS, -(-2 * L2_BYTES // (n * k * 2))))
        qws = [random_w4(n, k, dtype) for _ in range(q_copies)]
        dws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(d_copies)]
        ref_w = dequantize_weight(qws[0], torch.float32)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            ref = x.float() @ ref_w.t()
            tol = 2e-2 * ref.abs().max().item() + 1e-3
            dense_ms = graph_time_ms([lambda w=dws[i % d_copies]: F.linear(x, w) for i in range(REPS)])
            default = plan_quant_linear(m, n, qws[0], cap, sms)
            default_ms = graph_time_ms([lambda w=qws[i % q_copies]: dense_call(x, w, asdict(default))
                                        for i in range(REPS)])
            results = []
            for cfg in dense_grid(m, cc70):
                idx, ti = ti, ti + 1
                if idx in failed:
                    continue
                try:
                    plan = make_plan(cfg, m, n, k, sms)
                    y = dense_call(x, qws[0], cfg)
                    err = (y.float() - ref).abs().max().item()
                    t = graph_time_ms([lambda w=qws[i % q_copies]: dense_call(x, w, cfg) for i in range(REPS)])
                except Exception as exc:  # noqa: BLE001
                    print(f"  {name} m={m} {cfg_label(cfg)}: {type(exc).__name__}", flush=True)
                    continue
                full = dict(asdict(plan)) if cfg["path"] != "cublas" else dict(path="cublas")
                results.append(dict(config=full, label=cfg_label(full), ms=t, err=err, ok=err <= tol))
            good = [r for r in results if r["ok"]]
            best = min(good, key=lambda r: r["ms"]) if good else None
            per_path = {}
            for r in good:
                p = r["config"]["path"] + ("+1dot" if r["config"].get("one_dot") else "")
                if p not in per_path or r["ms"] < per_path[p]["ms"]:
                    per_path[p] = r
            row = dict(shape=name, n=n, k=k, m=m, dtype=str(dtype).split(".")[-1], cc=f"{cap[0]}.{cap[1]}",
                       dense_ms=dense_ms, default=dict(config=asdict(default), ms=default_ms),
                       floor_ms=wbytes / 4.8e12 * 1e3, best=best, best_per_path=per_path, results=results,
                       bad=[r for r in results if not r["ok"]])
            rows.append(row)
            print_dense_row(row, name)
        del qws, dws, ref_w
        torch.cuda.empty_cache()
    return rows


def print_dense_row(r: dict, name: str) -> None:
    dense = r["dense_ms"]
    b = r["best"]
    paths = "  ".join(f"{p}={v['ms'] * 1e3:.1f}" for p, v in sorted(r["best_per_path"].items()))
    maxerr = max((x["err"] for x in r["results"]), default=float("nan"))
    if b is None:
        print(f"{name:8} M={r['m']:<5} no valid config", flush=True)
        return
    print(f"{name:8} M={r['m']:<5} bf16 {dense * 1e3:7.1f} us  default {r['default']['ms'] * 1e3:7.1f} us  "
          f"best {b['ms'] * 1e3:7.1f} us ({dense / b['ms']:.2f}x of F.linear, floor {r['floor_ms'] * 1e3:.1f}) "
          f"{b['config']['path']} [{b['label']}] err {b['err']:.2e} (max over configs {maxerr:.2e}, "
          f"{len(r['bad'])} bad) | us by path: {paths}", flush=True)


def sweep_moe(dtype, jobs: int, tokens) -> list[dict]:
    from tokenmill.kernels.triton.fused_moe import fused_experts_triton
    from tokenmill.kernels.triton.quant_linear import dequantize_weight

    tasks = [("moe", "qwen3-30b-a3b", t, cfg, str(dtype).split(".")[-1]) for t in tokens for cfg in moe_grid(t)]
    failed = warm_all(tasks, jobs)
    w13q = random_w4(2 * MOE["i"], MOE["h"], dtype, MOE["e"])
    w2q = random_w4(MOE["h"], MOE["i"], dtype, MOE["e"])
    w13 = dequantize_weight(w13q, dtype)
    w2 = dequantize_weight(w2q, dtype)
    rows = []
    ti = 0
    reps = 5
    for t in tokens:
        x, weights, ids = moe_inputs(t, dtype)
        ref = fused_experts_triton(x, w13, w2, weights, ids).float()
        tol = 3e-2 * ref.abs().max().item() + 1e-3
        dense_ms = graph_time_ms([lambda: fused_experts_triton(x, w13, w2, weights, ids)] * reps)
        default_ms = graph_time_ms([lambda: moe_call(x, w13q, w2q, weights, ids, None)] * reps)
        results = []
        for cfg in moe_grid(t):
            idx, ti = ti, ti + 1
            if idx in failed:
                continue
            try:
                err = (moe_call(x, w13q, w2q, weights, ids, cfg).float() - ref).abs().max().item()
                ms = graph_time_ms([lambda c=cfg: moe_call(x, w13q, w2q, weights, ids, c)] * reps)
            except Exception as exc:  # noqa: BLE001
                print(f"  moe T={t} {cfg_label(cfg)}: {type(exc).__name__}", flush=True)
                continue
            results.append(dict(config=cfg, label=cfg_label(cfg), ms=ms, err=err, ok=err <= tol))
        good = [r for r in results if r["ok"]]
        best = min(good, key=lambda r: r["ms"]) if good else None
        row = dict(tokens=t, dtype=str(dtype).split(".")[-1], dense_ms=dense_ms, default_ms=default_ms, best=best,
                   results=results, bad=[r for r in results if not r["ok"]])
        rows.append(row)
        if best:
            print(f"moe T={t:<5} bf16 {dense_ms * 1e3:8.1f} us  default {default_ms * 1e3:8.1f} us  best "
                  f"{best['ms'] * 1e3:8.1f} us ({dense_ms / best['ms']:.2f}x of bf16) [{best['label']}] "
                  f"err {best['err']:.2e} ({len(row['bad'])} bad)", flush=True)
        else:
            print(f"moe T={t}: no valid config", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cc70", action="store_true", help="TOKENMILL_FORCE_CC70=1 paths, fp16, M in 1..16")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--ms", help="comma-separated M values (default: all)")
    ap.add_argument("--shapes", help="comma-separated Llama-3.1-8B shapes (qkv,o,gate_up,down)")
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_quant: no CUDA device visible")
        return 2
    t0 = time.time()
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (MS_CC70 if args.cc70 else MS)
    shapes = args.shapes.split(",") if args.shapes else list(LLAMA_8B_SHAPES)
    dtype = torch.float16 if args.cc70 else torch.bfloat16
    out: dict = {"device": torch.cuda.get_device_name(), "cc70": args.cc70, "dtype": str(dtype).split(".")[-1]}
    try:
        out["dense"] = sweep_dense(ms, dtype, args.cc70, args.jobs, shapes)
        if not args.skip_moe and not args.cc70:
            out["moe"] = sweep_moe(dtype, args.jobs, MOE_TOKENS)
    except Exception:  # noqa: BLE001 - keep what was measured
        traceback.print_exc()
    out["seconds"] = time.time() - t0
    print(f"sweep done in {out['seconds']:.0f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
