"""Where the GPU benchmark's time goes: per-step host/GPU split of the offline run, and kernel tables.

Runs `offline_bench.py --part offline`'s workload (same prompts, same engine
flags) with every engine step timed, then prints:

1. steps split into decode-only steps (CUDA graphs) and steps that carry
   prefill tokens (eager): count, seconds, mean batch, and the mean wall ms
   of the step's phases: `schedule` (engine.step entry -> execute_model
   entry), `execute` (execute_model, host wall: launches + the wait for the
   sampled ids), `post` (execute_model exit -> engine.step exit: scheduler
   update, output processing);
2. a torch.profiler kernel table (top kernels by GPU time, per step) over
   `--profile-steps` steps of each kind, taken mid-run;
3. the same kernel table for one request alone (`--tpot-input` context),
   i.e. offline_bench's part (c).

    python benchmarks/gpu/step_profile.py                        # 1000 prompts, as part (a)
    python benchmarks/gpu/step_profile.py --num-prompts 300 --max-num-seqs 1024

Flags not listed here are offline_bench.py's (e.g. --max-num-seqs,
--max-num-batched-tokens, --config, --force-cc70).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import offline_bench as ob


class PhaseTimer:
    """Wraps one engine's `step` and executor's `execute_model`; records each step's phases (host wall ms).

    Each record: (num decode requests, num prefill tokens, schedule ms, execute ms, post ms).
    """

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.executor = self.engine.engine_core.executor
        # Async scheduling launches through execute_model_async: there `execute` is the launch and
        # `post` includes the wait for the previous step's sampled ids.
        self.launch_name = ("execute_model_async" if self.engine.engine_core.scheduler.async_scheduling
                            else "execute_model")
        self._step, self._exec = self.engine.step, getattr(self.executor, self.launch_name)
        self.engine.step = self._timed_step
        setattr(self.executor, self.launch_name, self._timed_exec)
        self.records: list[tuple[int, int, float, float, float]] = []
        self.on_step: Any = None  # callback(step index, is_mixed) before each step's execute_model

    def _timed_step(self) -> Any:
        self._t0 = time.perf_counter()
        self._cur: list[Any] | None = None
        out = self._step()
        t3 = time.perf_counter()
        if self._cur is not None:
            n_dec, n_pre, t1, t2 = self._cur
            self.records.append((n_dec, n_pre, (t1 - self._t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
        return out

    def _timed_exec(self, scheduler_output: Any) -> Any:
        n = list(scheduler_output.num_scheduled_tokens.values())
        n_dec = sum(1 for x in n if x == 1)
        n_pre = sum(x for x in n if x > 1)
        if self.on_step is not None:
            self.on_step(len(self.records), n_pre > 0)
        t1 = time.perf_counter()
        out = self._exec(scheduler_output)
        self._cur = [n_dec, n_pre, t1, time.perf_counter()]
        return out


def summarize(records: list[tuple[int, int, float, float, float]]) -> None:
    """Print the decode-only / mixed split of `records`."""
    arr = np.array(records, dtype=np.float64)
    print("| steps | count | seconds | mean decodes | mean prefill tokens | schedule ms | execute ms | post ms | step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, mask in (("decode-only", arr[:, 1] == 0), ("with prefill", arr[:, 1] > 0), ("all", arr[:, 1] >= 0)):
        sub = arr[mask]
        if not len(sub):
            continue
        total = sub[:, 2:].sum(axis=1)
        print(f"| {name} | {len(sub)} | {total.sum() / 1e3:.1f} | {sub[:, 0].mean():.1f} | {sub[:, 1].mean():.0f} | "
              f"{sub[:, 2].mean():.2f} | {sub[:, 3].mean():.2f} | {sub[:, 4].mean():.2f} | {total.mean():.2f} |")
    dec = arr[arr[:, 1] == 0]
    if len(dec):
        print("decode-only steps by batch size (execute ms):")
        for lo, hi in ((1, 32), (33, 128), (129, 256), (257, 512), (513, 1024)):
            sub = dec[(dec[:, 0] >= lo) & (dec[:, 0] <= hi)]
            if len(sub):
                print(f"  batch {lo}-{hi}: {len(sub)} steps, mean batch {sub[:, 0].mean():.0f}, "
                      f"execute {sub[:, 3].mean():.2f} ms, step {sub[:, 2:].sum(axis=1).mean():.2f} ms")


def kernel_table(prof: Any, steps: int, title: str, top: int = 25) -> None:
    """Top GPU activities of a finished profiler by total time, per step, with launch counts."""
    from torch.autograd import DeviceType

    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            a = agg[e.name[:90]]
            a[0] += e.time_range.elapsed_us()
            a[1] += 1
    total = sum(v[0] for v in agg.values())
    print(f"\n### {title}: {steps} steps, GPU activity {total / 1e3 / max(1, steps):.2f} ms/step, "
          f"{sum(v[1] for v in agg.values()) / max(1, steps):.0f} kernels/step")
    print("| kernel | ms/step | launches/step | share |")
    print("|---|---:|---:|---:|")
    for name, (us, cnt) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| `{name}` | {us / 1e3 / steps:.3f} | {cnt / steps:.1f} | {100 * us / max(total, 1e-9):.1f}% |")


def profile_window(timer: PhaseTimer, start_at: int, n_steps: int) -> dict[str, Any]:
    """Arm a profiler for steps [start_at, start_at + n_steps) of the next run; counts the mixed steps among them."""
    state: dict[str, Any] = {"prof": None, "mixed": 0, "done": False}

    def hook(index: int, mixed: bool) -> None:
        import torch

        if state["done"] or index < start_at:
            return
        if index == start_at:
            state["prof"] = ob._start_profiler()
            if state["prof"] is None:
                state["done"] = True
                return
        if index >= start_at + n_steps:  # stop before this step runs
            torch.cuda.synchronize()
            state["prof"].stop()
            state["done"] = True
            return
        state["mixed"] += int(mixed)
    timer.on_step = hook
    return state


def profiled_run(llm: Any, recorder: Any, timer: PhaseTimer, workload: Any, at: int, n_steps: int, title: str) -> None:
    """Run `workload` with steps [at, at + n_steps) profiled; print the kernel table and the phase split."""
    timer.records.clear()
    state = profile_window(timer, at, n_steps)
    ob.tokenmill_generate(llm, recorder, workload)
    timer.on_step = None
    if state["prof"] is not None and state["done"]:
        kernel_table(state["prof"], n_steps, f"{title}: steps {at}..{at + n_steps - 1}, {state['mixed']} with prefill")
    else:
        print(f"\n### {title}: no profile (run had {len(timer.records)} steps)")
    summarize(timer.records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--decode-profile-at", type=int, default=30, help="first profiled step of the 256 x 800 run")
    ap.add_argument("--mixed-profile-at", type=int, default=300, help="first profiled step of the 400-prompt run")
    ap.add_argument("--skip-tpot", action="store_true")
    own, rest = ap.parse_known_args()
    args = ob.parse_args(["--part", "offline", "--hf-prompts", "0", *rest])
    vocab = ob.json.loads(Path(args.config).read_text())["vocab_size"]
    lens = (args.min_len, args.max_len)
    workload = ob.make_workload(args.num_prompts, lens, lens, vocab, args.seed)
    warmups = ob.warmup_workloads(args.warmup_prompts, lens, args.max_model_len, vocab, args.seed + 1)
    llm, startup = ob.build_llm(args)
    ob.engine_facts(llm, startup)
    recorder = ob.StepRecorder(llm)
    for w in warmups:
        ob.tokenmill_generate(llm, recorder, w)
    timer = PhaseTimer(llm)

    res = ob.tokenmill_generate(llm, recorder, workload)
    print(f"(steps launched through {timer.launch_name})")
    print(f"\n## offline, {len(workload)} prompts: {res['output_tok_s']:.0f} output tok/s, {res['elapsed_s']:.1f} s, "
          f"{res['num_steps']} steps, mean batch {res['mean_batch_reqs']:.1f}, preemptions {res['num_preemptions']}")
    summarize(timer.records)

    k = own.profile_steps
    profiled_run(llm, recorder, timer, workload[:400], own.mixed_profile_at, k, "offline workload, 400 prompts")
    decode_wl = ob.make_workload(256, (800, 800), (64, 64), vocab, args.seed + 3)
    profiled_run(llm, recorder, timer, decode_wl, own.decode_profile_at, k, "256 x 800 in / 64 out")
    if not own.skip_tpot:
        one = ob.make_workload(1, (args.tpot_input,) * 2, (k + 8, k + 8), vocab, args.seed)
        ob.tokenmill_generate(llm, recorder, one)
        profiled_run(llm, recorder, timer, one, 4, k, f"one request, {args.tpot_input}-token context")
    ob.free_llm(llm)


if __name__ == "__main__":
    main()
