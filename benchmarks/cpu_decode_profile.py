"""Where a CPU decode step goes: median step time and a per-op table from torch.profiler.

`--batch` requests of `--prompt-len` random token ids are added to an
`LLMEngine` (SmolLM2-135M-Instruct by default, prefix caching off); the
prefill steps run unprofiled (their total time is printed; it includes the
first steps' warm-up), then `--steps` decode steps with the whole
batch are timed one by one (wall clock, and the engine thread's CPU time:
at one thread the C kernels run in it, so it counts what the step itself
costs, not the time it waited for a core), `--cprofile-steps` more run under
cProfile (Python functions by own time), and `--profile-steps` more run
under `torch.profiler`, whose self-CPU time per op and input shape is
printed per step (the profiler inflates small ops; read it for shares, the
timed steps for speed).

    PYTHONPATH=. python benchmarks/cpu_decode_profile.py --dtype bfloat16 --batch 64 --threads 2
    TOKENMILL_CPU_KERNELS=0 PYTHONPATH=. python benchmarks/cpu_decode_profile.py ...   # without the C kernels
    PYTHONPATH=. python benchmarks/cpu_decode_profile.py --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32 \
        --batch 1 --threads 1 --steps 200 --profile-steps 0 --cprofile-steps 50      # concurrency 1 on a GGUF
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

DEFAULT_MODEL = Path(__file__).resolve().parent / "peers" / ".models" / "SmolLM2-135M-Instruct"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="Model folder (default: the peers' SmolLM2 copy).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2, help="torch threads (TOKENMILL_CPU_THREADS).")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=32, help="Timed decode steps.")
    p.add_argument("--profile-steps", type=int, default=16, help="Profiled decode steps (0: no table).")
    p.add_argument("--rows", type=int, default=30, help="Rows of the op table.")
    p.add_argument("--cprofile-steps", type=int, default=0,
                   help="Decode steps more under cProfile (0: none); prints its top functions by own time.")
    args = p.parse_args()
    os.environ["TOKENMILL_CPU_THREADS"] = str(args.threads)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch, block_size=args.block_size,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    # A margin of tokens: requests whose first decode rode along with later prefills end a step early.
    params = SamplingParams(max_tokens=8 + args.steps + args.profile_steps + args.cprofile_steps, ignore_eos=True,
                            temperature=0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": rng.integers(100, 30000, args.prompt_len).tolist()}, params)
    t0 = time.perf_counter()
    while engine.get_stats().num_running_reqs < args.batch or engine.get_stats().num_waiting_reqs:
        engine.step()  # prefills
    prefill_s = time.perf_counter() - t0
    engine.step()  # the first decode step (sets up the step's buffers)
    def full_step() -> None:
        stats = engine.get_stats()
        if stats.num_running_reqs != args.batch or stats.num_waiting_reqs:
            raise RuntimeError(f"the batch is no longer whole ({stats.num_running_reqs} running)")
        engine.step()

    load = os.getloadavg()[0]
    times, cpu_times = [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.thread_time()
        full_step()
        cpu_times.append(time.thread_time() - c)
        times.append(time.perf_counter() - t)
    ms, cpu_ms = np.array(times) * 1e3, np.array(cpu_times) * 1e3
    print(f"{args.dtype}, batch {args.batch}, prompts of {args.prompt_len}, {torch.get_num_threads()} threads, "
          f"block size {args.block_size}: decode step median {np.median(ms):.1f} ms "
          f"(min {ms.min():.1f}, p10 {np.percentile(ms, 10):.1f}, p90 {np.percentile(ms, 90):.1f}, {len(ms)} steps; "
          f"engine thread CPU time median {np.median(cpu_ms):.1f}, min {cpu_ms.min():.1f} ms); "
          f"1-minute load {load:.2f} at the start; prefill of {args.batch} x {args.prompt_len} tokens "
          f"{prefill_s:.2f} s ({args.batch * args.prompt_len / prefill_s:.0f} tok/s, the first of them warms up)")
    if args.cprofile_steps:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.cprofile_steps):
            full_step()
        prof.disable()
        print(f"cProfile over {args.cprofile_steps} steps (Python calls; C kernels count in their caller's tottime):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)
    if args.profile_steps:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.profile_steps):
                full_step()
        events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events) / args.profile_steps / 1e3
        print(f"profiled: {total:.1f} ms of self CPU time per step; top ops (ms per step, calls per step, shapes):")
        for e in events[: args.rows]:
            print(f"{e.self_cpu_time_total / args.profile_steps / 1e3:8.2f} {e.count / args.profile_steps:7.1f}  "
                  f"{e.key:45s} {str(e.input_shapes)[:100]}")


if __name__ == "__main__":
    main()
