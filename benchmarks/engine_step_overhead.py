"""Where a served one-token decode step's time goes outside the model: the engine core's parts, timed one by one.

One request of `--prompt-len` random ids (greedy, EOS ignored) runs in an
in-process `LLMEngine` on the bundled SmolLM2 Q4_1 GGUF (the fused C decode
step, CPU, `--threads` torch threads, adaptive threads off); after the
prefill, `--steps` decode steps are timed, and each part below with a
wrapper around it, on the thread's CPU clock (`time.thread_time_ns`: at one
thread the C kernels run in this thread, and a step waiting for a core does
not count). Besides the core's own step, the two codecs the served path adds
(`encode_outputs` in the core, `decode_outputs` in the API server) and the
front end's `OutputProcessor.process_outputs` (detokenization) are timed on
each step's outputs.

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/engine_step_overhead.py --steps 300

Prints the median and mean microseconds per step of each part; "core step"
is `EngineCore.step` as a whole, "rest of the step" what is left of it after
the parts nested in it (scheduler, input preparation, bookkeeping).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2 Q4_1 GGUF")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="then N more steps under cProfile; prints the top functions by own time")
    args = p.parse_args()
    os.environ["TOKENMILL_CPU_THREADS"] = str(args.threads)
    os.environ["TOKENMILL_CPU_ADAPTIVE_THREADS"] = "0"
    os.environ.setdefault("TOKENMILL_PYTHON", sys.executable)  # peers.bundled_gguf looks in this venv

    import numpy as np

    from peers import bundled_gguf
    from tokenmill import LLM, SamplingParams
    from tokenmill.core.scheduler import Scheduler
    from tokenmill.engine import messages
    from tokenmill.sample.sampler import Sampler
    from tokenmill.sampling_params import RequestOutputKind
    from tokenmill.worker.model_runner import ModelRunner

    llm = LLM(args.model or str(bundled_gguf()), dtype="float32", max_model_len=1024, max_num_seqs=64,
              kv_cache_memory_bytes=1 << 30)
    engine = llm.llm_engine
    times: dict[str, list[int]] = defaultdict(list)

    def timed(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.thread_time_ns()
            try:
                return fn(*a, **kw)
            finally:
                times[label].append(time.thread_time_ns() - t0)

        setattr(owner, name, wrapper)

    timed(Scheduler, "schedule", "scheduler.schedule")
    timed(Scheduler, "update_from_output", "scheduler.update_from_output")
    timed(ModelRunner, "_run_model", "model forward (layers)")
    timed(ModelRunner, "_sample", "LM head + sampler")
    timed(Sampler, "__call__", "  of it the sampler")
    ids = np.random.default_rng(0).integers(100, 40000, args.prompt_len).tolist()
    params = SamplingParams(max_tokens=args.steps + args.cprofile + 4, ignore_eos=True, temperature=0,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("0", {"prompt_token_ids": ids}, params)
    core, out_proc = engine.engine_core, engine.output_processor
    step_t: list[int] = []
    for i in range(args.steps + 2):
        if i == 2:  # prefill and the first decode step are not timed
            times.clear()
            step_t.clear()
        t0 = time.thread_time_ns()
        outputs = core.step()
        step_t.append(time.thread_time_ns() - t0)
        t0 = time.thread_time_ns()
        wire = messages.encode_outputs(outputs)
        times["encode_outputs (core)"].append(time.thread_time_ns() - t0)
        t0 = time.thread_time_ns()
        decoded = messages.decode_outputs(bytes(wire) if not isinstance(wire, bytes) else wire)
        times["decode_outputs (API server)"].append(time.thread_time_ns() - t0)
        t0 = time.thread_time_ns()
        out_proc.process_outputs(decoded)
        times["process_outputs (API server)"].append(time.thread_time_ns() - t0)
    nested = ("scheduler.schedule", "scheduler.update_from_output", "model forward (layers)", "LM head + sampler")
    rest = [s - sum(times[k][j] for k in nested) for j, s in enumerate(step_t)]
    rows = {"core step (EngineCore.step)": step_t, **{k: times[k] for k in nested},
            "  of it the sampler": times["  of it the sampler"], "rest of the step": rest,
            "encode_outputs (core)": times["encode_outputs (core)"],
            "decode_outputs (API server)": times["decode_outputs (API server)"],
            "process_outputs (API server)": times["process_outputs (API server)"]}
    print(f"{args.steps} decode steps, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}; thread CPU us/step:")
    for label, vals in rows.items():
        print(f"  {label:34s} median {statistics.median(vals) / 1e3:9.1f}   mean {statistics.mean(vals) / 1e3:9.1f}")
    if args.cprofile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.cprofile):
            out_proc.process_outputs(messages.decode_outputs(messages.encode_outputs(core.step())))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    engine.shutdown()


if __name__ == "__main__":
    main()
