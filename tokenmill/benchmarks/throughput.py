"""`tokenmill bench throughput`: offline generation throughput through `tokenmill.LLM`.

As vLLM's `vllm bench throughput` with its random dataset: `--num-prompts`
prompts of random token ids (lengths as `bench serve --dataset-name random`),
all submitted at once with `ignore_eos` so each produces exactly its output
length; reports requests/s, total tokens/s and output tokens/s over the wall
time of `LLM.generate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.benchmarks.datasets import length_bounds
from tokenmill.config import EngineArgs


def add_engine_cli_args(parser: argparse.ArgumentParser) -> None:
    """`--model` plus every engine flag of `EngineArgs` (shared with `bench latency`)."""
    parser.add_argument("--model", default=None,
                        help="Model folder, .gguf file or hub id (default: the bundled model).")
    EngineArgs.add_cli_args(parser)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `bench throughput` flags (vLLM's spellings) to `parser`."""
    g = parser.add_argument_group("benchmark")
    g.add_argument("--dataset-name", default="random", choices=["random"])
    g.add_argument("--input-len", type=int, default=1024, help="Prompt tokens per request.")
    g.add_argument("--output-len", type=int, default=128, help="Output tokens per request.")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--disable-detokenize", action="store_true", help="Skip detokenization (token ids only).")
    g.add_argument("--output-json", default=None, help="Write the numbers to this JSON file.")
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_engine_cli_args(parser)
    return parser


def make_llm(args: argparse.Namespace) -> Any:
    """Build `tokenmill.LLM` from the engine flags (imported here: the engine is heavy)."""
    from tokenmill import LLM

    return LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))


def token_id_sampler(llm: Any, rng: np.random.Generator):
    """A function `n -> list[int]` of random non-special token ids of `llm`'s vocabulary.

    Uses `llm.get_tokenizer()` when there is one; otherwise ids below 10000,
    as vLLM's latency benchmark does.
    """
    tok = llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else None
    if tok is None:
        return lambda n: rng.integers(0, 10000, size=n).tolist()
    ids = np.arange(len(tok))
    special = list(getattr(tok, "all_special_ids", []) or [])
    allowed = ids[~np.isin(ids, special)]
    return lambda n: rng.choice(allowed, size=n).tolist()


def sampling_params(n: int, output_len: int, detokenize: bool) -> Any:
    """vLLM's benchmark sampling: temperature 1, top_p 1, ignore_eos, exactly `output_len` tokens."""
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len,
                          detokenize=detokenize)


def count_tokens(outputs: list[Any], prompts: list[dict[str, Any]], out_lens: list[int], n: int) -> tuple[int, int]:
    """(prompt tokens, output tokens) from the `RequestOutput`s, else from what was asked."""
    n_prompt = n_output = 0
    for out, prompt, out_len in zip(outputs, prompts, out_lens):
        ids = getattr(out, "prompt_token_ids", None)
        n_prompt += len(ids) if ids is not None else len(prompt["prompt_token_ids"])
        completions = getattr(out, "outputs", None)
        n_output += sum(len(c.token_ids) for c in completions) if completions else out_len * n
    return n_prompt, n_output


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; print and return vLLM's throughput numbers.

    Raises:
        ValueError: a length or count flag is out of range.
    """
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1 or args.n < 1:
        raise ValueError("--num-prompts, --input-len, --output-len and --n must all be >= 1.")
    in_lo, in_hi = length_bounds(args.input_len, args.random_range_ratio)
    out_lo, out_hi = length_bounds(args.output_len, args.random_range_ratio)
    llm = make_llm(args)
    rng = np.random.default_rng(args.seed)
    sample = token_id_sampler(llm, rng)
    prefix = sample(args.random_prefix_len) if args.random_prefix_len > 0 else []
    in_lens = rng.integers(max(in_lo, 1), in_hi + 1, size=args.num_prompts).tolist()
    out_lens = rng.integers(max(out_lo, 1), out_hi + 1, size=args.num_prompts).tolist()
    prompts = [{"prompt_token_ids": prefix + sample(n)} for n in in_lens]
    params = [sampling_params(args.n, n, not args.disable_detokenize) for n in out_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    n_prompt, n_output = count_tokens(outputs, prompts, out_lens, args.n)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(prompts),
        "total_num_tokens": n_prompt + n_output,
        "total_num_output_tokens": n_output,
        "requests_per_second": len(prompts) / elapsed,
        "tokens_per_second": (n_prompt + n_output) / elapsed,
        "output_tokens_per_second": n_output / elapsed,
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {n_prompt}")
    print(f"Total num output tokens:  {n_output}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=4), encoding="utf-8")
    return result
