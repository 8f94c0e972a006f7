"""Offline GPU benchmark: tokenmill `LLM.generate` vs transformers `generate`, dummy weights, token-id prompts.

One part per invocation (each a fresh process, so every engine starts on a clean GPU):

  offline  --num-prompts (1000) prompts of random token ids, input and output
           lengths uniform in [--min-len, --max-len] = [100, 1024] (seeded),
           ignore_eos, greedy, all given to one `LLM.generate`. Baseline:
           transformers on a seeded --hf-prompts (200) subsample.
  short    --num-prompts (256) prompts of --short-len (128) tokens in and out;
           transformers on all of them.
  tpot     one request alone: --tpot-input (1024) prompt tokens, --tpot-output
           (256) output tokens. TTFT and TPOT from the times engine.step()
           returned each token (TPOT excludes the first token); GPU time per
           decode step = the sum of CUDA kernel times that torch.profiler
           records over --profile-steps decode steps of a second, identical-
           length request, divided by the steps; plus the span of
           execute_model between two CUDA events (which includes the GPU idle
           while the host launches kernels).

Timing: wall time of `generate` only, after a warm-up generate (Triton
compiles happen there) and with model loading outside. Only generated tokens
count. transformers: static batches of --hf-batch-size (64) prompts sorted by
prompt length, left-padded, greedy, `max_new_tokens = min_new_tokens` = the
batch's largest requested output (EOS can never end it), counting only each
prompt's requested output tokens; the model is built from the same config.json
directly on the GPU in the same dtype, random weights, attn_implementation
"sdpa". tokenmill runs first and is shut down before transformers loads;
a failing baseline is reported and leaves tokenmill's numbers intact.
Steps and mean batch come from a wrapper around the executor's execute_model.

Commands (repository root, one H200; `--json-out FILE` writes the numbers):

    python benchmarks/gpu/offline_bench.py --part offline
    python benchmarks/gpu/offline_bench.py --part short
    python benchmarks/gpu/offline_bench.py --part tpot
    python benchmarks/gpu/offline_bench.py --part offline --config benchmarks/configs/qwen3-30b-a3b.json --hf-prompts 0
    python benchmarks/gpu/offline_bench.py --part offline --force-cc70      # fp16, V100 code paths, no baseline
    python benchmarks/gpu/offline_bench.py --part prefill                   # 16 x 32k prompts, 1 token each: prompt tok/s
    python benchmarks/gpu/offline_bench.py --part tpot --tpot-input 126000 --tpot-output 64 --max-model-len 131072

Without a .git in the copy, pass `--git-commit SHA` to record the commit.
`--hf-prompts 0` / `--skip-tokenmill` split a part into two shorter runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DEFAULT_CONFIG = ROOT / "benchmarks" / "configs" / "llama-3.1-8b.json"
PART_DEFAULTS = {"offline": {"num_prompts": 1000, "hf_prompts": 200}, "short": {"num_prompts": 256}, "tpot": {},
                 "prefill": {"num_prompts": 16}}

Workload = list[tuple[list[int], int]]  # (prompt token ids, requested output tokens) per prompt


def make_workload(num_prompts: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab_size: int,
                  seed: int) -> Workload:
    """`num_prompts` random token-id prompts; lengths uniform in the inclusive ranges, all from `seed`.

    Ids avoid the ends of the vocabulary (special tokens sit there in Llama 3 and Qwen 3).
    """
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_range[0], in_range[1] + 1, num_prompts)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, num_prompts)
    margin = min(300, vocab_size // 8)
    return [(rng.integers(margin, vocab_size - margin, n).tolist(), int(m)) for n, m in zip(in_lens, out_lens)]


def warmup_workloads(n: int, lens: tuple[int, int], max_model_len: int, vocab_size: int, seed: int) -> list[Workload]:
    """Two warm-ups that make Triton compile, before the timing, every kernel variant the run will need.

    1. `n` prompts with the run's input lengths and 1-32 output tokens: full
       prefill steps, then decode batches shrinking from n to 1.
    2. `n` prompts about as long as the run's longest sequences, request i
       asking for i + 1 tokens: one decode step at each batch size n..1 with
       long contexts, i.e. every split-KV count (NUM_SPLITS is a constexpr;
       small batches late in the run split long contexts up to 8 ways).
    """
    mixed = make_workload(n, lens, (1, 32), vocab_size, seed)
    long_len = max(1, min(2 * lens[1] - n, max_model_len - n))
    staggered = [(ids, i + 1) for i, (ids, _) in enumerate(make_workload(n, (long_len,) * 2, (1, 1), vocab_size, seed))]
    return [mixed, staggered]


def subsample(workload: Workload, n: int, seed: int) -> Workload:
    """`n` prompts of `workload` drawn without replacement with `seed`, in their original order."""
    idx = np.sort(np.random.default_rng(seed).choice(len(workload), size=min(n, len(workload)), replace=False))
    return [workload[i] for i in idx]


# ----------------------------------------------------------------------------- tokenmill


class StepRecorder:
    """Wraps one engine's `executor.execute_model`: counts steps, requests and tokens; times steps when asked.

    `spans_ms()` are execute_model spans in ms: between two CUDA events on a
    GPU (they end after the step's wait for its sampled ids, so GPU idle time
    while the host launches kernels is included; under async scheduling the
    span is the launch, `execute_model_async`, which returns before that
    wait), host wall time on the CPU.
    """

    def __init__(self, llm: Any) -> None:
        self.executor = llm.llm_engine.engine_core.executor
        self._inner = self.executor.execute_model
        self.executor.execute_model = self._execute
        if self.executor.supports_async:  # async scheduling launches steps through this one
            self._inner_async = self.executor.execute_model_async
            self.executor.execute_model_async = self._execute_async
        self.cuda = llm.llm_engine.engine_config.device_config.device == "cuda"
        self.profile_window: tuple[int, int] | None = None  # (first step, steps): kernels of a steady-state window
        self._prof: Any = None
        self.reset()

    def reset(self, timing: bool = False, progress_every: int = 0) -> None:
        """Zero the counters; time each step if `timing`; print a line every `progress_every` steps if > 0.

        (A run cut short by a time limit still shows how far it got.)
        """
        self.steps = self.reqs = self.tokens = 0
        self.timing = timing
        self.progress_every = progress_every
        self._start = time.perf_counter()
        self._spans: list[Any] = []

    def _execute(self, scheduler_output: Any) -> Any:
        return self._record(self._inner, scheduler_output)

    def _execute_async(self, scheduler_output: Any) -> Any:
        return self._record(self._inner_async, scheduler_output)

    def _record(self, inner: Any, scheduler_output: Any) -> Any:
        """Count the step and run `inner` on it (timed when asked)."""
        self.steps += 1
        self.reqs += len(scheduler_output.num_scheduled_tokens)
        self.tokens += scheduler_output.total_num_scheduled_tokens
        if self.progress_every and self.steps % self.progress_every == 0:
            print(f"  step {self.steps}: {time.perf_counter() - self._start:.1f} s, mean batch "
                  f"{self.reqs / self.steps:.1f} requests", flush=True)
        if self.profile_window and self.cuda:
            first, n = self.profile_window
            if self.steps == first:
                self._prof, self._prof_tokens = _start_profiler(), 0
            elif self.steps == first + n and self._prof is not None:
                print(f"steps {first}..{first + n - 1} under torch.profiler ({self._prof_tokens} scheduled tokens):",
                      flush=True)
                us = _stop_profiler(self._prof, top=16)
                if us:
                    print(f"  = {us / 1e3 / n:.2f} ms of GPU activity per step", flush=True)
                self._prof = None
            if self._prof is not None:
                self._prof_tokens += scheduler_output.total_num_scheduled_tokens
        if not self.timing:
            return inner(scheduler_output)
        if self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(scheduler_output)
            end.record()
            self._spans.append((start, end))
        else:
            t0 = time.perf_counter()
            out = inner(scheduler_output)
            self._spans.append((time.perf_counter() - t0) * 1e3)
        return out

    def spans_ms(self) -> list[float]:
        """execute_model time of each step since `reset(timing=True)`, ms (syncs the GPU)."""
        if not self.cuda:
            return list(self._spans)
        import torch

        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in self._spans]

    def counters(self) -> dict[str, float]:
        """Steps since `reset`, and the mean scheduled requests and tokens per step."""
        return {"num_steps": self.steps, "mean_batch_reqs": self.reqs / max(1, self.steps),
                "mean_batch_tokens": self.tokens / max(1, self.steps)}


def build_llm(args: argparse.Namespace) -> tuple[Any, float]:
    """(tokenmill `LLM` with dummy weights from --config, start-up seconds)."""
    from tokenmill import LLM

    kwargs: dict[str, Any] = {
        "load_format": "dummy", "dtype": args.dtype, "skip_tokenizer_init": True, "seed": 0,
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs, "device": args.device,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.enforce_eager,
        "kv_cache_dtype": args.kv_cache_dtype}
    if args.disable_hybrid_kv_cache_manager:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    for name in ("max_num_batched_tokens", "kv_cache_memory_bytes", "quantization"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    model_dir = Path(tempfile.mkdtemp(prefix="offline_bench_"))
    try:
        shutil.copy(args.config, model_dir / "config.json")
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), **kwargs)
        return llm, time.perf_counter() - t0
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def engine_facts(llm: Any, startup_s: float) -> dict[str, Any]:
    """KV-cache size and the scheduler limits the engine resolved (also printed)."""
    from tokenmill.engine.core import kv_cache_bytes_per_block

    cfg = llm.llm_engine.engine_config
    cc, sc = cfg.cache_config, cfg.scheduler_config
    facts = {
        "kv_blocks": cc.num_gpu_blocks, "block_size": cc.block_size, "kv_tokens": cc.num_gpu_blocks * cc.block_size,
        "kv_gib": cc.num_gpu_blocks * kv_cache_bytes_per_block(cfg) / 2**30, "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens, "max_model_len": sc.max_model_len,
        "dtype": cfg.model_config.dtype, "kv_cache_dtype": cc.cache_dtype, "device": cfg.device_config.device,
        "enforce_eager": cfg.device_config.enforce_eager, "force_cc70": cfg.device_config.force_cc70}
    print(f"tokenmill: start-up {startup_s:.1f} s; KV cache: {facts['kv_blocks']} blocks x {facts['block_size']} "
          f"tokens = {facts['kv_tokens']} tokens ({facts['kv_gib']:.2f} GiB); max_num_seqs {facts['max_num_seqs']}, "
          f"max_num_batched_tokens {facts['max_num_batched_tokens']}, {facts['dtype']}, "
          f"kv cache dtype {facts['kv_cache_dtype']}, "
          f"enforce_eager {facts['enforce_eager']}", flush=True)
    return facts


def free_llm(llm: Any) -> None:
    """Shut the engine down and give its GPU memory back (transformers loads next in this process)."""
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"after tokenmill shutdown: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated", flush=True)


def tokenmill_generate(llm: Any, recorder: StepRecorder, workload: Workload, progress_every: int = 0) -> dict[str, Any]:
    """Run `workload` in one `LLM.generate` (greedy, ignore_eos); tokens, seconds, tok/s, steps, mean batch."""
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in workload]
    preempted = llm.llm_engine.get_stats().num_preemptions
    recorder.reset(progress_every=progress_every)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(ids) for ids, _ in workload)
    return {"num_prompts": len(workload), "input_tokens": n_in, "output_tokens": n_out,
            "requested_output_tokens": sum(n for _, n in workload), "elapsed_s": elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed, **recorder.counters(),
            "num_preemptions": llm.llm_engine.get_stats().num_preemptions - preempted}


def run_tokenmill(args: argparse.Namespace, workload: Workload, warmups: list[Workload]) -> dict[str, Any]:
    """Start the engine, run each warm-up workload, time `workload`, shut it down."""
    llm, startup = build_llm(args)
    facts = engine_facts(llm, startup)
    recorder = StepRecorder(llm)
    t0 = time.perf_counter()
    for warmup in warmups:
        tokenmill_generate(llm, recorder, warmup)
    warm_s = time.perf_counter() - t0
    if args.profile_offline_steps:
        recorder.profile_window = (args.profile_offline_first, args.profile_offline_steps)
    result = tokenmill_generate(llm, recorder, workload, progress_every=500)
    result.update(startup_s=startup, warmup_s=warm_s, engine=facts)
    print(f"tokenmill: {result['output_tokens']} output tokens in {result['elapsed_s']:.1f} s = "
          f"{result['output_tok_s']:.0f} tok/s ({result['num_steps']} steps, mean batch "
          f"{result['mean_batch_reqs']:.1f} requests / {result['mean_batch_tokens']:.0f} tokens)", flush=True)
    free_llm(llm)
    return result


# ----------------------------------------------------------------------------- transformers


def build_hf(args: argparse.Namespace) -> tuple[Any, str]:
    """(transformers model from --config with random weights, device), built on the device in --dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    cfg = AutoConfig.for_model(**json.loads(Path(args.config).read_text()))
    with torch.device(device):  # random init on the GPU: seconds, not minutes on the CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    return model.eval(), device


