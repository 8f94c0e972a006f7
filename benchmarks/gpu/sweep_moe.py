"""Sweep the bf16 fused-MoE grouped-GEMM tiles and time a whole MoE layer by part, on one CUDA GPU.

Run from the repo root on the GPU machine (~2-3 min on an H200):

    python benchmarks/gpu/sweep_moe.py --json-out sweep_moe.json
    python benchmarks/gpu/sweep_moe.py --models qwen3-30b-a3b --tokens 1,16 --jobs 8

Shapes: Qwen3-30B-A3B (E 128, H 2048, I 768, top-8, silu) and gpt-oss-20b
(E 32, H 2880, I 2880, top-4, swigluoai, expert biases; bf16 experts here,
plus its real MXFP4 layer for reference), read from benchmarks/configs, at
T in {1, 16, 64, 256, 1024, 4096} tokens with random routing.

1. Tiles: every `GroupedGemmConfig` of a small grid per T (`grid`) is
   timed for each projection (w13 gate|up, w2 down) on its own; a config
   whose output differs from the default config's by more than 2% of the
   output's max is reported "bad" and never picked. The best block_m is the
   one with the smallest sum of the two projections' best times (one sort
   serves both). The Triton variants are compiled first in a pool of
   worker processes (`--jobs`), which fills Triton's on-disk cache.
2. Layer by part, default configs: routing (`select_experts`: softmax,
   top-k, renormalize in one Triton launch, and the PyTorch ops it
   replaced), sort (`moe_align_block_size`; "sort.1k" with chunk 1024,
   one launch up to 1024 pairs; "sort.pt" the PyTorch sort it replaced),
   w13 GEMM, activation, w2 GEMM, top-k sum; then the whole layer
   (routing + `fused_experts_triton`) with the default and the best configs.

Timing as quant_gemm.py: REPS calls captured in one CUDA graph (each call
routes other tokens, so the decode calls read other experts and the weights
come from HBM), replayed after a warm-up; median us per call. At the end a
table per model and `_TABLE` rows (fused_moe.py) built from the best
configs, ready to paste.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import torch  # noqa: E402
from quant_gemm import graph_time_ms  # noqa: E402

TOKENS = (1, 16, 64, 256, 1024, 4096)
CONFIGS = ROOT / "benchmarks" / "configs"
DEVICE = "cuda"  # a CPU dry run of the logic sets "cpu" (Triton interpreter)


def model_shapes() -> dict[str, dict]:
    """E, H, I, top-k, activation and biases of the two models, from their benchmark configs."""
    q = json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text())
    g = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    return {
        "qwen3-30b-a3b": dict(e=q["num_experts"], h=q["hidden_size"], i=q["moe_intermediate_size"],
                              top_k=q["num_experts_per_tok"], act="silu", bias=False),
        "gpt-oss-20b": dict(e=g["num_local_experts"], h=g["hidden_size"], i=g["intermediate_size"],
                            top_k=g["num_experts_per_tok"], act="swigluoai", bias=True),
    }


def reps_for(t: int) -> int:
    return 20 if t <= 64 else 8 if t <= 1024 else 3


def grid(pairs_per_expert: float) -> list[dict]:
    """GroupedGemmConfig kwargs tried at this many pairs per expert (each projection on its own)."""
    if pairs_per_expert <= 2:  # decode: each routed expert read once; the tile shape sets the programs per SM
        cands = [(16, bn, bk, gm, w, s) for bn, bk, gm, w, s in
                 [(32, 128, 0, 4, 4), (32, 256, 0, 4, 3), (64, 64, 0, 4, 4), (64, 128, 0, 4, 3), (64, 128, 0, 4, 4),
                  (64, 128, 0, 4, 5), (64, 256, 0, 4, 3), (64, 256, 0, 8, 3), (128, 64, 0, 4, 4),
                  (128, 128, 0, 4, 3), (128, 128, 0, 8, 4), (64, 32, 0, 4, 3)]]
    elif pairs_per_expert <= 8:
        cands = [(16, 64, 128, 0, 4, 3), (16, 64, 128, 0, 4, 4), (16, 128, 128, 0, 4, 3), (16, 64, 256, 0, 4, 3),
                 (16, 128, 64, 0, 4, 4), (16, 32, 128, 0, 4, 4), (32, 64, 128, 0, 4, 3), (32, 128, 64, 0, 4, 4),
                 (32, 64, 64, 0, 4, 4), (32, 128, 128, 0, 8, 3), (16, 64, 32, 0, 4, 3)]
    elif pairs_per_expert <= 40:
        cands = [(16, 64, 128, 0, 4, 4), (16, 128, 128, 0, 4, 3), (32, 64, 64, 0, 4, 4), (32, 64, 128, 0, 4, 3),
                 (32, 128, 64, 0, 4, 4), (32, 128, 128, 0, 8, 3), (64, 64, 64, 0, 4, 4), (64, 128, 64, 0, 4, 3),
                 (64, 128, 64, 8, 4, 3), (64, 128, 128, 0, 8, 3), (64, 64, 32, 0, 4, 3)]
    else:
        cands = [(64, 64, 64, 0, 4, 4), (64, 128, 64, 0, 4, 3), (64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 4, 4),
                 (64, 256, 64, 8, 8, 3), (128, 128, 64, 0, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 3),
                 (128, 256, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4), (128, 128, 32, 8, 4, 4), (64, 64, 32, 0, 4, 3)]
    keys = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
    return [dict(zip(keys, c)) for c in cands]


def label(cfg: dict) -> str:
    return (f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} g{cfg['group_m']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}")


# ---------------------------------------------------------------------------------------------------------
# Weights and calls


def make_weights(shape: dict, experts: int | None = None, seed: int = 0) -> dict:
    e = experts or shape["e"]
    h, i = shape["h"], shape["i"]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = dict(w13=torch.randn(e, 2 * i, h, generator=g, device=DEVICE).to(torch.bfloat16) / h**0.5,
             w2=torch.randn(e, h, i, generator=g, device=DEVICE).to(torch.bfloat16) / i**0.5, b13=None, b2=None)
    if shape["bias"]:
        w["b13"] = (torch.randn(e, 2 * i, generator=g, device=DEVICE) * 0.1).to(torch.bfloat16)
        w["b2"] = (torch.randn(e, h, generator=g, device=DEVICE) * 0.1).to(torch.bfloat16)
    return w


def routings(shape: dict, t: int, count: int, experts: int | None = None, seed: int = 1) -> list[dict]:
    """`count` different token batches: x [T, H], router logits, their routing and the projections' inputs."""
    from tokenmill.layers.fused_moe.reference import select_experts

    e = experts or shape["e"]
    g = torch.Generator(device=DEVICE).manual_seed(seed + t)
    out = []
    for _ in range(count):
        logits = torch.randn(t, e, generator=g, device=DEVICE)
        weights, ids = select_experts(logits, shape["top_k"], True)
        out.append(dict(x=torch.randn(t, shape["h"], generator=g, device=DEVICE).to(torch.bfloat16), logits=logits,
                        weights=weights, ids=ids, pair_w=weights.reshape(-1).float().contiguous(),
                        inter=torch.randn(t * shape["top_k"], shape["i"], generator=g, device=DEVICE).to(
                            torch.bfloat16)))
    return out


