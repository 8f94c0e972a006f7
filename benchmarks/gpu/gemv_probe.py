"""Where the int4 GEMV's time goes at one row of x (decode, M = 1), per Llama-3.1-8B linear, on one CUDA GPU.

    python benchmarks/gpu/gemv_probe.py [--json-out probe.json] [--shapes qkv,o,gate_up,down]

For each shape (W4A16, group 128, zero points, bfloat16 x) and each GEMV tile in GRID (rows x packed words
per K step, warps, register prefetch of the next step) at three split-K counts (programs per SM 8 / 16 / 32),
three timings, each a CUDA graph of REPS calls over weight copies that together exceed the L2 (as
`quant_gemm.graph_time_ms`):

- `gemv`: `quant_linear` with that plan (the GEMV kernel + the split-K reduction launch);
- `load`: a kernel that only streams the same words with the same tile, grid and prefetch and XORs them
  (the memory side of that access pattern: what the GEMV would take if its arithmetic were free);
- `reduce`: the split-K reduction launch alone on partials of that shape.

`load` is a lower bound on the GEMV's memory side: it reads the same packed words, but not the GEMV's scalar
loads of x, the scales and the zero points (~33 small loads a step). Every config's output is compared with
the first config's; a relative error above MAX_REL_ERR prints WRONG and the script exits 1.

Printed per shape: bf16 F.linear, the default plan, the best `gemv` and the best `load` (us, and the
fraction of the 4-bit read floor's speed at the H200's 4.8 TB/s), then every config's row. If the best `gemv`
is far above its `load`, the arithmetic (instructions per value) is the limit; if they are close, the
access pattern (bytes in flight, launch and tail) is.

Prediction, written before the first run (session 14, from the sm_90a SASS of `quant_gemv_kernel` compiled
here on the CPU; Triton 3.6): the K loop issues 4.5-4.9 instructions per 4-bit value (32 x 16-word tile:
613 a step per thread: 164 FFMA, 131 LOP3, 101 SHF + ~80 IMAD used as shifts, 38 loads of which 32 are scalar
2-byte loads of x). Issue-bound ceiling on an H200 (132 SMs x 4 schedulers x 1.98 GHz x 32 lanes =
3.3e13 lane-instructions/s) at 4.7 a value: 7.1e12 values/s, 74% of the 4.8 TB/s floor's 9.6e12. Measured
(session 8): 22-35%. A serial model, each warp waiting ~1 us for a step's words and then issuing its ~613
instructions while ~3.4 other warps share its scheduler (gate_up, 32 x 16 words, split 2: 13.6 one-warp
programs an SM, 16 steps each), gives 16 x (~2,000 + ~2,100) cycles = ~33 us against the measured 36.6; with
the next step's words in flight during the arithmetic (PREFETCH: the compiled loop issues them before its
first FFMA) it gives ~17 us. So predicted: the load-only kernel far faster than the GEMV (~13-15 us on
gate_up), prefetch ~1.5-2x on the long-K-loop shapes (gate_up, down) and little on qkv / o (split 11-16: 2-3
steps a program, nothing to overlap), where the split-K reduction's launch (a few us) is a large share.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from quant_gemm import (  # noqa: E402
    HBM_BYTES_PER_S, L2_BYTES, LLAMA_8B_SHAPES, REPS, graph_time_ms, quant_bytes, random_w4,
)

# (block_n rows, words per K step, warps, prefetch)
GRID = [(32, 16, 1, False), (32, 16, 1, True), (64, 16, 1, False), (64, 8, 1, False), (64, 8, 1, True),
        (128, 8, 1, False), (128, 8, 1, True), (256, 4, 1, False), (256, 4, 1, True), (128, 4, 1, True),
        (64, 16, 2, False), (128, 16, 4, False), (32, 32, 1, False), (16, 16, 1, True)]
PROGRAMS_PER_SM = (8, 16, 32)
# Largest error of a config against GRID[0] at 16 programs per SM, relative to its largest output: the same
# float32 products summed in another order differ by ~1e-3 of a bf16 output at most; a wrong kernel by O(1).
MAX_REL_ERR = 1e-2


@triton.jit
def _load_only_kernel(qw_ptr, out_ptr, N, kw_total, words_per_split, stride_qn, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr, PREFETCH: tl.constexpr):
    """XOR of the words a GEMV program of the same tile, grid and prefetch would read; one int32 a program."""
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    w_start = tl.program_id(1) * words_per_split
    w_end = tl.minimum(w_start + words_per_split, kw_total)
    ptrs = qw_ptr + offs_n[:, None] * stride_qn + (w_start + tl.arange(0, BLOCK_KW))[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.int32)
    if PREFETCH:
        nxt = tl.load(ptrs, mask=n_mask[:, None] & (w_start < w_end), other=0)
    for w0 in range(w_start, w_end, BLOCK_KW):
        if PREFETCH:
            words = nxt
            ptrs += BLOCK_KW
            nxt = tl.load(ptrs, mask=n_mask[:, None] & (w0 + BLOCK_KW < w_end), other=0)
        else:
            words = tl.load(ptrs, mask=n_mask[:, None], other=0)
            ptrs += BLOCK_KW
        acc ^= words
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(tl.ravel(acc), 0))


def plan_for(cfg, spm: int, n: int, k: int, sms: int):
    from tokenmill.kernels.triton.quant_linear import QuantLinearPlan, finish_plan

    bn, kw, warps, pf = cfg
    return finish_plan(QuantLinearPlan("gemv", 1, bn, kw * 8, 0, False, warps, 1, False, pf), 1, n, k, sms,
                       programs_per_sm=spm)


def probe_shape(name: str, n: int, k: int, dtype: torch.dtype) -> dict:
    from tokenmill.kernels.triton.quant_linear import quant_linear
    from tokenmill.kernels.triton.splitk import device_facts, splitk_reduce_kernel

    _, sms = device_facts(torch.device("cuda"))
    qb = quant_bytes(n, k, 4, 128, True)
    copies = max(REPS, -(-2 * L2_BYTES // qb))
    ws = [random_w4(n, k, dtype) for _ in range(copies)]
    dense_copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
    dense = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(dense_copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    floor_us = qb / HBM_BYTES_PER_S * 1e6
    row = dict(shape=name, n=n, k=k, floor_us=floor_us,
               bf16_us=1e3 * graph_time_ms([lambda d=d: F.linear(x, d) for d in dense] * (REPS // len(dense) + 1)),
               default_us=1e3 * graph_time_ms([lambda w=w: quant_linear(x, w) for w in ws]))
    ref = quant_linear(x, ws[0], plan=plan_for(GRID[0], 16, n, k, sms)).float()
    configs = []
    for cfg in GRID:
        for spm in PROGRAMS_PER_SM:
            plan = plan_for(cfg, spm, n, k, sms)
            bn, kw, warps, pf = cfg
            y = quant_linear(x, ws[0], plan=plan).float()
            err = (y - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            per = triton.cdiv(triton.cdiv(k, kw * 8), plan.split_k) * kw
            sink = torch.empty(triton.cdiv(n, bn) * plan.split_k, dtype=torch.int32, device="cuda")
            grid = (triton.cdiv(n, bn), plan.split_k)
            load_calls = [lambda w=w: _load_only_kernel[grid](w.qweight, sink, n, k // 8, per, w.qweight.stride(0),
                                                              BLOCK_N=bn, BLOCK_KW=kw, PREFETCH=pf, num_warps=warps)
                          for w in ws]
            part = torch.randn(plan.split_k, 1, n, device="cuda")
            out = torch.empty(1, n, device="cuda", dtype=dtype)
            red_calls = [lambda: splitk_reduce_kernel[(triton.cdiv(n, 1024),)](
                part, out, out, n, n, SPLIT_K=plan.split_k, HAS_BIAS=False, CLAMP_FP16=False, ROUND=0, BLOCK=1024,
                num_warps=4)] * REPS
            configs.append(dict(block_n=bn, block_kw=kw, warps=warps, prefetch=pf, programs_per_sm=spm,
                                split_k=plan.split_k, rel_err=err,
                                gemv_us=1e3 * graph_time_ms([lambda w=w, p=plan: quant_linear(x, w, plan=p)
                                                             for w in ws]),
                                load_us=1e3 * graph_time_ms(load_calls),
                                reduce_us=1e3 * graph_time_ms(red_calls) if plan.split_k > 1 else 0.0))
            c = configs[-1]
            print(f"  {name:8s} {bn:4d}x{kw:<3d} w{warps} pf{int(pf)} spm{spm:<3d} split {plan.split_k:3d}: gemv "
                  f"{c['gemv_us']:7.1f} us  load {c['load_us']:7.1f}  reduce {c['reduce_us']:5.1f}  err {err:.1e}",
                  flush=True)
    row["configs"] = configs
    best = min(configs, key=lambda c: c["gemv_us"])
    best_load = min(configs, key=lambda c: c["load_us"])
    row.update(best_gemv=best, best_load=best_load)
    tile = "{block_n}x{block_kw} w{warps} pf{pf} spm{programs_per_sm}".format
    print(f"{name:8s} N {n} K {k}: floor {floor_us:.1f} us | bf16 {row['bf16_us']:.1f} | default "
          f"{row['default_us']:.1f} ({floor_us / row['default_us']:.0%} of floor speed) | best gemv "
          f"{best['gemv_us']:.1f} ({floor_us / best['gemv_us']:.0%}; {tile(**best, pf=int(best['prefetch']))}) | "
          f"best load-only {best_load['load_us']:.1f} ({floor_us / best_load['load_us']:.0%}; "
          f"{tile(**best_load, pf=int(best_load['prefetch']))})", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemv_probe: no CUDA device")
        return 2
    rows = []
    for s in args.shapes.split(","):
        rows.append(probe_shape(s, *LLAMA_8B_SHAPES[s], torch.bfloat16))
        if args.json_out:  # after every shape: a run cut by its time limit keeps what it measured
            Path(args.json_out).write_text(json.dumps(rows, indent=1))
    bad = [(r["shape"], c) for r in rows for c in r["configs"] if c["rel_err"] > MAX_REL_ERR]
    for shape, c in bad:
        print(f"WRONG: {shape} {c['block_n']}x{c['block_kw']} w{c['warps']} pf{int(c['prefetch'])} "
              f"spm{c['programs_per_sm']}: relative error {c['rel_err']:.1e} against the first config")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