def hf_generate(model: Any, device: str, workload: Workload, batch_size: int, verbose: bool = True) -> dict[str, Any]:
    """transformers `generate` over `workload` in static, prompt-length-sorted, left-padded batches (greedy).

    Each batch generates exactly its largest requested output length
    (min_new_tokens = max_new_tokens); only each prompt's own request counts.

    Raises:
        RuntimeError: a batch came back shorter than asked (EOS was not suppressed).
    """
    import torch

    pad_id = 0  # masked out; any id works
    order = sorted(range(len(workload)), key=lambda i: len(workload[i][0]))
    counted = generated = 0
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        batch = [workload[i] for i in order[b:b + batch_size]]
        width, new = max(len(ids) for ids, _ in batch), max(n for _, n in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, (p, _) in enumerate(batch):  # left padding: new tokens follow each prompt's last token
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked for {new}.")
        counted += sum(n for _, n in batch)
        generated += len(batch) * new
        if verbose:
            print(f"  transformers batch {b // batch_size + 1}: {len(batch)} x (<= {width} in, {new} out); "
                  f"{counted} tokens counted after {time.perf_counter() - start:.1f} s", flush=True)
    elapsed = time.perf_counter() - start
    return {"num_prompts": len(workload), "input_tokens": sum(len(ids) for ids, _ in workload),
            "output_tokens": counted, "generated_tokens": generated, "elapsed_s": elapsed,
            "output_tok_s": counted / elapsed, "batch_size": batch_size}


def run_hf(args: argparse.Namespace, workload: Workload) -> dict[str, Any] | None:
    """Build, warm up and time transformers; None (with the error printed) if it fails, so tokenmill's numbers stay."""
    import torch

    try:
        if args.force_cc70:  # the same SDPA limits tokenmill applied for the simulated V100
            from tokenmill.platforms.cuda import apply_cc70_settings

            apply_cc70_settings((7, 0))
        t0 = time.perf_counter()
        model, device = build_hf(args)
        startup = time.perf_counter() - t0
        hf_generate(model, device, [(ids[:8], 4) for ids, _ in workload[:2]], batch_size=2, verbose=False)
        result = hf_generate(model, device, workload, args.hf_batch_size)
        result["startup_s"] = startup
        print(f"transformers: {result['output_tokens']} output tokens in {result['elapsed_s']:.1f} s = "
              f"{result['output_tok_s']:.0f} tok/s", flush=True)
        del model
        return result
    except Exception as exc:  # noqa: BLE001 - report and keep the tokenmill result
        import traceback

        traceback.print_exc()
        print(f"transformers baseline FAILED: {exc!r}", flush=True)
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- parts


def part_throughput(args: argparse.Namespace, vocab: int, report: dict[str, Any]) -> None:
    """--part offline / short: tokenmill on the whole workload, transformers on its subsample."""
    lens = (args.min_len, args.max_len) if args.part == "offline" else (args.short_len, args.short_len)
    workload = make_workload(args.num_prompts, lens, lens, vocab, args.seed)
    warmups = warmup_workloads(args.warmup_prompts, lens, args.max_model_len, vocab, args.seed + 1)
    report["workload"] = {"num_prompts": len(workload), "input_len": list(lens), "output_len": list(lens),
                          "warmup_prompts": sum(map(len, warmups)), "seed": args.seed}
    if not args.skip_tokenmill:
        report["tokenmill"] = run_tokenmill(args, workload, warmups)
    write_json(args.json_out, report)
    if args.hf_prompts > 0:
        sample = workload if args.hf_prompts >= len(workload) else subsample(workload, args.hf_prompts, args.seed + 2)
        report["hf"] = run_hf(args, sample)
        if report["hf"] and report.get("tokenmill"):
            report["ratio"] = report["tokenmill"]["output_tok_s"] / report["hf"]["output_tok_s"]


def part_prefill(args: argparse.Namespace, vocab: int, report: dict[str, Any]) -> None:
    """--part prefill: --num-prompts prompts of --prefill-len tokens, one output token each; prompt tokens per second.

    Issue 24's long-prompt prefill figure (16 x 32k). One warm-up prompt of the same length compiles the kernels
    first. The time is that of one `LLM.generate` over all prompts (chunked prefill by the engine's token budget).
    """
    workload = make_workload(args.num_prompts, (args.prefill_len,) * 2, (1, 1), vocab, args.seed)
    warmup = make_workload(1, (args.prefill_len,) * 2, (1, 1), vocab, args.seed + 1)
    report["workload"] = {"num_prompts": len(workload), "input_len": [args.prefill_len] * 2, "output_len": [1, 1],
                          "warmup_prompts": 1, "seed": args.seed}
    result = run_tokenmill(args, workload, [warmup])
    result["prompt_tok_s"] = result["input_tokens"] / result["elapsed_s"]
    print(f"prefill: {result['input_tokens']} prompt tokens in {result['elapsed_s']:.2f} s = "
          f"{result['prompt_tok_s']:.0f} prompt tok/s", flush=True)
    report["tokenmill"] = result


def part_tpot(args: argparse.Namespace, vocab: int, report: dict[str, Any]) -> None:
    """--part tpot: one request alone; TTFT, TPOT, execute_model span and GPU kernel time per decode step."""
    from tokenmill import SamplingParams
    from tokenmill.sampling_params import RequestOutputKind

    llm, startup = build_llm(args)
    facts = engine_facts(llm, startup)
    engine, recorder = llm.llm_engine, StepRecorder(llm)
    prompts = make_workload(4, (args.tpot_input,) * 2, (1, 1), vocab, args.seed)

    def one(rid: str, ids: list[int], n_out: int, profile_steps: int = 0) -> tuple[float, list[float], float | None]:
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        prof, kernel_us, stamps = None, None, []
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            if profile_steps and len(stamps) == 1 and prof is None and kernel_us is None:  # decode steps only
                prof = _start_profiler()
            outs = engine.step()
            now = time.perf_counter()
            stamps += [now for o in outs for _ in o.outputs[0].token_ids]
            if prof is not None and len(stamps) == 1 + profile_steps:
                kernel_us, prof = _stop_profiler(prof), None
        return t0, stamps, kernel_us

    one("warmup", prompts[0][0], args.tpot_output)
    recorder.reset(timing=True)
    t0, stamps, _ = one("tpot", prompts[1][0], args.tpot_output)
    spans = recorder.spans_ms()[-(len(stamps) - 1):] if len(stamps) > 1 else []  # the decode steps
    recorder.reset()
    gaps = np.diff(stamps) * 1e3
    n_prof = min(args.profile_steps, args.tpot_output - 1)
    _, _, kernel_us = one("profiled", prompts[2][0], 1 + n_prof, profile_steps=n_prof)
    kernel_ms = kernel_us / 1e3 / n_prof if kernel_us and n_prof else None
    # The first step (prefill + first token) of a fresh prompt under the profiler: its wall time, the GPU
    # time inside it and the kernels that took it (issue 24's TTFT breakdown).
    prof = _start_profiler()
    t_first, first_stamps, _ = one("ttft-profiled", prompts[3][0], 1)
    first_kernel_us = _stop_profiler(prof, top=12) if prof is not None else None
    if args.host_profile:
        _host_profile(lambda i: one(f"ttft-host-{i}", make_workload(1, (args.tpot_input,) * 2, (1, 1), vocab,
                                                                    args.seed + 100 + i)[0][0], 1))
    tpot = float(gaps.mean()) if len(gaps) else float("nan")
    report["tokenmill"] = {
        "prompt_tokens": args.tpot_input, "output_tokens": len(stamps), "requested_output_tokens": args.tpot_output,
        "startup_s": startup, "ttft_ms": (stamps[0] - t0) * 1e3, "tpot_ms": tpot,
        "tpot_p50_ms": float(np.median(gaps)) if len(gaps) else None, "tpot_max_ms": float(gaps.max()) if len(gaps) else None,
        "execute_model_ms": float(np.mean(spans)) if spans else None,
        "execute_model_timer": "cuda_events" if recorder.cuda else "perf_counter",
        "gpu_kernel_ms_per_decode_step": kernel_ms, "profiled_decode_steps": n_prof if kernel_ms else 0,
        "host_overhead_ms": tpot - kernel_ms if kernel_ms else None,
        "ttft_profiled_ms": (first_stamps[0] - t_first) * 1e3 if first_stamps else None,
        "ttft_gpu_kernel_ms": first_kernel_us / 1e3 if first_kernel_us else None, "engine": facts}
    # Finite logits (the cc-7.0 float16 path's overflow guard): the chosen tokens' logprobs of a short greedy run.
    check = llm.generate([{"prompt_token_ids": prompts[0][0]}],
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, logprobs=1),
                         use_tqdm=False)[0].outputs[0]
    finite = all(math.isfinite(lp[t].logprob) for t, lp in zip(check.token_ids, check.logprobs, strict=True))
    report["tokenmill"]["finite_logprobs"] = finite
    print(f"logprobs of {len(check.token_ids)} greedy tokens all finite: {finite}", flush=True)
    free_llm(llm)