def gemm_call(which: str, shape: dict, w: dict, r: dict, aligned, cfg, out: torch.Tensor) -> None:
    from tokenmill.kernels.triton import fused_moe as fm

    if which == "w13":
        fm._grouped_gemm(r["x"], w["w13"], out, w["b13"], None, aligned, shape["top_k"], cfg)
    else:
        fm._grouped_gemm(r["inter"], w["w2"], out, w["b2"], r["pair_w"], aligned, 1, cfg)


def gemm_out(which: str, shape: dict, t: int) -> torch.Tensor:
    n = 2 * shape["i"] if which == "w13" else shape["h"]
    return torch.empty(t * shape["top_k"], n, dtype=torch.bfloat16, device=DEVICE)


def full_config(cfg: dict):
    from tokenmill.kernels.triton.fused_moe import GroupedGemmConfig

    return GroupedGemmConfig(**cfg)


# ---------------------------------------------------------------------------------------------------------
# Parallel compile


_WORKER: dict = {}


def _warm(task: tuple) -> str | None:
    """Compile (run once) one config of one projection of one model in a worker; an error line or None."""
    name, which, cfg = task
    try:
        from tokenmill.kernels.triton.fused_moe import moe_align_block_size

        shape = model_shapes()[name]
        if name not in _WORKER:  # 8 experts: the kernels specialize on dtypes and divisibility, not on E
            _WORKER[name] = (make_weights(shape, experts=8), routings(shape, 16, 1, experts=8)[0])
        w, r = _WORKER[name]
        aligned = moe_align_block_size(r["ids"], cfg["block_m"], 8)
        gemm_call(which, shape, w, r, aligned, full_config(cfg), gemm_out(which, shape, 16))
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - a config that fails to compile is skipped later
        return f"{name} {which} {label(cfg)}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def warm_all(names: list[str], tokens: list[int], jobs: int) -> set:
    shapes = model_shapes()
    tasks = sorted({(n, which, tuple(sorted(c.items()))) for n in names for t in tokens
                    for c in grid(t * shapes[n]["top_k"] / shapes[n]["e"]) for which in ("w13", "w2")})
    t0 = time.time()
    failed = set()
    try:
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            for task, err in zip(tasks, pool.map(_warm, [(n, w, dict(c)) for n, w, c in tasks])):
                if err:
                    print(f"  compile/run failed, skipped: {err}", flush=True)
                    failed.add(task)
    except Exception as exc:  # noqa: BLE001 - a crashed pool: the timing process compiles what is left
        print(f"  compile pool failed ({type(exc).__name__}: {exc}); compiling in the timing process", flush=True)
    print(f"compiled {len(tasks)} variants in {time.time() - t0:.0f} s ({jobs} processes)", flush=True)
    return failed


