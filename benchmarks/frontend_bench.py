"""The API server + front end under streaming load, with a synthetic engine core instead of a model (CPU).

    tokenmill bench serve --HTTP/SSE-->  tokenmill serve (this process tree)
                                         API server process: FastAPI/uvicorn, AsyncLLM,
                                         tokenize, OutputProcessor, SSE      <-- measured
                                            | zmq (the real EngineCoreClient / core_proc loop)
                                         core process: SyntheticCore (below)

`SyntheticCore` answers every running request with one token per step, each
step `--step-ms` after the previous one started (a fixed clock: a step never
waits for the front end), token ids uniform over the tokenizer's vocabulary,
finishing each request with LENGTH at its `max_tokens` (the bench sends
`ignore_eos`). Requests join at the next step, all of them (no prefill
cost, no batch limit). So the engine side is ideal and cheap, and whatever
falls short of it is the front end's (or the client's: it shares the CPUs).

The server is the real `tokenmill serve` (`cli.main(["serve", ...])`) in a
child process; the only substitution is the engine-core class, made by
wrapping `EngineCoreClient` in `tokenmill.frontend.async_llm` inside that
child (no hook in the package). The model folder is built in /tmp from
benchmarks/configs/llama-3.1-8b.json and the SmolLM2 tokenizer.

Reported per concurrency: the bench's output tok/s, against the synthetic
engine's ideal (the same requests list-scheduled onto `concurrency` slots at
one token per step: sum(output lens) / (makespan steps x step time)); ITL
p50/p99, TTFT p50/p99, TPOT p50; the core's mean running requests per step
during the run (below the concurrency: requests were in the front end); and
the CPU seconds of the API-server process, the core process and the bench
client during the measured run.

    python benchmarks/frontend_bench.py --tokenizer /work/main/.devcarry/serve-tok \\
        [--concurrency 512 64] [--num-prompts N] [--step-ms 25] [--py-spy /tmp/fe.speedscope.json]

The machine is usually shared: compare trees interleaved (A, B, A, B).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_CLASS = "frontend_bench:SyntheticCore"  # importable in the spawned core: this folder is on sys.path

# Read by SyntheticCore in the core process (inherited environment).
ENV_STEP_MS = "FRONTEND_BENCH_STEP_MS"
ENV_VOCAB = "FRONTEND_BENCH_VOCAB"
ENV_STATS = "FRONTEND_BENCH_STATS"  # JSON-lines file: one line per busy period


class SyntheticCore:
    """An engine core (the `core_proc` interface) that emits random tokens on a fixed clock.

    Env: FRONTEND_BENCH_STEP_MS (step period, ms), FRONTEND_BENCH_VOCAB (ids drawn in [0, vocab)),
    FRONTEND_BENCH_STATS (where each busy period's summary is appended as a JSON line).
    """

    def __init__(self, engine_config: object) -> None:
        from tokenmill.engine.messages import SchedulerStats

        self._stats_cls = SchedulerStats
        self.step_s = float(os.environ.get(ENV_STEP_MS, "25")) / 1000.0
        self.vocab = int(os.environ.get(ENV_VOCAB, "49152"))
        self.stats_path = os.environ.get(ENV_STATS)
        self.rng = random.Random(0)
        # request id -> [tokens left, first output still due]
        self.running: dict[str, list] = {}
        self.num_steps = 0
        self.max_running = 0
        self.next_step_at = 0.0
        self._reset_period()

    def _reset_period(self) -> None:
        self.p_steps = 0
        self.p_tokens = 0
        self.p_running_sum = 0
        self.p_late_s = 0.0
        self.p_start = 0.0

    def _flush_period(self) -> None:
        if self.p_steps and self.stats_path:
            wall = time.monotonic() - self.p_start
            row = {"steps": self.p_steps, "tokens": self.p_tokens, "wall_s": wall,
                   "mean_running": self.p_running_sum / self.p_steps, "late_s": self.p_late_s}
            with open(self.stats_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        self._reset_period()

    def add_request(self, request) -> None:
        self.running[request.request_id] = [int(request.sampling_params.max_tokens or 16), True]

    def abort_requests(self, request_ids: list[str], status: object = None) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)
        if not self.running:
            self._flush_period()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def get_stats(self):
        return self._stats_cls(num_running_reqs=len(self.running), max_num_running_reqs=self.max_running,
                               num_steps=self.num_steps)

    def step(self):
        from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason

        now = time.monotonic()
        if self.p_steps == 0:
            self.p_start = now
            self.next_step_at = now + self.step_s
        wait = self.next_step_at - now
        if wait > 0:
            time.sleep(wait)
        else:
            self.p_late_s -= wait
        self.next_step_at = max(self.next_step_at, now) + self.step_s
        n = len(self.running)
        self.num_steps += 1
        self.p_steps += 1
        self.p_running_sum += n
        self.p_tokens += n
        self.max_running = max(self.max_running, n)
        ts = time.time()
        outs = []
        randrange = self.rng.randrange
        for rid, slot in list(self.running.items()):
            slot[0] -= 1
            done = slot[0] <= 0
            outs.append(EngineCoreOutput(rid, [randrange(self.vocab)],
                                         finish_reason=FinishReason.LENGTH if done else None,
                                         scheduled_time=ts if slot[1] else None))
            slot[1] = False
            if done:
                del self.running[rid]
        if not self.running:
            self._flush_period()
        return EngineCoreOutputs(outs, ts, self.get_stats())


def _serve_child(argv: list[str]) -> int:
    """`tokenmill serve ARGV` with the engine core replaced by `SyntheticCore` (runs in the server process)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # so the spawned core can import CORE_CLASS
    import tokenmill.frontend.async_llm as async_llm
    from tokenmill.entrypoints.cli import main
    from tokenmill.frontend.core_client import EngineCoreClient

    class SyntheticCoreClient(EngineCoreClient):
        def __init__(self, engine_config, num_threads=None, core_class=None) -> None:
            super().__init__(engine_config, num_threads=1, core_class=CORE_CLASS)

    async_llm.EngineCoreClient = SyntheticCoreClient
    start = async_llm.AsyncLLM.start

    async def start_and_watch_the_loop(self, timeout_s=None) -> None:
        await start(self, timeout_s)
        import asyncio

        asyncio.get_running_loop().create_task(_watch_loop_lag())

    async_llm.AsyncLLM.start = start_and_watch_the_loop
    return main(["serve", *argv])


async def _watch_loop_lag(period_s: float = 0.01, report_s: float = 10.0) -> None:
    """Log (server log) how late a `period_s` sleep wakes up: the event loop's stalls, p50 / p99 / max in ms."""
    import asyncio
    import logging

    log = logging.getLogger("frontend_bench")
    lags: list[float] = []
    last_report = time.monotonic()
    while True:
        t0 = time.monotonic()
        await asyncio.sleep(period_s)
        now = time.monotonic()
        lags.append(now - t0 - period_s)
        if now - last_report >= report_s:
            lags.sort()
            log.warning("event-loop lag ms: p50 %.1f p99 %.1f max %.1f (%d samples)", 1e3 * lags[len(lags) // 2],
                        1e3 * lags[int(len(lags) * 0.99)], 1e3 * lags[-1], len(lags))
            lags.clear()
            last_report = now


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(t) for t in text)
    return out


def ideal_steps(output_lens: list[int], concurrency: int) -> int:
    """Steps the synthetic engine takes with a perfect front end: requests in order onto `concurrency`
    slots, one token per step each (a request's L tokens take L steps). Ideal output tok/s =
    sum(output_lens) / (steps x step time); ideal mean running requests per step = sum(output_lens) / steps."""
    slots = [0] * min(concurrency, len(output_lens))
    heapq.heapify(slots)
    end = 0
    for n in output_lens:
        t = heapq.heappop(slots) + n
        end = max(end, t)
        heapq.heappush(slots, t)
    return end


def _make_model_dir(tokenizer_dir: Path) -> Path:
    model = Path(tempfile.mkdtemp(prefix="frontend-bench-model-"))
    shutil.copy(ROOT / "benchmarks/configs/llama-3.1-8b.json", model / "config.json")
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, model / f.name)
    return model


