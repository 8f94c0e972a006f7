"""Host time per engine step, split by component (CPU, no GPU, no real model).

On a GPU a decode step of an 8B model at batch 256 takes ~10-15 ms under
CUDA graphs; if the Python around it takes longer, the GPU idles. This
script measures only that Python: `LLM.generate` over the real scheduler,
KV-cache manager, output processor and `ModelRunner` (InputBatch,
SamplingState, block table), with the model swapped for a stub whose
forward returns zeros `[T, hidden]` and whose `compute_logits` returns
pre-drawn random logits `[N, vocab]` (so tokens vary and sampling is real).

Workload: `--num-requests` token-id prompts of uniform length in
`[--min-prompt, --max-prompt]`, `max_tokens=--max-tokens`, `ignore_eos`,
no detokenization, `max_num_seqs = --batch` (prefix caching on, as the
default). Only decode steps with the full batch (every request scheduled,
one token each) are counted. Times are process CPU time (`time.process_time`,
torch limited to one thread) so a busy machine inflates them less than wall
time; wall time is printed as well.

Components of one step (exclusive, they add up to the total):

    schedule        Scheduler.schedule
    update_states   ModelRunner._update_states (scheduler diffs -> batch rows)
    prepare_inputs  InputBatch.prepare_inputs, less the two below
    sampling_md     SamplingState.make_metadata
    block_table     BlockTable.commit
    forward (stub)  ModelRunner._run_model (a zeros tensor here)
    sampling        compute_logits + Sampler (real CPU compute here; GPU work on a GPU)
    runner_other    the rest of ModelRunner.execute_model (ids, output lists)
    update          Scheduler.update_from_output
    core_other      the rest of EngineCore.step (structured output, stats)
    outputs         OutputProcessor.process_outputs (RequestOutput building)
    engine_other    the rest of LLMEngine.step
    generate_loop   LLM.generate's loop between steps (bookkeeping)

    python benchmarks/host_overhead.py [--batch 256] [--repeats 5] [--profile 30]

The machine this runs on is usually shared: compare two trees interleaved
(A, B, A, B) and read the medians, not a single run.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokenmill import LLM, SamplingParams

# Exclusive components, in report order (see the module docstring).
_ROWS = ["schedule", "update_states", "prepare_inputs", "sampling_md", "block_table", "forward", "sampling",
         "runner_other", "update", "core_other", "outputs", "engine_other", "generate_loop"]
_HOST_EXCLUDED = {"forward", "sampling"}  # device work on a GPU


class StubModel(torch.nn.Module):
    """Forward -> zeros [T, hidden]; compute_logits -> one of a few pre-drawn [max_rows, vocab] logit blocks."""

    def __init__(self, hidden_size: int, vocab_size: int, max_rows: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.hidden_size = hidden_size
        self.pool = [torch.randn(max_rows, vocab_size, generator=gen) for _ in range(3)]
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate=None) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.pool[self.calls % len(self.pool)][: hidden.shape[0]]


def _write_model_dir(path: str, vocab_size: int, max_model_len: int) -> None:
    """config.json of a 1-layer, hidden-64 Llama (dummy weights are drawn from it, then replaced)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": max_model_len, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


