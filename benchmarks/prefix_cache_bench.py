"""Prefix caching: mean TTFT and throughput with caching on vs off (offline, engine-driven).

Workload: every request is one shared system prompt (`--system-len` token
ids, 1,000 by default) followed by its own question (`--question-len` ids,
~20), then `--output-len` greedy tokens. Token-id prompts (random ids from a
fixed seed), so the same workload runs with or without a tokenizer.

Two arrival patterns, each with `--enable-prefix-caching` and without:

- sequential: request i arrives when request i-1 has finished (load 1);
- poisson:    arrivals at `--request-rate` req/s (exponential gaps, fixed
              seed), well under capacity; the engine steps whenever it has
              work and otherwise waits for the next arrival.

TTFT = time the engine returned the request's first token - its arrival time
(queueing included); throughput = output tokens / (last finish - first
arrival). One warm-up request with another system prompt runs first (not
counted, and it shares no blocks with the workload).

CPU (bundled SmolLM2-135M, float32), from the repo root:

    PYTHONPATH=. python benchmarks/prefix_cache_bench.py --num-requests 50

H200 (Llama-3.1-8B shapes, dummy weights, bf16, no tokenizer):

    PYTHONPATH=. python benchmarks/prefix_cache_bench.py --config benchmarks/configs/llama-3.1-8b.json \\
        --load-format dummy --skip-tokenizer-init --num-requests 200 --request-rate 8 --output-len 32 \\
        --json-out prefix_cache_h200.json
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class RunResult:
    mode: str  # sequential | poisson
    caching: bool
    num_requests: int
    mean_ttft_s: float
    mean_ttft_after_first_s: float  # without request 0, the one that fills the cache
    median_ttft_s: float
    p99_ttft_s: float
    output_tok_per_s: float
    req_per_s: float
    wall_s: float
    mean_cached_tokens: float  # per request, from RequestOutput.num_cached_tokens
    prefix_cache_hit_rate: float  # hits / queried prompt tokens (scheduler counters)
    ttfts_s: list[float]  # per request, in arrival order


def make_workload(num_requests: int, system_len: int, question_len: int, vocab: int,
                  seed: int) -> tuple[list[int], list[list[int]]]:
    """(warm-up prompt, request prompts): one system prompt + a distinct question each, token ids."""
    rng = np.random.default_rng(seed)
    low = min(1000, vocab // 2)  # skip the low ids (special tokens in most vocabularies)
    system = rng.integers(low, vocab, system_len).tolist()
    warmup = rng.integers(low, vocab, system_len + question_len).tolist()
    prompts = [system + rng.integers(low, vocab, question_len).tolist() for _ in range(num_requests)]
    return warmup, prompts


def build_llm(args: argparse.Namespace, **overrides):
    """An `LLM` from the bench flags (a config file becomes a folder with dummy weights)."""
    from tokenmill import LLM

    kwargs = {"dtype": args.dtype, "max_model_len": args.max_model_len, "seed": args.seed,
              "skip_tokenizer_init": args.skip_tokenizer_init, "load_format": args.load_format}
    if args.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    kwargs.update(overrides)
    model = args.model
    if args.config:
        folder = Path(tempfile.mkdtemp(prefix="tokenmill_bench_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the engine may read it until it is freed
        shutil.copy(args.config, folder / "config.json")
        model = str(folder)
    return LLM(model, **kwargs)


def vocab_size(llm) -> int:
    return int(llm.llm_engine.model_config.hf_config.vocab_size)


def free_llm(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _params(output_len: int):
    from tokenmill import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)


def run_sequential(engine, prompts: list[list[int]], output_len: int) -> tuple[list[float], list[int], float, int]:
    """Each request waits for the previous one. Returns (ttfts, cached tokens, wall seconds, output tokens)."""
    params = _params(output_len)
    ttfts, cached, num_out = [], [], 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        arrival = time.perf_counter()
        engine.add_request(f"seq{i}", {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter()
                if out.finished:
                    cached.append(out.num_cached_tokens)
                    num_out += len(out.outputs[0].token_ids)
        assert first is not None
        ttfts.append(first - arrival)
    return ttfts, cached, time.perf_counter() - start, num_out


def run_poisson(engine, prompts: list[list[int]], output_len: int, rate: float,
                seed: int) -> tuple[list[float], list[int], float, int]:
    """Arrivals at `rate` req/s (exponential gaps). Returns (ttfts, cached tokens, wall seconds, output tokens)."""
    params = _params(output_len)
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(prompts))
    offsets = np.cumsum(gaps) - gaps[0]  # first request at t = 0
    start = time.perf_counter()
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    cached, num_out, next_i, done = [], 0, 0, 0
    while done < len(prompts):
        now = time.perf_counter() - start
        while next_i < len(prompts) and offsets[next_i] <= now:
            rid = f"poi{next_i}"
            arrival[rid] = start + float(offsets[next_i])
            engine.add_request(rid, {"prompt_token_ids": prompts[next_i]}, params)
            next_i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, float(offsets[next_i]) - (time.perf_counter() - start)))
            continue
        for out in engine.step():
            t = time.perf_counter()
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = t
            if out.finished:
                done += 1
                cached.append(out.num_cached_tokens)
                num_out += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return [first[r] - arrival[r] for r in arrival], cached, wall, num_out


def summarize(mode: str, caching: bool, ttfts: list[float], cached: list[int], wall: float, num_out: int,
              stats) -> RunResult:
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    return RunResult(mode=mode, caching=caching, num_requests=len(ttfts), mean_ttft_s=statistics.fmean(ttfts),
                     mean_ttft_after_first_s=statistics.fmean(ttfts[1:]) if len(ttfts) > 1 else float("nan"),
                     median_ttft_s=statistics.median(ttfts), p99_ttft_s=float(np.percentile(ttfts, 99)),
                     output_tok_per_s=num_out / wall, req_per_s=len(ttfts) / wall, wall_s=wall,
                     mean_cached_tokens=statistics.fmean(cached), prefix_cache_hit_rate=hit_rate, ttfts_s=ttfts)


def bench_one(args: argparse.Namespace, caching: bool) -> list[RunResult]:
    llm = build_llm(args, enable_prefix_caching=caching)
    engine = llm.llm_engine
    warmup, prompts = make_workload(args.num_requests, args.system_len, args.question_len, vocab_size(llm),
                                    args.seed)
    results = []
    for mode in args.modes.split(","):
        run_sequential(engine, [warmup], args.output_len)  # warm-up, shares no blocks with the workload
        engine.engine_core.scheduler.reset_prefix_cache()  # every mode starts cold
        before = engine.get_stats()
        if mode == "sequential":
            ttfts, cached, wall, num_out = run_sequential(engine, prompts, args.output_len)
        elif mode == "poisson":
            ttfts, cached, wall, num_out = run_poisson(engine, prompts, args.output_len, args.request_rate,
                                                       args.seed)
        else:
            raise ValueError(f"Unknown mode {mode!r}; use sequential and/or poisson.")
        after = engine.get_stats()
        delta = type(after)(prefix_cache_queries=after.prefix_cache_queries - before.prefix_cache_queries,
                            prefix_cache_hits=after.prefix_cache_hits - before.prefix_cache_hits)
        res = summarize(mode, caching, ttfts, cached, wall, num_out, delta)
        print(json.dumps(asdict(res)), flush=True)
        results.append(res)
    free_llm(llm)
    return results


def print_table(results: list[RunResult]) -> None:
    print("\n| arrivals | prefix caching | requests | mean TTFT (s) | mean TTFT after the first (s) | "
          "median TTFT (s) | p99 TTFT (s) | output tok/s | req/s | mean cached tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.mode} | {'on' if r.caching else 'off'} | {r.num_requests} | {r.mean_ttft_s:.3f} | "
              f"{r.mean_ttft_after_first_s:.3f} | {r.median_ttft_s:.3f} | {r.p99_ttft_s:.3f} | "
              f"{r.output_tok_per_s:.1f} | {r.req_per_s:.3f} | "
              f"{r.mean_cached_tokens:.0f} |")
    for mode in dict.fromkeys(r.mode for r in results):
        on = next((r for r in results if r.mode == mode and r.caching), None)
        off = next((r for r in results if r.mode == mode and not r.caching), None)
        if on and off:
            print(f"{mode}: mean TTFT off/on = {off.mean_ttft_s / on.mean_ttft_s:.1f}x, "
                  f"throughput on/off = {on.output_tok_per_s / off.output_tok_per_s:.2f}x")


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared with chunked_prefill_tpot.py."""
    ap.add_argument("--model", default=None, help="model path/id (default: the bundled SmolLM2-135M)")
    ap.add_argument("--config", default=None, help="an HF config.json: build that model with --load-format dummy")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-memory-bytes", default=None, help="KV size, e.g. 1G (CPU default 4 GiB)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--modes", default="sequential,poisson")
    ap.add_argument("--request-rate", type=float, default=0.1, help="poisson arrivals per second")
    ap.add_argument("--caching", default="on,off", help="which settings to run: on, off or on,off")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.config and args.load_format == "auto":
        args.load_format = "dummy"
    load = os.getloadavg()
    print(f"load average before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    results: list[RunResult] = []
    for setting in args.caching.split(","):
        results += bench_one(args, caching=setting.strip() == "on")
    print_table(results)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results]},
                                                  indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
