"""`tokenmill bench latency`: wall time of one batch through `tokenmill.LLM`, repeated.

As vLLM's `vllm bench latency`: one batch of `--batch-size` random token-id
prompts of `--input-len` tokens, each generating exactly `--output-len`
tokens (`ignore_eos`), run `--num-iters-warmup` times untimed and then
`--num-iters` times timed; prints the mean and the 10/25/50/75/90/99th
percentiles of the batch latency in seconds.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.benchmarks.throughput import add_engine_cli_args, make_llm, sampling_params, token_id_sampler

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `bench latency` flags (vLLM's spellings and defaults) to `parser`."""
    g = parser.add_argument_group("benchmark")
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="Untimed iterations first.")
    g.add_argument("--num-iters", type=int, default=30, help="Timed iterations.")
    g.add_argument("--disable-detokenize", action="store_true")
    g.add_argument("--output-json", default=None, help="Write the latencies to this JSON file.")
    add_engine_cli_args(parser)
    return parser


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; print and return `{"avg_latency", "latencies", "percentiles"}` (seconds).

    Raises:
        ValueError: a size or count flag is out of range.
    """
    if min(args.input_len, args.output_len, args.batch_size, args.n, args.num_iters) < 1:
        raise ValueError("--input-len, --output-len, --batch-size, --n and --num-iters must all be >= 1.")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}.")
    llm = make_llm(args)
    sample = token_id_sampler(llm, np.random.default_rng(args.seed))
    prompts = [{"prompt_token_ids": sample(args.input_len)} for _ in range(args.batch_size)]
    params = sampling_params(args.n, args.output_len, not args.disable_detokenize)

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        run_once()
    latencies = [run_once() for _ in range(args.num_iters)]
    values = np.percentile(latencies, PERCENTAGES)
    result = {
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): float(v) for p, v in zip(PERCENTAGES, values)},
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, v in zip(PERCENTAGES, values):
        print(f"{p}% percentile latency: {v:.4f} seconds")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=4), encoding="utf-8")
    return result