class StepTimer:
    """Accumulates (cpu, wall) seconds per component name into the current step's record."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        # Profiles the steps that follow a full-batch decode step (the steady state), when set.
        self.profile: cProfile.Profile | None = None
        self.steps: list[dict] = []
        self.cur: dict = defaultdict(float)
        self.last_end: tuple[float, float] | None = None  # (cpu, wall) when the last step returned

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cur[name] += time.process_time() - c0
                self.cur["wall_" + name] += time.perf_counter() - w0

        setattr(obj, attr, timed)


def build_llm(args: argparse.Namespace, model_dir: str) -> LLM:
    max_model_len = args.max_prompt + args.max_tokens
    blocks_per_req = -(-max_model_len // 16)
    llm = LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="float32", device="cpu",
              max_model_len=max_model_len, max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks_override=args.batch * blocks_per_req + 64, block_size=16,
              enable_prefix_caching=not args.no_prefix_caching)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    runner.model = StubModel(runner.hidden_size, runner.vocab_size, args.batch)
    return llm


def instrument(llm: LLM, timer: StepTimer) -> None:
    """Wrap the components (instance attributes over the bound methods) to time each step."""
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.model_runner
    batch = runner.input_batch
    shape = {"num_reqs": 0, "decode": False}  # of the step being run
    schedule = core.scheduler.schedule

    def schedule_and_note_shape():
        out = schedule()
        n = len(out.num_scheduled_tokens)
        shape["num_reqs"], shape["decode"] = n, n > 0 and out.total_num_scheduled_tokens == n
        return out

    core.scheduler.schedule = schedule_and_note_shape
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update_from_output", "update")
    timer.wrap(core.executor, "execute_model", "execute")
    timer.wrap(runner, "_update_states", "update_states")
    timer.wrap(batch, "prepare_inputs", "prepare_inputs")
    timer.wrap(batch.sampling, "make_metadata", "sampling_md")
    timer.wrap(batch.block_table, "commit", "block_table")
    timer.wrap(runner, "_run_model", "forward")
    timer.wrap(runner, "_sample", "sampling")
    timer.wrap(core, "step", "core_step")
    timer.wrap(engine.output_processor, "process_outputs", "outputs")

    step = engine.step

    def engine_step():
        c0, w0 = time.process_time(), time.perf_counter()
        if timer.last_end is not None and timer.steps:
            # The gap since the previous step returned: LLM.generate's loop body for its outputs.
            timer.steps[-1]["generate_loop"] = c0 - timer.last_end[0]
            timer.steps[-1]["wall_generate_loop"] = w0 - timer.last_end[1]
        timer.cur = defaultdict(float)
        prev = timer.steps[-1] if timer.steps else None
        profile = timer.profile if prev and prev["decode"] and prev["num_reqs"] == timer.batch else None
        if profile is not None:
            profile.enable()
        try:
            return step()
        finally:
            if profile is not None:
                profile.disable()
            c1, w1 = time.process_time(), time.perf_counter()
            rec = timer.cur
            rec["engine_step"], rec["wall_engine_step"] = c1 - c0, w1 - w0
            rec["num_reqs"], rec["decode"] = shape["num_reqs"], shape["decode"]
            timer.steps.append(rec)
            timer.last_end = (c1, w1)

    engine.step = engine_step


def exclusive(rec: dict, prefix: str = "") -> dict[str, float]:
    """Turn nested inclusive times into the exclusive rows of `_ROWS` (ms)."""
    def g(k: str) -> float:
        return rec.get(prefix + k, 0.0)

    out = {
        "schedule": g("schedule"),
        "update_states": g("update_states"),
        "prepare_inputs": g("prepare_inputs") - g("sampling_md") - g("block_table"),
        "sampling_md": g("sampling_md"),
        "block_table": g("block_table"),
        "forward": g("forward"),
        "sampling": g("sampling"),
        "runner_other": g("execute") - g("update_states") - g("prepare_inputs") - g("forward") - g("sampling"),
        "update": g("update"),
        "core_other": g("core_step") - g("schedule") - g("execute") - g("update"),
        "outputs": g("outputs"),
        "engine_other": g("engine_step") - g("core_step") - g("outputs"),
        "generate_loop": g("generate_loop"),
    }
    return {k: v * 1e3 for k, v in out.items()}


def run_once(args: argparse.Namespace, llm: LLM, timer: StepTimer, seed: int,
             profile: cProfile.Profile | None) -> list[dict]:
    """One `generate` call; returns the records of its full-batch decode steps."""
    timer.steps = []
    timer.last_end = None
    timer.profile = profile
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    rng = np.random.default_rng(seed)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_requests or args.batch)
    prompts = [rng.integers(10, runner.vocab_size, n).tolist() for n in lens]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    llm.generate(prompts, params, use_tqdm=False)
    return [r for r in timer.steps if r["decode"] and r["num_reqs"] == args.batch]


def main(argv: list[str] | None = None) -> None:
    """Run the measurement and print the Markdown table (argv: the command-line flags)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="max_num_seqs, and the number of requests")
    p.add_argument("--num-requests", type=int, default=0, help="default: --batch")
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--vocab-size", type=int, default=512,
                   help="stub logits width; kept small so CPU sampling neither costs much nor evicts the "
                        "host objects from the CPU caches (on a GPU the logits never touch them)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--repeats", type=int, default=3, help="generate calls (the first one also warms up)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="cProfile the decode steps of the last run; print the top N functions")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as model_dir:
        _write_model_dir(model_dir, args.vocab_size, args.max_prompt + args.max_tokens)
        llm = build_llm(args, model_dir)
    timer = StepTimer(args.batch)
    instrument(llm, timer)
    per_run: list[dict[str, float]] = []
    wall_totals: list[float] = []
    for r in range(args.repeats):
        prof = cProfile.Profile() if args.profile and r == args.repeats - 1 else None
        steps = run_once(args, llm, timer, seed=r, profile=prof)
        if not steps:
            sys.exit("No full-batch decode step was seen; raise --max-tokens or --max-num-batched-tokens.")
        rows = [exclusive(s) for s in steps]
        mean = {k: statistics.fmean(x[k] for x in rows) for k in _ROWS}
        per_run.append(mean)
        wall = statistics.fmean(sum(exclusive(s, "wall_").values()) for s in steps)
        wall_totals.append(wall)
        host = sum(v for k, v in mean.items() if k not in _HOST_EXCLUDED)
        print(f"run {r}: {len(steps)} decode steps at batch {args.batch}: host {host:.2f} ms CPU/step "
              f"(+ stub forward/sampling {mean['forward'] + mean['sampling']:.2f}); wall all-in {wall:.2f} ms",
              file=sys.stderr)
        if prof is not None:
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)

    # Runs after the first (warm-up) when there are several: the median of the
    # run means, and the least disturbed run (lowest host total; on a shared
    # machine other processes only ever add time).
    runs = per_run[1:] if len(per_run) > 1 else per_run
    med = {k: statistics.median(r[k] for r in runs) for k in _ROWS}
    best = min(runs, key=lambda r: sum(v for k, v in r.items() if k not in _HOST_EXCLUDED))
    print(f"\nbatch {args.batch}, prompts U[{args.min_prompt}, {args.max_prompt}], max_tokens {args.max_tokens}, "
          f"vocab {args.vocab_size}, temperature {args.temperature}, prefix caching "
          f"{'off' if args.no_prefix_caching else 'on'}; CPU ms per full-batch decode step, "
          f"{len(runs)} runs\n")
    print("| component | median ms | best run ms |\n|---|---:|---:|")
    for k in _ROWS:
        label = k + (" (device work on a GPU)" if k in _HOST_EXCLUDED else "")
        print(f"| {label} | {med[k]:.3f} | {best[k]:.3f} |")
    totals = [sum(v for k, v in r.items() if k not in _HOST_EXCLUDED) for r in (med, best)]
    print(f"| **host total (without forward, sampling)** | **{totals[0]:.2f}** | **{totals[1]:.2f}** |")
    print(f"\nwall ms per step incl. stub forward and sampling: {statistics.median(wall_totals[1:] or wall_totals):.2f}")


if __name__ == "__main__":
    main()