def _host_profile(first_token: Any, fresh: int = 6) -> None:
    """--host-profile: TTFT of `fresh` new prompts (median; `first_token(i)` runs prompt i to its first token and
    returns (t0, stamps, _)), then one more under cProfile: where the host spends a prefill step (functions by
    own time and by cumulative time)."""
    import cProfile
    import io
    import pstats

    ttfts = sorted((stamps[0] - t0) * 1e3 for t0, stamps, _ in (first_token(i) for i in range(fresh)))
    print(f"TTFT of {fresh} fresh prompts, ms: median {ttfts[len(ttfts) // 2]:.1f}, all "
          + ", ".join(f"{t:.1f}" for t in ttfts), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    t0, stamps, _ = first_token(fresh)
    prof.disable()
    print(f"under cProfile: TTFT {(stamps[0] - t0) * 1e3:.1f} ms", flush=True)
    for key in ("tottime", "cumtime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(22)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print(f"host functions by {key}:", flush=True)
        print("\n".join(ln[:160] for ln in lines[start:]), flush=True)


def _start_profiler() -> Any | None:
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.start()
        return prof
    except Exception as exc:  # noqa: BLE001 - the profiler is optional; TPOT still counts
        print(f"torch.profiler unavailable: {exc!r}", flush=True)
        return None


def _stop_profiler(prof: Any, top: int = 0) -> float | None:
    """Summed duration (us) of the GPU activities (kernels, memcpy, memset) the profiler saw; None if none.
    top > 0 also prints the `top` activities by summed time (name, calls, us)."""
    import torch
    from torch.autograd import DeviceType

    try:
        torch.cuda.synchronize()
        prof.stop()
        gpu = [e for e in prof.events()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
        total = sum(e.time_range.elapsed_us() for e in gpu)
        if top and gpu:
            by_name: dict[str, list[float]] = {}
            for e in gpu:
                by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
            print(f"GPU activities: {total / 1e3:.2f} ms in {len(gpu)} launches; top {top}:", flush=True)
            for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
                print(f"  {sum(times) / 1e3:8.3f} ms {len(times):5d}x  {name[:110]}", flush=True)
            # The host side of the same window: operators by their own CPU time (where a TTFT far above its
            # GPU time goes: per-call library setup, synchronizations, Python).
            host = sorted((a for a in prof.key_averages() if a.self_cpu_time_total > 0),
                          key=lambda a: -a.self_cpu_time_total)[:top]
            print(f"host operators by self CPU time; top {top}:", flush=True)
            for a in host:
                print(f"  {a.self_cpu_time_total / 1e3:8.3f} ms {a.count:5d}x  {a.key[:110]}", flush=True)
        return float(total) if total > 0 else None
    except Exception as exc:  # noqa: BLE001
        print(f"torch.profiler failed: {exc!r}", flush=True)
        return None


# ----------------------------------------------------------------------------- reporting


def environment(commit: str | None = None) -> dict[str, Any]:
    """Versions, GPU name and the tokenmill commit (`commit`, else `git rev-parse HEAD`; None where unavailable)."""
    import torch

    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    env: dict[str, Any] = {"git_commit": commit or git("rev-parse", "HEAD"), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "gpu": None, "triton": None, "transformers": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    env["git_dirty"] = None if status is None else bool(status)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            pass
    return env


def write_json(path: str | None, report: dict[str, Any]) -> None:
    """Write `report` as JSON to `path` (nothing when None); called after each engine so a cut-off run keeps data."""
    if path:
        Path(path).write_text(json.dumps(report, indent=1))


def print_table(report: dict[str, Any]) -> None:
    """The part's markdown table (and the throughput ratio) on stdout."""
    tm, hf = report.get("tokenmill") or {}, report.get("hf")
    print(f"\n## {report['part']} ({Path(report['config']).name}, {report['args']['dtype']}, "
          f"{report['env']['gpu'] or 'cpu'}, commit {str(report['env']['git_commit'])[:10]})")
    if report["part"] == "tpot":
        print("| prompt | output | TTFT ms | TPOT ms | execute_model ms | GPU kernels ms/step | host overhead ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {tm['prompt_tokens']} | {tm['output_tokens']} | {tm['ttft_ms']:.1f} | {tm['tpot_ms']:.2f} | "
              f"{_fmt(tm['execute_model_ms'])} | {_fmt(tm['gpu_kernel_ms_per_decode_step'])} | "
              f"{_fmt(tm['host_overhead_ms'])} |")
        print(f"first step of a fresh {tm['prompt_tokens']}-token prompt under the profiler: "
              f"{_fmt(tm.get('ttft_profiled_ms'))} ms wall, {_fmt(tm.get('ttft_gpu_kernel_ms'))} ms of GPU activity")
        return
    if report["part"] == "prefill":
        print("| prompts | tokens each | seconds | prompt tok/s | steps |")
        print("|---:|---:|---:|---:|---:|")
        print(f"| {tm['num_prompts']} | {report['workload']['input_len'][0]} | {tm['elapsed_s']:.2f} | "
              f"{tm['prompt_tok_s']:.0f} | {tm['num_steps']} |")
        return
    print("| engine | prompts | output tokens | seconds | output tok/s | steps | mean batch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    if tm:
        print(f"| tokenmill | {tm['num_prompts']} | {tm['output_tokens']} | {tm['elapsed_s']:.1f} | "
              f"{tm['output_tok_s']:.0f} | {tm['num_steps']} | {tm['mean_batch_reqs']:.1f} |")
    if hf:
        print(f"| transformers (batch {hf['batch_size']}) | {hf['num_prompts']} | {hf['output_tokens']} | "
              f"{hf['elapsed_s']:.1f} | {hf['output_tok_s']:.0f} | | |")
    if report.get("ratio"):
        print(f"ratio tokenmill / transformers: {report['ratio']:.2f}x")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, with per-part defaults filled in (and TOKENMILL_FORCE_CC70=1 set under --force-cc70).

    Raises:
        SystemExit: a bad flag (argparse).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", required=True, choices=sorted(PART_DEFAULTS))
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="HF config.json of the model (dummy weights)")
    ap.add_argument("--num-prompts", type=int, default=None, help="offline 1000, short 256")
    ap.add_argument("--hf-prompts", type=int, default=None,
                    help="transformers prompts (0 = skip): offline 200 (a seeded subsample), short all; "
                         "0 under --force-cc70 unless given")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100, help="offline: shortest input/output length")
    ap.add_argument("--max-len", type=int, default=1024, help="offline: longest input/output length")
    ap.add_argument("--short-len", type=int, default=128, help="short: input and output length")
    ap.add_argument("--prefill-len", type=int, default=32768, help="prefill: tokens per prompt")
    ap.add_argument("--tpot-input", type=int, default=1024)
    ap.add_argument("--tpot-output", type=int, default=256)
    ap.add_argument("--profile-steps", type=int, default=16, help="tpot: decode steps under torch.profiler")
    ap.add_argument("--profile-offline-steps", type=int, default=0,
                    help="offline: profile this many steps from --profile-offline-first (kernel table; those steps run slower)")
    ap.add_argument("--profile-offline-first", type=int, default=1000,
                    help="offline: the first of the --profile-offline-steps steps (default 1000: the tail; ~200: full batches)")
    ap.add_argument("--host-profile", action="store_true",
                    help="tpot: TTFT of 6 fresh prompts, then one prefill step under cProfile (host functions)")
    ap.add_argument("--warmup-prompts", type=int, default=64, help="offline/short: prompts per warm-up generate (two of them)")
    ap.add_argument("--dtype", default=None, help="bfloat16 (float16 under --force-cc70)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None,
                    help="tokenmill's --quantization, e.g. fp8 on a 16-bit config (FP8 weights quantized at load)")
    ap.add_argument("--skip-tokenmill", action="store_true", help="offline/short: the transformers baseline only")
    ap.add_argument("--force-cc70", action="store_true", help="simulate a V100: env TOKENMILL_FORCE_CC70=1")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: the engine's (vLLM's: 1024 on a GPU of >= 70 GiB, 256 on smaller ones and CPU); "
                         "the offline figures in docs/benchmarks.md up to session 11 used 256")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-memory-bytes", default=None, help="explicit KV size, e.g. 64M (CPU smoke runs)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype), fp8, fp8_e4m3 or fp8_e5m2")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                    help="one KV group: full-length KV on sliding-window layers too (gpt-oss: capacity without the "
                         "window saving)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant before the engine is built (A/B of a kernel threshold); repeatable")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--git-commit", default=None, help="recorded commit when the copy has no .git (default: git)")
    args = ap.parse_args(argv)
    hf_asked = args.hf_prompts is not None
    for name, value in PART_DEFAULTS[args.part].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.hf_prompts is None:
        args.hf_prompts = args.num_prompts if args.part == "short" else 0
    if args.force_cc70:
        os.environ["TOKENMILL_FORCE_CC70"] = "1"  # read by tokenmill.platforms when the engine starts
        if not hf_asked:
            args.hf_prompts = 0
    if args.dtype is None:
        args.dtype = "float16" if args.force_cc70 else "bfloat16"
    if args.part == "prefill":
        args.max_model_len = max(args.max_model_len, args.prefill_len + 1)
    return args


