"""Per-step cost of structured output on a batch of 32 requests (SmolLM2's 49,152-token vocabulary).

Two measurements:

1. Grammar work alone (always): 32 live xgrammar matchers over varied JSON
   schemas and regexes; each step times the three pieces structured output
   adds to a step: the engine core's batched bitmask fill
   (`StructuredOutputManager.fill_bitmask`), the worker's mask application to
   [32, V] logits (`apply_grammar_bitmask`), and the matchers' advance
   (`accept_outputs`). Tokens come from random logits under the mask, so the
   grammars are walked through realistic states; a finished request is
   restarted (its grammar comes from the compile cache).
2. Whole engine steps (`--e2e`): the real model through `LLMEngine`, 32
   requests with max_tokens 48 at temperature 0, mean time per engine step
   without and with a JSON schema on every request.

    PYTHONPATH=. python benchmarks/structured_output_overhead.py [--steps 200] [--e2e]

Prints a Markdown table (paste into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from tokenmill.core.request import Request
from tokenmill.core.sched_output import CachedRequestData, SchedulerOutput
from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.backend import GrammarBackend
from tokenmill.structured_output.bitmask import apply_grammar_bitmask, grammar_rows
from tokenmill.structured_output.manager import StructuredOutputManager

BATCH = 32
VOCAB = 49152
EOS = 2


def _specs(n: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append({"regex": r"[A-Z][a-z]{2,10} \d{1,3}-\d{4}"})
            continue
        props = {"name": {"type": "string", "maxLength": 16},
                 "age": {"type": "integer", "minimum": 0, "maximum": 120},
                 "kind": {"type": "string", "enum": ["a", "b", "c", f"k{i}"]},
                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}
        if i % 2:
            props["address"] = {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": r"\d{5}"}},
                "required": ["city", "zip"]}
        out.append({"json": {"type": "object", "properties": props, "required": list(props)[: 2 + i % 3]}})
    return out


def _clock() -> np.ndarray:
    """[wall seconds, process CPU seconds] (CPU time counts every thread of this process)."""
    return np.array([time.perf_counter(), time.process_time()])


class _Scheduler:
    def finish_requests(self, ids: list[str], status: object) -> None:
        pass


def grammar_overhead(steps: int) -> dict[str, float]:
    """Mean/median ms per step of fill, apply and accept for BATCH live requests."""
    from tokenmill.model_loader.tokenizer import load_tokenizer
    from tokenmill.model_loader.source import bundled_gguf_path

    tok = load_tokenizer(bundled_gguf_path())
    t0 = time.perf_counter()
    backend = GrammarBackend(tok, VOCAB, [EOS])
    info_s = time.perf_counter() - t0
    cfg = SimpleNamespace(model_config=None, scheduler_config=SimpleNamespace(max_num_seqs=BATCH))
    mgr = StructuredOutputManager(cfg, backend_factory=lambda: backend)
    specs = _specs(BATCH)
    compile_ms = []
    for s in specs:  # cold compiles (each schema differs)
        t0 = time.perf_counter()
        backend.compile(_request("x", s)[1])
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    live: dict[str, int] = {}
    counter = 0

    def start(slot: int) -> str:
        nonlocal counter
        counter += 1
        rid = f"r{counter}"
        req, spec = _request(rid, specs[slot])
        mgr.submit(req, spec)
        live[rid] = slot
        return rid

    for slot in range(BATCH):
        start(slot)
    while mgr.has_pending():
        mgr.pop_ready(wait=True)
    gen = torch.Generator().manual_seed(0)
    fill, apply, accept = [], [], []
    sched = _Scheduler()
    for _ in range(steps):
        ids = list(live)
        so = SchedulerOutput([], CachedRequestData(), dict.fromkeys(ids, 1), len(ids))
        logits = torch.randn(len(ids), VOCAB, generator=gen) * 3
        t0 = _clock()
        mgr.fill_bitmask(so)
        t1 = _clock()
        rows = grammar_rows(so, ids, torch.device("cpu"))
        assert rows is not None
        apply_grammar_bitmask(logits, *rows)
        t2 = _clock()
        picked = logits.argmax(-1).tolist()
        outs = [EngineCoreOutput(r, [t], finish_reason=FinishReason.STOP if t == EOS else None)
                for r, t in zip(ids, picked)]
        t3 = _clock()
        mgr.accept_outputs(EngineCoreOutputs(outs), sched)
        t4 = _clock()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        accept.append(t4 - t3)
        for o in outs:
            if o.finish_reason is not None:
                slot = live.pop(o.request_id)
                mgr.abort([o.request_id])
                start(slot)
        while mgr.has_pending():
            mgr.pop_ready(wait=True)
    def ms(xs: list[np.ndarray]) -> tuple[float, float, float]:
        """(mean wall, median wall, median CPU) ms; CPU time (all threads) is what an idle machine would see."""
        wall, cpu = [x[0] for x in xs], [x[1] for x in xs]
        return 1e3 * statistics.mean(wall), 1e3 * statistics.median(wall), 1e3 * statistics.median(cpu)

    total = [a + b + c for a, b, c in zip(fill, apply, accept)]
    return {"tokenizer_info_s": info_s, "compile_ms_median": statistics.median(compile_ms),
            "compile_ms_max": max(compile_ms), "fill": ms(fill), "apply": ms(apply), "accept": ms(accept),
            "total": ms(total), "restarts": counter - BATCH}


def _request(rid: str, so: dict) -> tuple[Request, object]:
    params = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(**so))
    req = Request(EngineCoreRequest(rid, [1], params), 64)
    return req, StructuredOutputManager.spec_of(req)


def e2e_step_times() -> dict[str, float]:
    """Mean ms per LLMEngine.step() for BATCH requests, plain vs all under a JSON schema."""
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(max_model_len=512, kv_cache_memory_bytes="512M")
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(BATCH)]
    schema = _specs(1)[0]["json"]
    out = {}
    for label, so in (("plain", None), ("json_schema", StructuredOutputsParams(json=schema))):
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=so is None, structured_outputs=so)
            engine.add_request(f"{label}-{i}", p, params)
        steps, decode_times = 0, []
        core = engine.engine_core
        while engine.has_unfinished_requests():
            full = core.scheduler.get_num_unfinished_requests() == BATCH
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            steps += 1
            if steps > 3 and full:  # decode steps with the whole batch running (prefill skipped)
                decode_times.append(dt)
        out[label] = 1e3 * statistics.median(decode_times) if decode_times else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--e2e", action="store_true", help="also time real engine steps (loads the model)")
    args = ap.parse_args()
    # One torch thread, as docs/benchmarks.md's numbers were measured (then the server's core on 2 CPUs;
    # it now takes both, see core_proc.core_num_threads); 2 OpenMP threads beside the grammar
    # compile thread on a busy 2-core box spun for seconds.
    torch.set_num_threads(1)
    r = grammar_overhead(args.steps)
    print(f"tokenizer info (once per engine): {r['tokenizer_info_s']:.2f} s; cold compile per schema: "
          f"median {r['compile_ms_median']:.1f} ms, max {r['compile_ms_max']:.1f} ms; restarts: {r['restarts']}")
    print(f"\n| per step, batch {BATCH} | mean wall ms | median wall ms | median CPU ms |\n|---|---|---|---|")
    for key, label in (("fill", "bitmask fill (engine core, xgrammar batch)"),
                       ("apply", "mask apply to [32, 49152] logits (worker)"),
                       ("accept", "matcher advance (engine core)"), ("total", "total")):
        print(f"| {label} | {r[key][0]:.2f} | {r[key][1]:.2f} | {r[key][2]:.2f} |")
    if args.e2e:
        e = e2e_step_times()
        print(f"\n| engine decode step, batch {BATCH} | median ms |\n|---|---|")
        for k, v in e.items():
            print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
