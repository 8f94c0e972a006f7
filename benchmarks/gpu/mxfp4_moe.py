"""Time the MXFP4 fused MoE (decode inside the grouped GEMM) at gpt-oss-20b's expert shapes on one CUDA GPU.

Run from the repo root on the GPU machine:

    python benchmarks/gpu/mxfp4_moe.py                 # default tiles vs decode-all + bf16 grouped GEMM vs bf16
    python benchmarks/gpu/mxfp4_moe.py --sweep         # plus a few launch settings per token count
    python benchmarks/gpu/mxfp4_moe.py --cc70          # the cc-7.0 settings (float16), for comparison on the same GPU

Experts: E 32, H = I = 2880, top-4 (gpt-oss-20b), random codes, scale bytes
117-121, biases, swigluoai, random routing. Columns (ms per MoE layer call):
"mxfp4" `fused_experts_mxfp4_triton`; "gemms" its two grouped GEMM launches
alone; "decode+bf16" the path it replaced
(`dequantize_mxfp4` of every expert, then `fused_experts_triton`); "bf16"
`fused_experts_triton` on bf16 experts; "floor" the packed bytes of the
experts the step touches (at most min(E, T * k)) at 4.8 TB/s. Timing:
`quant_gemm.graph_time_ms` (REPS calls in one CUDA graph, median of 7
replays; the 32 experts' 0.42 GB of packed bytes exceed the 50 MB L2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import torch  # noqa: E402
from quant_gemm import HBM_BYTES_PER_S, graph_time_ms  # noqa: E402

TOKENS = (1, 16, 256, 1024, 4096)
E, H, I, TOP_K = 32, 2880, 2880, 4
REPS = 5
# (block_m, block_n, block_k, num_warps, num_stages) tried by --sweep
SWEEP = ((16, 32, 64, 4, 3), (16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (64, 64, 64, 4, 3),
         (64, 64, 64, 8, 3), (64, 64, 128, 4, 3), (128, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 64, 128, 8, 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cc70", action="store_true", help="the cc-7.0 settings (float16, its tiles)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("mxfp4_moe: no CUDA device visible")
        return 2
    from tokenmill.kernels.triton import fused_moe_mxfp4 as mx
    from tokenmill.kernels.triton.fused_moe import fused_experts_triton, moe_align_block_size
    from tokenmill.kernels.triton.fused_moe_quant import GroupedQuantConfig
    from tokenmill.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton as dequantize_mxfp4
    from tokenmill.layers.fused_moe.reference import select_experts

    if args.cc70:
        mx.device_facts = lambda device: ((7, 0), 80)
    dtype = torch.float16 if args.cc70 else torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    b13 = torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, device="cuda", dtype=torch.uint8)
    b2 = torch.randint(0, 256, (E, H, I // 32, 16), generator=g, device="cuda", dtype=torch.uint8)
    s13 = torch.randint(117, 122, (E, 2 * I, H // 32), generator=g, device="cuda", dtype=torch.uint8)
    s2 = torch.randint(117, 122, (E, H, I // 32), generator=g, device="cuda", dtype=torch.uint8)
    bias13 = torch.randn(E, 2 * I, generator=g, device="cuda").to(dtype) * 0.1
    bias2 = torch.randn(E, H, generator=g, device="cuda").to(dtype) * 0.1
    w13, w2 = dequantize_mxfp4(b13, s13, dtype), dequantize_mxfp4(b2, s2, dtype)
    per_expert = b13[0].numel() + s13[0].numel() + b2[0].numel() + s2[0].numel()
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, H, generator=g, device="cuda").to(dtype)
        weights, ids = select_experts(torch.randn(t, E, generator=g, device="cuda"), TOP_K, True)

        def mxfp4(cfg=None):
            return mx.fused_experts_mxfp4_triton(x, b13, s13, b2, s2, weights, ids, "swigluoai", bias13, bias2,
                                                 config=cfg)

        def decode_all():
            return fused_experts_triton(x, dequantize_mxfp4(b13, s13, dtype), dequantize_mxfp4(b2, s2, dtype),
                                        weights, ids, "swigluoai", w13_bias=bias13, w2_bias=bias2)

        # The two grouped GEMM launches alone (routing sort, activation and top-k sum excluded).
        cc70 = args.cc70
        block_m = 16 if t * TOP_K <= 512 else 32 if cc70 else 64 if t * TOP_K <= 2048 else 128
        aligned = moe_align_block_size(ids, block_m, E)
        gate_up = torch.empty(t * TOP_K, 2 * I, dtype=dtype, device="cuda")
        down = torch.empty(t * TOP_K, H, dtype=torch.float32, device="cuda")
        inter = torch.randn(t * TOP_K, I, generator=g, device="cuda").to(dtype)
        pair_w = weights.reshape(-1).float().contiguous()

        def gemms():
            mx._grouped_mxfp4_gemm(x, b13, s13, bias13, gate_up, None, aligned, TOP_K, block_m, cc70,
                                   GroupedQuantConfig())
            mx._grouped_mxfp4_gemm(inter, b2, s2, bias2, down, pair_w, aligned, 1, block_m, cc70,
                                   GroupedQuantConfig())

        row = dict(tokens=t, dtype=str(dtype).split(".")[-1],
                   floor_ms=min(E, t * TOP_K) * per_expert / HBM_BYTES_PER_S * 1e3,
                   mxfp4_ms=graph_time_ms([mxfp4] * REPS), gemms_ms=graph_time_ms([gemms] * REPS))
        if not args.cc70:
            row["decode_bf16_ms"] = graph_time_ms([decode_all] * 2)
            row["bf16_ms"] = graph_time_ms([lambda: fused_experts_triton(x, w13, w2, weights, ids, "swigluoai",
                                                                         w13_bias=bias13, w2_bias=bias2)] * REPS)
        if args.sweep:
            row["sweep"] = {}
            for prefetch in (True, False):
                mx._PREFETCH_MAX_PAIRS = 1 << 30 if prefetch else 0
                for bm, bn, bk, warps, stages in SWEEP:
                    cfg = GroupedQuantConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                    name = f"{'pf' if prefetch else 'nopf'} {bm}x{bn}x{bk}w{warps}s{stages}"
                    try:
                        row["sweep"][name] = graph_time_ms([lambda: mxfp4(cfg)] * REPS)
                    except Exception as e:  # noqa: BLE001 (a launch setting that does not fit: record, go on)
                        row["sweep"][name] = repr(e)[:80]
            mx._PREFETCH_MAX_PAIRS = 16
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\ngpt-oss-20b experts (E {E}, H {H}, I {I}, top-{TOP_K}), {dtype}: ms per MoE layer")
    print(f"{'tokens':>6} {'mxfp4':>8} {'gemms':>8} {'decode+bf16':>12} {'bf16':>8} {'floor':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['mxfp4_ms']:8.4f} {r['gemms_ms']:8.4f} "
              f"{r.get('decode_bf16_ms', float('nan')):12.4f} "
              f"{r.get('bf16_ms', float('nan')):8.4f} {r['floor_ms']:8.4f}")
        if "sweep" in r:
            ranked = sorted((v, k) for k, v in r["sweep"].items() if isinstance(v, float))
            print(f"{'':>6} best of sweep: " + ", ".join(f"{k} {v:.4f}" for v, k in ranked[:4]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
