"""TPOT of running decodes while a burst of long prompts arrives, chunked prefill on vs off.

Workload (offline, engine-driven, prefix caching off so every prompt is computed):

1. `--num-running` requests with short prompts start decoding (greedy,
   ignore_eos) and run for a few steps;
2. then `--burst` prompts of `--long-len` tokens arrive at once (each asks
   for one token, so it finishes when its prefill is done);
3. the run ends when the last burst prompt has its token.

Measured: the gaps between consecutive tokens of the running requests
(their TPOT/ITL) whose later token came after the burst arrived: p50, p99
and max; plus how long the burst took to prefill.

Chunked prefill on: `--chunk-budget` tokens per step (decodes first, the
rest of the budget to prompt chunks), so a step never computes more than the
budget and running requests get a token every step (scheduler policy in
tokenmill/core/scheduler.py). Off: the budget must hold a whole prompt
(`max_model_len`); a step with a long prompt computes all of it, and the
decodes in that step wait for it.

CPU (bundled SmolLM2-135M, float32), from the repo root:

    PYTHONPATH=. python benchmarks/chunked_prefill_tpot.py --threads 1

H200 (Llama-3.1-8B shapes, dummy weights):

    PYTHONPATH=. python benchmarks/chunked_prefill_tpot.py --config benchmarks/configs/llama-3.1-8b.json \\
        --load-format dummy --skip-tokenizer-init --num-running 32 --burst 8 --long-len 7000 \\
        --max-model-len 8192 --chunk-budget 512 --json-out chunked_tpot_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from prefix_cache_bench import add_engine_args, build_llm, free_llm, vocab_size


@dataclass(slots=True)
class TpotResult:
    chunked_prefill: bool
    max_num_batched_tokens: int
    num_itls: int  # gaps measured
    tpot_p50_ms: float
    tpot_p99_ms: float
    tpot_max_ms: float
    tpot_p50_before_burst_ms: float  # baseline: the same requests before the burst
    burst_prefill_s: float  # burst arrival -> last burst prompt's token
    num_chunked_prefill_steps: int


def run(args: argparse.Namespace, chunked: bool) -> TpotResult:
    from tokenmill import SamplingParams

    budget = args.chunk_budget if chunked else args.max_model_len
    llm = build_llm(args, enable_chunked_prefill=chunked, max_num_batched_tokens=budget,
                    enable_prefix_caching=False)
    engine = llm.llm_engine
    rng = np.random.default_rng(args.seed)
    vocab = vocab_size(llm)
    low = min(1000, vocab // 2)
    running_ids = [f"run{i}" for i in range(args.num_running)]
    burst_ids = [f"burst{i}" for i in range(args.burst)]
    decode = SamplingParams(temperature=0.0, max_tokens=args.max_model_len - args.short_len, ignore_eos=True,
                            detokenize=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    # Warm-up: one prompt of each kind through the model.
    engine.add_request("warm-long", {"prompt_token_ids": rng.integers(low, vocab, args.long_len).tolist()}, one)
    while engine.has_unfinished_requests():
        engine.step()

    for rid in running_ids:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(low, vocab, args.short_len).tolist()}, decode)
    token_times: dict[str, list[float]] = {rid: [] for rid in running_ids}
    num_tokens: dict[str, int] = dict.fromkeys(running_ids, 0)

    def step() -> list:
        outs = engine.step()
        t = time.perf_counter()
        for out in outs:
            if out.request_id in token_times:
                n = len(out.outputs[0].token_ids)
                token_times[out.request_id] += [t] * (n - num_tokens[out.request_id])
                num_tokens[out.request_id] = n
        return outs

    for _ in range(args.warm_steps):
        step()
    stats_before = engine.get_stats()
    burst_at = time.perf_counter()
    for rid in burst_ids:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(low, vocab, args.long_len).tolist()}, one)
    pending = set(burst_ids)
    while pending:
        for out in step():
            if out.request_id in pending and out.finished:
                pending.discard(out.request_id)
    burst_done = time.perf_counter()
    stats_after = engine.get_stats()
    engine.abort_request(running_ids)
    free_llm(llm)

    during, before = [], []
    for times in token_times.values():
        for a, b in itertools.pairwise(times):
            (during if b > burst_at else before).append(b - a)
    during_ms = np.array(during) * 1e3
    return TpotResult(
        chunked_prefill=chunked, max_num_batched_tokens=budget, num_itls=len(during),
        tpot_p50_ms=float(np.percentile(during_ms, 50)), tpot_p99_ms=float(np.percentile(during_ms, 99)),
        tpot_max_ms=float(during_ms.max()), tpot_p50_before_burst_ms=float(np.percentile(before, 50) * 1e3),
        burst_prefill_s=burst_done - burst_at,
        num_chunked_prefill_steps=stats_after.num_chunked_prefill_steps - stats_before.num_chunked_prefill_steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--num-running", type=int, default=4)
    ap.add_argument("--short-len", type=int, default=32, help="prompt tokens of the running requests")
    ap.add_argument("--burst", type=int, default=2)
    ap.add_argument("--long-len", type=int, default=1024, help="prompt tokens of each burst prompt")
    ap.add_argument("--chunk-budget", type=int, default=256, help="max_num_batched_tokens with chunked prefill")
    ap.add_argument("--warm-steps", type=int, default=4, help="decode steps before the burst")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.config and args.load_format == "auto":
        args.load_format = "dummy"
    if args.long_len > args.max_model_len - 1:
        raise ValueError(f"--long-len ({args.long_len}) must be below --max-model-len ({args.max_model_len}).")
    load = os.getloadavg()
    print(f"load average before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    results = []
    for chunked in (True, False):
        res = run(args, chunked)
        print(json.dumps(asdict(res)), flush=True)
        results.append(res)
    print("\n| chunked prefill | max_num_batched_tokens | TPOT p50 (ms) | TPOT p99 (ms) | TPOT max (ms) | "
          "p50 before burst (ms) | burst prefill (s) | chunked steps |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'on' if r.chunked_prefill else 'off'} | {r.max_num_batched_tokens} | {r.tpot_p50_ms:.0f} | "
              f"{r.tpot_p99_ms:.0f} | {r.tpot_max_ms:.0f} | {r.tpot_p50_before_burst_ms:.0f} | "
              f"{r.burst_prefill_s:.1f} | {r.num_chunked_prefill_steps} |")
    load = os.getloadavg()
    print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results]},
                                                  indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