# ---------------------------------------------------------------------------------------------------------
# Timing


def torch_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch routing that `select_experts` ran on CUDA before its Triton kernel (renormalized)."""
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def us(calls: list) -> float:
    return graph_time_ms(calls, replays=5) * 1e3


def sweep_point(name: str, shape: dict, w: dict, t: int, failed: set) -> dict:
    from tokenmill.kernels.triton.fused_moe import (  # noqa: I001
        default_gemm_configs,
        expert_activation,
        fused_experts_triton,
        moe_align_block_size,
        moe_sum,
    )
    from tokenmill.kernels.triton.moe_align import moe_align_block_size_torch
    from tokenmill.layers.fused_moe.reference import select_experts

    reps = reps_for(t)
    rs = routings(shape, t, reps)
    e, k = shape["e"], shape["top_k"]
    pairs = t * k
    d13, d2 = default_gemm_configs(pairs, e, torch.bfloat16, torch.device(DEVICE))
    row = dict(model=name, tokens=t, pairs=pairs, pairs_per_expert=pairs / e, reps=reps,
               default=dict(w13=asdict(d13), w2=asdict(d2)))

    # -- tiles: each projection alone, per block_m
    aligned_by_m: dict[int, list] = {}

    def aligned(bm: int) -> list:
        if bm not in aligned_by_m:
            aligned_by_m[bm] = [moe_align_block_size(r["ids"], bm, e) for r in rs]
        return aligned_by_m[bm]

    results: dict[str, list] = {"w13": [], "w2": []}
    for which in ("w13", "w2"):
        out = gemm_out(which, shape, t)
        dcfg = d13 if which == "w13" else d2
        gemm_call(which, shape, w, rs[0], aligned(dcfg.block_m)[0], dcfg, out)
        ref = out.float().clone()
        tol = 2e-2 * ref.abs().max().item() + 1e-3
        row[f"{which}_default_us"] = us([lambda i=i: gemm_call(which, shape, w, rs[i], aligned(dcfg.block_m)[i],
                                                               dcfg, out) for i in range(reps)])
        for cfg in grid(pairs / e):
            if (name, which, tuple(sorted(cfg.items()))) in failed:
                continue
            fc = full_config(cfg)
            try:
                gemm_call(which, shape, w, rs[0], aligned(fc.block_m)[0], fc, out)
                err = (out.float() - ref).abs().max().item()
                t_us = us([lambda i=i: gemm_call(which, shape, w, rs[i], aligned(fc.block_m)[i], fc, out)
                           for i in range(reps)])
            except Exception as exc:  # noqa: BLE001
                print(f"  {name} T={t} {which} {label(cfg)}: {type(exc).__name__}", flush=True)
                continue
            results[which].append(dict(config=cfg, label=label(cfg), us=t_us, err=err, ok=err <= tol))
    best_pair = None
    for bm in sorted({r["config"]["block_m"] for r in results["w13"]}):
        b13 = min((r for r in results["w13"] if r["ok"] and r["config"]["block_m"] == bm), key=lambda r: r["us"],
                  default=None)
        b2 = min((r for r in results["w2"] if r["ok"] and r["config"]["block_m"] == bm), key=lambda r: r["us"],
                 default=None)
        if b13 and b2 and (best_pair is None or b13["us"] + b2["us"] < best_pair[0]["us"] + best_pair[1]["us"]):
            best_pair = (b13, b2)
    row["tiles"] = results
    row["best"] = dict(w13=best_pair[0], w2=best_pair[1]) if best_pair else None

    # -- the layer by part (default configs)
    act = shape["act"]
    r_aligned = aligned(d13.block_m)
    gate_up = gemm_out("w13", shape, t)
    row["routing_us"] = us([lambda r=r: select_experts(r["logits"], k, True) for r in rs])
    row["routing_torch_us"] = us([lambda r=r: torch_routing(r["logits"], k) for r in rs])
    row["align_us"] = us([lambda r=r: moe_align_block_size(r["ids"], d13.block_m, e) for r in rs])
    # One launch up to 1024 pairs instead of 256 (moe_align.CHUNK): is one bigger program faster than two launches?
    row["align_1k_us"] = us([lambda r=r: moe_align_block_size(r["ids"], d13.block_m, e, chunk=1024) for r in rs])
    row["align_torch_us"] = us([lambda r=r: moe_align_block_size_torch(r["ids"], d13.block_m, e) for r in rs])
    row["act_us"] = us([lambda: expert_activation(gate_up, act)] * reps)
    down = torch.empty(pairs, shape["h"], dtype=torch.bfloat16, device=DEVICE)
    row["sum_us"] = us([lambda: moe_sum(down, k, torch.bfloat16)] * reps)
    del r_aligned

    def layer(r, c13=None, c2=None):
        weights, ids = select_experts(r["logits"], k, True)
        return fused_experts_triton(r["x"], w["w13"], w["w2"], weights, ids, act, w13_bias=w["b13"],
                                    w2_bias=w["b2"], w13_config=c13, w2_config=c2)

    row["layer_default_us"] = us([lambda r=r: layer(r) for r in rs])
    if best_pair:
        c13, c2 = full_config(best_pair[0]["config"]), full_config(best_pair[1]["config"])
        row["layer_best_us"] = us([lambda r=r: layer(r, c13, c2) for r in rs])
    if name == "gpt-oss-20b":
        row["mxfp4_layer_us"] = mxfp4_layer_us(shape, rs)
    return row


_MXFP4: dict = {}


def mxfp4_layer_us(shape: dict, rs: list) -> float | None:
    """routing + `fused_experts_mxfp4_triton` (the production gpt-oss path, default settings), random codes."""
    try:
        from tokenmill.kernels.triton.fused_moe_mxfp4 import fused_experts_mxfp4_triton
        from tokenmill.layers.fused_moe.reference import select_experts

        e, h, i = shape["e"], shape["h"], shape["i"]
        if not _MXFP4:
            g = torch.Generator(device=DEVICE).manual_seed(2)
            u8 = dict(generator=g, device=DEVICE, dtype=torch.uint8)
            _MXFP4.update(b13=torch.randint(0, 256, (e, 2 * i, h // 32, 16), **u8),
                          s13=torch.randint(117, 122, (e, 2 * i, h // 32), **u8),
                          b2=torch.randint(0, 256, (e, h, i // 32, 16), **u8),
                          s2=torch.randint(117, 122, (e, h, i // 32), **u8),
                          bias13=(torch.randn(e, 2 * i, generator=g, device=DEVICE) * 0.1).to(torch.bfloat16),
                          bias2=(torch.randn(e, h, generator=g, device=DEVICE) * 0.1).to(torch.bfloat16))
        m = _MXFP4

        def call(r):
            weights, ids = select_experts(r["logits"], shape["top_k"], True)
            return fused_experts_mxfp4_triton(r["x"], m["b13"], m["s13"], m["b2"], m["s2"], weights, ids,
                                              "swigluoai", m["bias13"], m["bias2"])

        return us([lambda r=r: call(r) for r in rs])
    except Exception as exc:  # noqa: BLE001 - the bf16 sweep stands without it
        print(f"  mxfp4 layer: {type(exc).__name__}: {exc}", flush=True)
        return None


# ---------------------------------------------------------------------------------------------------------
# Report


def print_model(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n{rows[0]['model']}: us per MoE layer (bf16, CUDA graph, median)")
    cols = ("routing_us", "routing_torch_us", "align_us", "align_1k_us", "align_torch_us", "w13_default_us", "act_us",
            "w2_default_us", "sum_us", "layer_default_us", "layer_best_us", "mxfp4_layer_us")
    heads = ("route", "route.pt", "sort", "sort.1k", "sort.pt", "w13", "act", "w2", "sum", "layer", "best", "mxfp4")
    print(f"{'T':>5} {'p/E':>6} " + " ".join(f"{h:>8}" for h in heads) + "  best w13 | best w2")
    for r in rows:
        vals = " ".join(f"{r[c]:8.1f}" if isinstance(r.get(c), float) else f"{'-':>8}" for c in cols)
        b = r["best"]
        tiles = (f"{b['w13']['label']} ({b['w13']['us']:.1f}) | {b['w2']['label']} ({b['w2']['us']:.1f})" if b
                 else "no valid config")
        print(f"{r['tokens']:>5} {r['pairs_per_expert']:6.2f} {vals}  {tiles}")


def _cfg_literal(c: dict) -> str:
    return f"_C({c['block_m']}, {c['block_n']}, {c['block_k']}, {c['group_m']}, {c['num_warps']}, {c['num_stages']})"


def print_table(rows: list[dict]) -> None:
    """`_TABLE` rows for fused_moe.py: each T's best, bound halfway (geometrically) to the next T's p/E."""
    rows = [r for r in rows if r["best"]]
    if not rows:
        return
    print(f"\n# _TABLE rows from {rows[0]['model']} (paste into tokenmill/kernels/triton/fused_moe.py)")
    for j, r in enumerate(rows):
        nxt = rows[j + 1]["pairs_per_expert"] if j + 1 < len(rows) else None
        bound = "math.inf" if nxt is None else f"{math.sqrt(r['pairs_per_expert'] * nxt):.4g}"
        c13, c2 = r["best"]["w13"]["config"], r["best"]["w2"]["config"]
        print(f"    ({bound}, {_cfg_literal(c13)}, {_cfg_literal(c2)}),  # T={r['tokens']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(model_shapes()))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1), help="compile processes")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_moe: no CUDA device visible")
        return 2
    t0 = time.time()
    names = args.models.split(",")
    tokens = [int(v) for v in args.tokens.split(",")]
    shapes = model_shapes()
    failed = warm_all(names, tokens, args.jobs)
    out: dict = {"device": torch.cuda.get_device_name(), "rows": []}
    try:
        for name in names:
            w = make_weights(shapes[name])
            rows = []
            for t in tokens:
                row = sweep_point(name, shapes[name], w, t, failed)
                rows.append(row)
                b = row["best"]
                print(f"{name} T={t}: layer {row['layer_default_us']:.1f} us default, "
                      f"{row.get('layer_best_us', float('nan')):.1f} us best "
                      f"[{b['w13']['label'] if b else '-'} | {b['w2']['label'] if b else '-'}] "
                      f"({time.time() - t0:.0f} s)", flush=True)
            out["rows"] += rows
            print_model(rows)
            print_table(rows)
            del w
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - keep what was measured
        traceback.print_exc()
    out["seconds"] = time.time() - t0
    print(f"\nsweep_moe done in {out['seconds']:.0f} s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
