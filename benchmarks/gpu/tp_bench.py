"""Tensor-parallel check and benchmark on a two-GPU host: TP=2 vs TP=1 on the Llama-3.1-8B shapes.

Run from the repo root (no network, no tokenizer, dummy weights):

    python benchmarks/gpu/tp_bench.py                      # parity + TPOT + throughput, TP=1 and TP=2
    python benchmarks/gpu/tp_bench.py --num-prompts 50     # a shorter throughput workload
    python benchmarks/gpu/tp_bench.py --json-out tp.json

Each (phase, tensor-parallel size) runs in its own subprocess, so every
engine starts on clean GPUs:

1. parity (float32, so rounding cannot hide a sharding bug): 8 token-id
   prompts, 32 greedy tokens with top-2 logprobs. TP=2 must give TP=1's
   tokens up to the first position where TP=1's top-2 logprobs are within
   --tie-tol (summation order differs across ranks); that prompt's
   comparison stops there. In bf16 the logits are rounded to a few
   hundredths, so bf16 runs differ at gaps of 2-4 bf16 steps (seen on H200).
2. perf (--dtype, default bfloat16), one engine:
   TPOT: one request (--tpot-input prompt tokens, --tpot-output tokens),
   stepped alone after a warm-up request (Triton compiles outside the
   timing): TTFT = first step, TPOT = mean of the rest.
   Throughput: --num-prompts requests with input and output lengths uniform
   in [--min-len, --max-len] (seeded, the same for every size), all submitted
   at once; output tokens/s and total (prompt + output) tokens/s.

Dummy weights are identical at every TP size (drawn per full tensor, then
sharded), so the two runs compute the same model. A table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "benchmarks" / "configs" / "llama-3.1-8b.json"


def _workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_prompts):
        n_in, n_out = rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len)
        reqs.append(([rng.randrange(100, vocab - 100) for _ in range(n_in)], n_out))
    return reqs


def _engine(args: argparse.Namespace, dtype: str):
    from tokenmill import LLM

    model_dir = Path(tempfile.mkdtemp(prefix="tp_bench_"))
    shutil.copy(args.config, model_dir / "config.json")
    llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True, tensor_parallel_size=args.tp,
              dtype=dtype, max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=0)
    shutil.rmtree(model_dir, ignore_errors=True)
    return llm


def run_parity(args: argparse.Namespace, vocab: int) -> dict:
    from tokenmill import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(args, args.parity_dtype)
    startup = time.perf_counter() - t0
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(rng.randint(8, 64))]}
               for _ in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.shutdown()
    return {"startup_s": startup, "parity": [
        {"ids": list(o.outputs[0].token_ids),
         "top2": [sorted((lp.logprob for lp in pos.values()), reverse=True)[:2] for pos in o.outputs[0].logprobs]}
        for o in outs
    ]}


def run_perf(args: argparse.Namespace, vocab: int) -> dict:
    from tokenmill import SamplingParams

    t0 = time.perf_counter()
    llm = _engine(args, args.dtype)
    result: dict = {"startup_s": time.perf_counter() - t0}
    rng = random.Random(2)
    engine = llm.llm_engine

    def stepped(request_id: str) -> list[float]:
        prompt = {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.tpot_input)]}
        engine.add_request(request_id, prompt,
                           SamplingParams(max_tokens=args.tpot_output, temperature=0.0, ignore_eos=True))
        times = [time.perf_counter()]
        while engine.has_unfinished_requests():
            engine.step()
            times.append(time.perf_counter())
        return times

    stepped("warmup")
    times = stepped("tpot")
    result["ttft_ms"] = (times[1] - times[0]) * 1e3
    result["tpot_ms"] = (times[-1] - times[1]) / max(1, len(times) - 2) * 1e3

    reqs = _workload(args, vocab)
    batch = [{"prompt_token_ids": ids} for ids, _ in reqs]
    sps = [SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True) for _, n_out in reqs]
    start = time.perf_counter()
    outs = llm.generate(batch, sps, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(ids) for ids, _ in reqs)
    result.update(throughput_s=elapsed, output_tok_s=n_out / elapsed, total_tok_s=(n_in + n_out) / elapsed,
                  num_prompts=len(reqs), input_tokens=n_in, output_tokens=n_out)
    engine.shutdown()
    return result


def run_one(args: argparse.Namespace) -> dict:
    """One (phase, tensor-parallel size) in this process; returns the measurements."""
    vocab = json.loads(Path(args.config).read_text())["vocab_size"]
    return run_parity(args, vocab) if args.phase == "parity" else run_perf(args, vocab)


def compare_parity(ref: list[dict], got: list[dict], tol: float) -> tuple[int, int, int, list[str]]:
    """(prompts fully equal, prompts stopped at a near-tie, mismatches, notes)."""
    equal = tie = bad = 0
    notes = []
    for p, (r, g) in enumerate(zip(ref, got)):
        for i, (a, b) in enumerate(zip(r["ids"], g["ids"])):
            if a == b:
                continue
            gap = r["top2"][i][0] - r["top2"][i][1]
            if gap < tol:
                tie += 1
                notes.append(f"prompt {p}: near-tie at token {i} (top-2 gap {gap:.2e})")
            else:
                bad += 1
                notes.append(f"prompt {p}: MISMATCH at token {i} ({a} vs {b}, top-2 gap {gap:.3f})")
            break
        else:
            equal += 1
    return equal, tie, bad, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp-sizes", default="1,2")
    ap.add_argument("--config", default=str(CONFIG), help="HF config.json of the model (dummy weights)")
    ap.add_argument("--min-len", type=int, default=100, help="shortest input/output length of the workload")
    ap.add_argument("--max-len", type=int, default=1024, help="longest input/output length of the workload")
    ap.add_argument("--kv-cache-memory-bytes", default=None, help="explicit KV size (CPU smoke runs)")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--tpot-input", type=int, default=512)
    ap.add_argument("--tpot-output", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--phases", default="parity,perf")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the perf phase")
    ap.add_argument("--parity-dtype", default="float32", help="dtype of the parity phase")
    ap.add_argument("--tie-tol", type=float, default=1e-3, help="near-tie threshold on TP=1's top-2 logprob gap")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--tp", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one size
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.tp is not None:
        Path(args.result_file).write_text(json.dumps(run_one(args)))
        return 0

    results: dict[str, dict[int, dict]] = {"parity": {}, "perf": {}}
    for phase in args.phases.split(","):
        for tp in [int(t) for t in args.tp_sizes.split(",")]:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = [sys.executable, __file__, "--tp", str(tp), "--phase", phase, "--result-file", out] + sys.argv[1:]
            print(f"== {phase} TP={tp}", flush=True)
            t0 = time.perf_counter()
            # Workers print their time inside execute_model vs waiting for the engine at shutdown.
            rc = subprocess.run(cmd, env={**os.environ, "TOKENMILL_WORKER_STATS": "1"}).returncode
            if rc != 0:
                print(f"{phase} TP={tp} failed with exit code {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
                continue
            results[phase][tp] = json.loads(Path(out).read_text())
            os.unlink(out)

    perf = results["perf"]
    if perf:
        print(f"\n{args.dtype}; TPOT: {args.tpot_input} prompt + {args.tpot_output} output tokens alone; throughput: "
              f"{args.num_prompts} prompts, in/out uniform in [{args.min_len}, {args.max_len}]")
        print("| TP | start-up s | TTFT ms | TPOT ms | throughput s | output tok/s | total tok/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for tp, r in perf.items():
            print(f"| {tp} | {r['startup_s']:.1f} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | "
                  f"{r['throughput_s']:.1f} | {r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} |")
    ok = bool(perf) or "perf" not in args.phases
    parity = results["parity"]
    if "parity" in args.phases:
        ok &= 1 in parity and len(parity) == len(args.tp_sizes.split(","))
    if 1 in parity:
        for tp, r in parity.items():
            if tp == 1:
                continue
            equal, tie, bad, notes = compare_parity(parity[1]["parity"], r["parity"], args.tie_tol)
            ok &= bad == 0
            print(f"\nParity TP={tp} vs TP=1 ({args.parity_dtype}, 8 prompts x 32 greedy tokens): {equal} identical, "
                  f"{tie} stopped at a near-tie (< {args.tie_tol}), {bad} mismatches -> "
                  f"{'PASS' if bad == 0 else 'FAIL'}")
            for n in notes:
                print("  " + n)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