def apply_overrides(items: list[str]) -> None:
    """--override MODULE.NAME=VALUE: set a module constant (a kernel threshold, say) before the engine is built.

    VALUE is a Python literal. For A/B runs of one setting without an env switch; the engine runs in this process
    (one GPU), so the worker sees the change. Raises ValueError for a malformed item or a name the module lacks.
    """
    import ast
    import importlib

    for item in items:
        target, sep, value = item.partition("=")
        mod_name, _, name = target.rpartition(".")
        if not sep or not mod_name:
            raise ValueError(f"--override {item!r}: expected MODULE.NAME=VALUE")
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, name):
            raise ValueError(f"--override {item!r}: {mod_name} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        print(f"override: {mod_name}.{name} = {getattr(mod, name)!r}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run one part; print its table; write --json-out. Returns the report (the JSON's content)."""
    args = parse_args(argv)
    apply_overrides(args.override)
    vocab = int(json.loads(Path(args.config).read_text())["vocab_size"])
    report: dict[str, Any] = {"part": args.part, "config": str(args.config), "args": vars(args), "env": environment(args.git_commit)}
    t0 = time.perf_counter()
    if args.part == "tpot":
        part_tpot(args, vocab, report)
    elif args.part == "prefill":
        part_prefill(args, vocab, report)
    else:
        part_throughput(args, vocab, report)
    report["wall_s"] = time.perf_counter() - t0
    write_json(args.json_out, report)
    print_table(report)
    return report


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
