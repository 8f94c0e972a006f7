"""Time the FP8 fused MoE (W8A8 fp8 dots, and weight-only with e4m3 decoded inside the grouped GEMM) at
Qwen3-30B-A3B's expert shapes on one CUDA GPU.

Run from the repo root on the GPU machine:

    python benchmarks/gpu/fp8_moe.py                  # both modes' default tiles vs dequantize-all + bf16 vs bf16
    python benchmarks/gpu/fp8_moe.py --sweep          # plus a few launch settings (Fp8MoeConfig) per token count, per mode
    python benchmarks/gpu/fp8_moe.py --cc70           # the cc-7.0 settings (float16), for comparison on the same GPU
    python benchmarks/gpu/fp8_moe.py --scheme channel # per-channel scales instead of 128-wide K blocks

Experts: E 128, H 2048, I 768, top-8 (Qwen3-30B-A3B), random e4m3 codes (no
NaN codes), scales as FusedMoE stores Qwen3-30B-A3B-FP8's 128 x 128 blocks
(one row of K-block scales per output row, block_size (1, 128)) or one per
channel; silu, random routing, bfloat16 activations. Columns (ms per MoE
layer call): "w8a8" `fused_experts_fp8_triton` (W8A8 on cc >= 8.9: both
activation quantizations included; weight-only below, and with --cc70);
"w8a8 gemms" its two grouped GEMM launches alone on pre-quantized rows; "w8a16"
and "gemms" the same for `quantize_activations=False` (weight-only);
"deq+bf16" the path it replaced (all experts dequantized by
`dequantize_fp8_triton`, then `fused_experts_triton`); "bf16"
`fused_experts_triton` on bfloat16 experts; "floor" the e4m3 bytes (and scales)
of the experts the step touches (at most min(E, T * k)) at 4.8 TB/s.
Timing: `quant_gemm.graph_time_ms` (REPS calls in one CUDA graph, median of 7
replays; the 128 experts' 0.6 GB of e4m3 bytes exceed the 50 MB L2).
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

TOKENS = (1, 16, 256, 2048)
E, H, I, TOP_K = 128, 2048, 768, 8
BLOCK_K = 128  # Qwen3-30B-A3B-FP8's weight_block_size [128, 128], stored per row by FusedMoE
REPS = 5
# (block_m, block_n, block_k, num_warps, num_stages) tried by --sweep
# W8A8 settings tried by --sweep (no decoded tile in registers: larger tiles fit; the fp8 dot's M is block_n)
SWEEP_W8A8 = ((16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4),
              (32, 64, 128, 4, 3), (32, 128, 128, 4, 3), (32, 128, 128, 8, 3), (64, 128, 128, 4, 3),
              (64, 128, 128, 8, 3), (64, 128, 128, 8, 4), (128, 128, 128, 8, 3))
SWEEP = ((16, 32, 128, 4, 3), (16, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 64, 4, 3),
         (32, 64, 64, 4, 3), (32, 64, 128, 8, 3), (32, 128, 64, 8, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
         (64, 128, 128, 8, 3), (128, 128, 64, 8, 3))


def _experts(n: int, k: int, scheme: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 experts [E, n, k] (float8_e4m3fn, no NaN codes) and their float32 scales, sized so that
    sum_k q * s * x stays near 1 for unit x (|q| up to 448)."""
    q = torch.randint(0, 256, (E, n, k), generator=g, device="cuda", dtype=torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0
    shape = (E, n, k // BLOCK_K) if scheme == "block" else (E, n)
    s = (torch.rand(shape, generator=g, device="cuda") + 0.5) / (100.0 * k**0.5)
    return q.view(torch.float8_e4m3fn), s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cc70", action="store_true", help="the cc-7.0 settings (float16, their tiles)")
    ap.add_argument("--scheme", choices=("block", "channel"), default="block")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_moe: no CUDA device visible")
        return 2
    from tokenmill.kernels.fp8 import Fp8Weight
    from tokenmill.kernels.triton import fused_moe_fp8 as f8
    from tokenmill.kernels.triton.fp8_gemm import dequantize_fp8_triton
    from tokenmill.kernels.triton.fused_moe import fused_experts_triton, moe_align_block_size
    from tokenmill.layers.fused_moe.reference import select_experts

    if args.cc70:
        f8.device_facts = lambda device: ((7, 0), 80)
    cap, _ = f8.device_facts(torch.device("cuda"))
    dtype = torch.float16 if args.cc70 else torch.bfloat16
    block = (1, BLOCK_K) if args.scheme == "block" else None
    g = torch.Generator(device="cuda").manual_seed(0)
    q13, s13 = _experts(2 * I, H, args.scheme, g)
    q2, s2 = _experts(H, I, args.scheme, g)

    def dequantize_all(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        e, n, k = q.shape
        flat = Fp8Weight(q.reshape(e * n, k), s.reshape(e * n, *s.shape[2:]), block)
        return dequantize_fp8_triton(flat, dtype).reshape(e, n, k)

    w13, w2 = dequantize_all(q13, s13), dequantize_all(q2, s2)
    per_expert = sum(t[0].numel() * t.element_size() for t in (q13, s13, q2, s2))
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x = torch.randn(t, H, generator=g, device="cuda").to(dtype)
        weights, ids = select_experts(torch.randn(t, E, generator=g, device="cuda"), TOP_K, True)

        def fp8(cfg=None, w8a8=True):
            return f8.fused_experts_fp8_triton(x, q13, s13, q2, s2, weights, ids, block_size=block, config=cfg,
                                               quantize_activations=w8a8)

        def dequant_bf16():
            return fused_experts_triton(x, dequantize_all(q13, s13), dequantize_all(q2, s2), weights, ids)

        # The two grouped GEMM launches alone (routing sort, activation quantization, activation and top-k sum
        # excluded), per mode.
        sc13 = f8.expert_scales(q13, s13, block, "w13")
        sc2 = f8.expert_scales(q2, s2, block, "w2")
        gate_up = torch.empty(t * TOP_K, 2 * I, dtype=dtype, device="cuda")
        down = torch.empty(t * TOP_K, H, dtype=torch.float32, device="cuda")
        inter = torch.randn(t * TOP_K, I, generator=g, device="cuda").to(dtype)
        pair_w = weights.reshape(-1).float().contiguous()
        w8a8 = f8.uses_w8a8(dtype, cap, True)

        def gemms_of(w8a8_mode):
            cfg = f8.launch_config(t * TOP_K, cap, None, w8a8_mode)
            aligned = moe_align_block_size(ids, cfg.block_m, E)
            a13, sa13 = f8.quantize_rows(x, sc13, None) if w8a8_mode else (x, None)
            a2, sa2 = f8.quantize_rows(inter, sc2, None) if w8a8_mode else (inter, None)

            def gemms():
                f8.grouped_fp8_gemm(a13, q13, sc13, None, gate_up, None, aligned, TOP_K, cfg, sa13)
                f8.grouped_fp8_gemm(a2, q2, sc2, None, down, pair_w, aligned, 1, cfg, sa2)
            return cfg, gemms

        def tiles(c):
            return f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}"

        cfg16, gemms16 = gemms_of(False)
        row = dict(tokens=t, dtype=str(dtype).split(".")[-1], scheme=args.scheme, w8a8_on=w8a8,
                   tiles=tiles(cfg16), floor_ms=min(E, t * TOP_K) * per_expert / HBM_BYTES_PER_S * 1e3,
                   w8a16_ms=graph_time_ms([lambda: fp8(w8a8=False)] * REPS), gemms_ms=graph_time_ms([gemms16] * REPS),
                   dequant_bf16_ms=graph_time_ms([dequant_bf16] * 2),
                   bf16_ms=graph_time_ms([lambda: fused_experts_triton(x, w13, w2, weights, ids)] * REPS))
        row["w8a8_ms"], row["w8a8_tiles"], row["w8a8_gemms_ms"] = row["w8a16_ms"], row["tiles"], row["gemms_ms"]
        if w8a8:
            cfg8, gemms8 = gemms_of(True)
            row.update(w8a8_ms=graph_time_ms([fp8] * REPS), w8a8_tiles=tiles(cfg8),
                       w8a8_gemms_ms=graph_time_ms([gemms8] * REPS))
        if args.sweep:
            for key, mode, table in (("sweep", False, SWEEP), ("sweep_w8a8", True, SWEEP_W8A8 if w8a8 else ())):
                row[key] = {}
                for bm, bn, bk, warps, stages in table:
                    c = f8.Fp8MoeConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                    name = f"{bm}x{bn}x{bk}w{warps}s{stages}"
                    try:
                        row[key][name] = graph_time_ms([lambda: fp8(c, mode)] * REPS)
                    except Exception as e:  # noqa: BLE001 (a launch setting that does not fit: record, go on)
                        row[key][name] = repr(e)[:80]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nQwen3-30B-A3B experts (E {E}, H {H}, I {I}, top-{TOP_K}), {args.scheme} scales, {dtype}: "
          f"ms per MoE layer (w8a8 = weight-only where the device has no FP8 arithmetic)")
    print(f"{'tokens':>6} {'w8a8 tiles':>14} {'w8a8':>8} {'gemms':>8} {'w8a16 tiles':>14} {'w8a16':>8} {'gemms':>8} "
          f"{'deq+bf16':>9} {'bf16':>8} {'floor':>8} {'bf16/w8a8':>9}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['w8a8_tiles']:>14} {r['w8a8_ms']:8.4f} {r['w8a8_gemms_ms']:8.4f} {r['tiles']:>14} "
              f"{r['w8a16_ms']:8.4f} {r['gemms_ms']:8.4f} {r['dequant_bf16_ms']:9.4f} {r['bf16_ms']:8.4f} "
              f"{r['floor_ms']:8.4f} {r['bf16_ms'] / r['w8a8_ms']:9.2f}")
        for key in ("sweep", "sweep_w8a8"):
            if r.get(key):
                ranked = sorted((v, k) for k, v in r[key].items() if isinstance(v, float))
                print(f"{'':>6} best of {key}: " + ", ".join(f"{k} {v:.4f}" for v, k in ranked[:4]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
