"""CPU time per generated token of each process of a served run: engine core, API server, bench client.

Starts one tokenmill server the way `benchmarks/peers/run_peers.py` does for
a peer (default `tokenmill-gguf-q4_1`), sends one warm-up request, then runs
`tokenmill bench serve` (random 128-token prompts, 64 output tokens, EOS
ignored, greedy; the sweep's settings) as a subprocess `--repeat` times and
reads utime + stime of the three processes from /proc/<pid>/stat between the
bench's "Benchmarking" line and its result table. CPU seconds do not grow
while a process waits for a core, so the per-token figures move less with
the load of a shared machine than TPOT does.

    /work/main/.venv/bin/python benchmarks/serve_cpu_per_token.py -c 1 --repeat 3
    /work/main/.venv/bin/python benchmarks/serve_cpu_per_token.py --env TOKENMILL_CPU_ADAPTIVE_THREADS=0

One line per run: output tok/s, median TPOT, CPU ms per output token of the
engine core / API server / client, the 1-minute load at the start, and the
governor's "CPU threads a -> b" lines the server logged during the run.
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from peers import ALL_PEERS, MAX_MODEL_LEN, ROOT, TOKENMILL_PY  # noqa: E402
from run_peers import Server, free_port, sanity_answer  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> tuple[float, float]:
    """(utime, stime) of `pid` in seconds ((0.0, 0.0) once it has exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def thread_cpu_s(pid: int) -> dict[str, float]:
    """utime + stime seconds of each thread of `pid`, keyed "tid name"."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                head, tail = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = tail.split()
        out[f"{tid} {head.split('(', 1)[1]}"] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def busy_s() -> float:
    """Non-idle CPU seconds of the whole machine since boot (/proc/stat's first line)."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    return (sum(values) - values[3] - values[4]) / TICK


def engine_core_pid(server_pid: int) -> int:
    """The server's child with the most CPU time (the engine core; the other is multiprocessing's tracker)."""
    kids = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    return max((int(k) for k in kids), key=lambda k: sum(cpu_s(k)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", default="tokenmill-gguf-q4_1")
    p.add_argument("-c", "--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="bench runs against the one server")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
    p.add_argument("--profile-core", metavar="PATH", help="py-spy record the engine core during the first run "
                   "(.txt: collapsed stacks, else an SVG)")
    p.add_argument("--profile-api", metavar="PATH", help="the same for the API server process")
    p.add_argument("--py-spy", default="py-spy")
    p.add_argument("--core-threads", action="store_true", help="also the engine core's busiest threads")
    p.add_argument("--server-log", help="copy the server's log here at the end")
    args = p.parse_args()
    peer = ALL_PEERS[args.peer]
    port = free_port()
    env = {**peer.server_env(), **dict(kv.split("=", 1) for kv in args.env)}
    with tempfile.TemporaryDirectory(prefix="cpu_per_token_") as tmp:
        log = Path(tmp) / "server.log"
        server = Server(peer.server_argv(port, args.concurrency, MAX_MODEL_LEN), env, log)
        try:
            server.wait_ready()
            sanity_answer(port)  # warm-up
            core = engine_core_pid(server.proc.pid)
            print("before the runs: " + ("; ".join(ln.split("[core] ", 1)[-1] for ln in log.read_text().splitlines()
                                                  if "CPU threads" in ln) or "no thread change logged"), flush=True)
            for i in range(args.repeat):
                profile = {pid: path for pid, path in ((core, args.profile_core), (server.proc.pid, args.profile_api))
                           if path and i == 0}
                run_once(args, peer, port, server.proc.pid, core, log, Path(tmp), profile)
        finally:
            server.stop()
            if args.server_log:
                Path(args.server_log).write_text(log.read_text())


def run_once(args, peer, port: int, api: int, core: int, log: Path, tmp: Path, profile: dict[int, str]) -> None:
    result = tmp / "result.json"
    argv = [TOKENMILL_PY, "-m", "tokenmill.entrypoints.cli", "bench", "serve", "--base-url",
            f"http://127.0.0.1:{port}", "--model", "smollm2", "--tokenizer", peer.tokenizer(),
            "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0", "--save-result",
            "--result-dir", str(tmp), "--result-filename", result.name, "--disable-tqdm"]
    if extra := peer.extra_body():
        argv += ["--extra-body", extra]
    log_lines = len(log.read_text().splitlines())
    load = os.getloadavg()[0]
    client = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    start = end = None
    spies = []
    for line in client.stdout:
        if line.startswith("Benchmarking") and start is None:
            start = (time.monotonic(), cpu_s(core), cpu_s(api), cpu_s(client.pid), busy_s())
            core_threads = thread_cpu_s(core)
            spies = [subprocess.Popen([args.py_spy, "record", "-p", str(pid), "-o", path, "-r", "250", "--nonblocking",
                                       "--gil",
                                       "--format", "raw" if path.endswith(".txt") else "flamegraph"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for pid, path in profile.items()]
        elif "Serving Benchmark Result" in line and end is None:
            end = (time.monotonic(), cpu_s(core), cpu_s(api), cpu_s(client.pid), busy_s())
            core_threads = {k: v - core_threads.get(k, 0.0) for k, v in thread_cpu_s(core).items()}
            for spy in spies:
                spy.send_signal(2)
                spy.wait()
    client.wait()
    if start is None or end is None or client.returncode:
        raise SystemExit(f"bench failed (rc {client.returncode})")
    res = json.loads(result.read_text())
    tokens = res["total_output_tokens"]
    ms = [[1000 * (b[i] - a[i]) / tokens for i in (0, 1)] for a, b in zip(start[1:4], end[1:4])]  # [user, sys]
    wall = end[0] - start[0]
    # Cores the machine's other processes kept busy meanwhile (what the thread governor should react to).
    others = (end[4] - start[4] - sum(sum(b) - sum(a) for a, b in zip(start[1:4], end[1:4]))) / wall
    # "HH:MM:SS 2 -> 1 (others 1.0)" per thread change the governor logged during the run
    threads = [f"{ln.split()[2][:8]} {ln.split('CPU threads', 1)[1].split(':')[0].strip()} (others "
               f"{ln.split('kept ', 1)[1].split()[0]})"
               for ln in log.read_text().splitlines()[log_lines:] if "CPU threads" in ln]
    print(f"{res['output_throughput']:.1f} tok/s  TPOT median {res['median_tpot_ms']:.2f} ms  "
          "CPU ms/token (user+sys): " + "  ".join(f"{name} {u + s_:.2f} ({u:.2f}+{s_:.2f})" for name, (u, s_)
                                                    in zip(("core", "api", "client"), ms)) + "  "
          f"({tokens} tokens in {wall:.1f} s, load {load:.2f}, other processes {others:.2f} cores) "
          f"threads {threads or '-'}", flush=True)
    if args.core_threads:
        busiest = sorted(core_threads.items(), key=lambda kv: -kv[1])[:4]
        print("  engine core threads, CPU ms/token: " + ", ".join(f"{k} {1000 * v / tokens:.2f}" for k, v in busiest))


if __name__ == "__main__":
    main()