def _vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()


def _bench(port: int, model: Path, concurrency: int, num_prompts: int, args: argparse.Namespace,
           result: Path | None) -> str:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", str(model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
           "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--disable-tqdm"]
    if result is not None:
        cmd += ["--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def _last_period(stats: Path) -> dict:
    rows = [json.loads(line) for line in stats.read_text().splitlines() if line.strip()] if stats.exists() else []
    return max(rows, key=lambda r: r["tokens"]) if rows else {}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        return _serve_child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", type=Path, default=ROOT / ".devcarry/serve-tok",
                   help="folder with the SmolLM2 tokenizer.json (benchmarks/peers/gpu_carry.sh saves it)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[512, 64])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per measured run (default: 1000 at concurrency >= 512, else 4 x concurrency)")
    p.add_argument("--warmup-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=562)
    p.add_argument("--output-len", type=int, default=562)
    p.add_argument("--range-ratio", type=float, default=0.822)
    p.add_argument("--step-ms", type=float, default=25.0)
    p.add_argument("--py-spy", type=Path, default=None,
                   help="record the API server with py-spy (speedscope JSON) during the first measured run")
    args = p.parse_args()
    if not (args.tokenizer / "tokenizer.json").is_file():
        p.error(f"no tokenizer.json in {args.tokenizer}; pass --tokenizer DIR")
    model = _make_model_dir(args.tokenizer)
    work = Path(tempfile.mkdtemp(prefix="frontend-bench-"))
    stats = work / "core.jsonl"
    env = {**os.environ, ENV_STEP_MS: str(args.step_ms), ENV_VOCAB: str(_vocab_size(args.tokenizer)),
           ENV_STATS: str(stats), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    port = _free_port()
    log = open(work / "server.log", "w")
    server = subprocess.Popen([sys.executable, __file__, "_serve", str(model), "--load-format", "dummy",
                               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096",
                               "--served-model-name", "m", "--disable-uvicorn-access-log"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{(work / 'server.log').read_text()[-3000:]}")
                time.sleep(0.5)
        core_pids = _children(server.pid)
        print(f"[frontend_bench] step {args.step_ms:g} ms, server pid {server.pid}, core pids {core_pids}, "
              f"log {work / 'server.log'}", flush=True)
        for i, c in enumerate(args.concurrency):
            if args.warmup_prompts:
                _bench(port, model, c, args.warmup_prompts, args, None)
            stats.unlink(missing_ok=True)
            result = work / f"c{c}.json"
            cpu0 = _cpu_s(server.pid)
            core0 = sum(_cpu_s(q) for q in core_pids)
            spy = None
            if args.py_spy is not None and i == 0:
                exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                spy = subprocess.Popen([exe, "record", "--nonblocking", "--pid", str(server.pid), "--rate", "100",
                                        "--format", "speedscope", "-o", str(args.py_spy)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ru0 = os.times()
            t0 = time.monotonic()
            num_prompts = args.num_prompts or (1000 if c >= 512 else 4 * c)
            _bench(port, model, c, num_prompts, args, result)
            wall = time.monotonic() - t0
            ru1 = os.times()
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(60)
            server_cpu = _cpu_s(server.pid) - cpu0
            core_cpu = sum(_cpu_s(q) for q in core_pids) - core0
            client_cpu = (ru1.children_user + ru1.children_system) - (ru0.children_user + ru0.children_system)
            r = json.loads(result.read_text())
            lens = [n for n in r["output_lens"] if n]
            steps = ideal_steps(lens, c)
            ideal = sum(lens) / (steps * args.step_ms / 1000)
            period = _last_period(stats)
            print(f"concurrency {c}: output {r['output_throughput']:.0f} tok/s of ideal {ideal:.0f} "
                  f"({100 * r['output_throughput'] / ideal:.1f}%); ITL p50 {r['p50_itl_ms']:.1f} p99 "
                  f"{r['p99_itl_ms']:.1f} ms; TTFT p50 {r['p50_ttft_ms']:.0f} p99 {r['p99_ttft_ms']:.0f} ms; "
                  f"TPOT p50 {r['p50_tpot_ms']:.1f} ms; core mean running {period.get('mean_running', 0):.0f} "
                  f"(ideal {sum(lens) / steps:.0f}), "
                  f"late {period.get('late_s', 0):.1f} s; CPU s: API server {server_cpu:.1f}, core {core_cpu:.1f}, "
                  f"client {client_cpu:.1f} (wall {wall:.1f} s; {r['completed']} done)", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(model, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
