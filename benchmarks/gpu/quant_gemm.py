"""Time tokenmill's int4/int8 weight-only kernels against bf16 on one CUDA GPU (needs only torch + triton).

Run from the repo root on the GPU machine:

    python benchmarks/gpu/quant_gemm.py                  # dense (native + cc-7.0 path) and MoE tables
    python benchmarks/gpu/quant_gemm.py --skip-moe --skip-cc70
    python benchmarks/gpu/quant_gemm.py --json-out results.json

1. Dense: `kernels.triton.quant_linear.quant_linear` (4-bit, group 128, with
   zero points) vs `F.linear` with the same weight in bf16, for
   Llama-3.1-8B's linear shapes (N x K: qkv 6144x4096, o 4096x4096,
   gate_up 28672x4096, down 4096x14336) at M in {1, 4, 16, 64, 256, 1024,
   4096}. "floor" is the 4-bit weight-read time (packed weights + scales +
   zeros) at the H200's 4.8 TB/s datasheet bandwidth; "GB/s" the weight
   bytes over the measured time.
2. The cc-7.0 path: the same table in a subprocess with
   TOKENMILL_FORCE_CC70=1 (split-K without tl.dot for M <= 8, dequantize +
   cuBLAS above), float16, against float16 F.linear.
3. MoE: `fused_experts_quant_triton` (4-bit g128 + zeros) vs
   `fused_experts_triton` (bf16) at T in {1, 16, 256, 2048} tokens,
   Qwen3-30B-A3B experts (E 128, H 2048, I 768, top-8, random routing).

Timing: each case is captured in a CUDA graph of `REPS` back-to-back calls
(launch overhead excluded as in a graphed decode step), each call on a
different copy of the weights so that the copies together exceed the 50 MB
L2 and every call reads its weights from HBM; the graph is replayed 7 times
after a warm-up and the median time per call is printed (ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
LLAMA_8B_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 4, 16, 64, 256, 1024, 4096)
MOE_TOKENS = (1, 16, 256, 2048)
L2_BYTES = 50 * 2**20
REPS = 20


def graph_time_ms(calls: list, replays: int = 7) -> float:
    """Median ms per call of `calls` (zero-argument functions) captured back to back in one CUDA graph."""
    for fn in calls[:2]:
        fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)


def quant_bytes(n: int, k: int, bits: int, group: int, zeros: bool) -> int:
    ngroups = -(-k // group)
    return n * -(-k // (32 // bits)) * 4 + n * ngroups * 2 + (n * ngroups if zeros else 0)


def random_w4(n: int, k: int, dtype: torch.dtype, experts: int | None = None, device: str = "cuda"):
    """Random 4-bit group-128 weight with zero points, made on `device` (random words: every nibble uniform)."""
    from tokenmill.kernels.quant_pack import QuantTensors

    lead = () if experts is None else (experts,)
    ng = -(-k // 128)
    qweight = torch.randint(-2**31, 2**31 - 1, (*lead, n, -(-k // 8)), dtype=torch.int32, device=device)
    scales = (torch.rand(*lead, n, ng, device=device) * 0.01 + 0.001).to(dtype)
    qzeros = torch.randint(0, 16, (*lead, n, ng), dtype=torch.uint8, device=device)
    return QuantTensors(qweight, scales, qzeros, None, 4, 128, k)


def dense_rows(dtype: torch.dtype, ms=MS) -> list[dict]:
    from tokenmill.kernels.triton.quant_linear import plan_quant_linear, quant_linear
    from tokenmill.kernels.triton.splitk import device_facts

    cap, sms = device_facts(torch.device("cuda"))
    rows = []
    for name, (n, k) in LLAMA_8B_SHAPES.items():
        wbytes = quant_bytes(n, k, 4, 128, True)
        # Enough copies that one graph's calls read 2x the L2 size: every call streams from HBM.
        q_copies = max(2, min(REPS, -(-2 * L2_BYTES // wbytes)))
        d_copies = max(2, min(REPS, -(-2 * L2_BYTES // (n * k * 2))))
        qws = [random_w4(n, k, dtype) for _ in range(q_copies)]
        dws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(d_copies)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            qcalls = [lambda w=qws[i % q_copies]: quant_linear(x, w) for i in range(REPS)]
            dcalls = [lambda w=dws[i % d_copies]: F.linear(x, w) for i in range(REPS)]
            t_q = graph_time_ms(qcalls)
            t_d = graph_time_ms(dcalls)
            plan = plan_quant_linear(m, n, qws[0], cap, sms)
            rows.append(dict(shape=name, n=n, k=k, m=m, dtype=str(dtype).split(".")[-1], cc=f"{cap[0]}.{cap[1]}",
                             path=plan.path, tiles=f"{plan.block_m}x{plan.block_n}x{plan.block_k}/s{plan.split_k}",
                             quant_ms=t_q, dense_ms=t_d, floor_ms=wbytes / HBM_BYTES_PER_S * 1e3,
                             quant_gbps=wbytes / (t_q * 1e-3) / 1e9))
            print(json.dumps(rows[-1]), flush=True)
        del qws, dws
        torch.cuda.empty_cache()
    return rows


def moe_rows(dtype: torch.dtype) -> list[dict]:
    from tokenmill.kernels.triton.fused_moe import fused_experts_triton
    from tokenmill.kernels.triton.fused_moe_quant import fused_experts_quant_triton
    from tokenmill.layers.fused_moe.reference import select_experts

    e, h, i, top_k = 128, 2048, 768, 8
    w13q = random_w4(2 * i, h, dtype, experts=e)
    w2q = random_w4(h, i, dtype, experts=e)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=dtype) / h**0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=dtype) / i**0.5
    rows = []
    for t in MOE_TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=dtype)
        weights, ids = select_experts(torch.randn(t, e, device="cuda"), top_k, True)
        reps = 5
        t_q = graph_time_ms([lambda: fused_experts_quant_triton(x, w13q, w2q, weights, ids)] * reps)
        t_d = graph_time_ms([lambda: fused_experts_triton(x, w13, w2, weights, ids)] * reps)
        active = min(e, t * top_k)  # upper bound of experts touched
        qbytes = active * (quant_bytes(2 * i, h, 4, 128, True) + quant_bytes(h, i, 4, 128, True))
        rows.append(dict(tokens=t, dtype=str(dtype).split(".")[-1], quant_ms=t_q, dense_ms=t_d,
                         floor_ms_at_most=qbytes / HBM_BYTES_PER_S * 1e3))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def print_dense(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'shape':8} {'N x K':>12} {'M':>5} {'path':>7} {'tiles':>16} {'quant ms':>9} {'dense ms':>9} "
          f"{'speedup':>8} {'floor ms':>9} {'GB/s':>7}")
    for r in rows:
        print(f"{r['shape']:8} {r['n']:>6}x{r['k']:<5} {r['m']:>5} {r['path']:>7} {r['tiles']:>16} "
              f"{r['quant_ms']:9.4f} {r['dense_ms']:9.4f} {r['dense_ms'] / r['quant_ms']:7.2f}x "
              f"{r['floor_ms']:9.4f} {r['quant_gbps']:7.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-cc70", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--child-cc70", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm: no CUDA device visible")
        return 2
    if args.child_cc70:  # TOKENMILL_FORCE_CC70=1 is set by the parent
        rows = dense_rows(torch.float16)
        print("CHILD_RESULT " + json.dumps(rows))
        return 0
    out: dict = {"device": torch.cuda.get_device_name()}
    out["dense"] = dense_rows(torch.bfloat16)
    print_dense(out["dense"], "Dense, bf16, native capability: quant_linear (W4A16 g128 + zeros) vs F.linear (bf16)")
    if not args.skip_cc70:
        env = dict(os.environ, TOKENMILL_FORCE_CC70="1", PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, __file__, "--child-cc70"], env=env, capture_output=True, text=True,
                              check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD_RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"cc-7.0 run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        else:
            out["dense_cc70"] = json.loads(lines[-1][len("CHILD_RESULT "):])
            print_dense(out["dense_cc70"], "Dense, fp16, TOKENMILL_FORCE_CC70=1: quant_linear vs F.linear (fp16)")
    if not args.skip_moe:
        out["moe"] = moe_rows(torch.bfloat16)
        print("\nMoE, Qwen3-30B-A3B experts (E 128, H 2048, I 768, top-8), bf16: fused_experts_quant (W4A16 g128) "
              "vs fused_experts (bf16)")
        print(f"{'tokens':>6} {'quant ms':>9} {'bf16 ms':>9} {'speedup':>8} {'4-bit floor ms (<=)':>20}")
        for r in out["moe"]:
            print(f"{r['tokens']:>6} {r['quant_ms']:9.4f} {r['dense_ms']:9.4f} {r['dense_ms'] / r['quant_ms']:7.2f}x "
                  f"{r['floor_ms_at_most']:20.4f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
