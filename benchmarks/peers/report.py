"""Markdown report of a peers sweep: one table per concurrency, plots, versions, exact commands.

`write_report(args)` reads the result files that run_peers.py saved, draws
the PNG plots with `tokenmill bench plot`, and replaces the section headed
SECTION in `args.doc` (creating the file or the section when absent; other
sections are left as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
from pathlib import Path

from peers import ALL_PEERS, BASELINE, ROOT, TOKENMILL_PY, VENVS, rel

SECTION = "## Peers on this CPU machine (issue: bench)"
TOKENMILL = "tokenmill"  # what `python -m tokenmill.entrypoints.cli` is printed as
PLOTS = {"fp32": ("tokenmill-fp32", "vllm-cpu-fp32", "llamacpp-q4_1", "llamaserver-q4_1", "transformers-fp32"),
         "bf16": ("tokenmill-bf16", "vllm-cpu-bf16", "llamaserver-q4_1")}


def _capture(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "not installed"


def _pkg_versions(python: Path | str, names: tuple[str, ...]) -> str:
    code = ("import importlib.metadata as m\nfor n in %r:\n    try: print(f'{n} {m.version(n)}')\n"
            "    except m.PackageNotFoundError: pass" % (names,))
    return ", ".join(_capture([str(python), "-c", code]).splitlines()) if Path(python).exists() else "not installed"


def versions() -> list[str]:
    """One line per engine and one for the machine."""
    commit = _capture(["git", "rev-parse", "--short", "HEAD"])
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    return [
        f"machine: {os.cpu_count()} cores ({cpu}), Linux; every peer and the load generator share these cores",
        f"tokenmill: commit {commit} when this report was written (the commit each tokenmill peer ran is "
        f"under Sanity); {_pkg_versions(TOKENMILL_PY, ('torch', 'transformers'))}",
        f"vLLM CPU: {_pkg_versions(VENVS / 'vllm' / 'bin' / 'python', ('vllm-cpu', 'vllm', 'torch', 'transformers'))}",
        f"llama.cpp: {_pkg_versions(VENVS / 'llamacpp' / 'bin' / 'python', ('llama_cpp_python',))} "
        "(its vendored llama.cpp, built here for this CPU: GGML_NATIVE=ON minus AMX, whose Q4_1 kernel dies with "
        "SIGILL on this VM; llama-server from the same source and flags)",
        f"transformers floor: {_pkg_versions(VENVS / 'hf' / 'bin' / 'python', ('transformers', 'torch'))}",
    ]


def load(results_dir: Path, peer: str, concurrency: int) -> dict | None:
    path = results_dir / f"{peer}-c{concurrency}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: object, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def _command(entry: dict) -> list[str]:
    """Exact shell lines for one measured row."""
    if "offline" in entry:
        bench = entry["prompts_from"]
        return [f"# prompts: those of `{TOKENMILL} {shlex.join(bench[:2])} ... --seed "
                f"{bench[bench.index('--seed') + 1]}`, written as JSONL by run_peers.py",
                shlex.join(entry["offline"])]
    server = entry["server"]
    if server[:3] == [TOKENMILL_PY, "-m", "tokenmill.entrypoints.cli"]:
        server = [TOKENMILL, *server[3:]]
    env = {k: ("." if v == str(ROOT) else v) for k, v in entry["env"].items()}
    prefix = " ".join(f"{k}={v}" for k, v in env.items() if k != "PYTHONPATH")
    return [(prefix + " " if prefix else "") + shlex.join(server) + " &", f"{TOKENMILL} {shlex.join(entry['bench'])}"]


def table(results_dir: Path, concurrency: int, peers: list[str], expected_out: int,
          meta: dict) -> list[str]:
    rows = ["| peer | weights / compute dtype | output tok/s | total tok/s | req/s | median TTFT ms | "
            "median TPOT ms | output tokens (expected) | failed | output tok/s ratio | load at start |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name in peers:
        r = load(results_dir, name, concurrency)
        if r is None:
            continue
        peer = ALL_PEERS[name]
        base = load(results_dir, BASELINE.get(name, ""), concurrency)
        ratio = (f"{r['output_throughput'] / base['output_throughput']:.2f}x {BASELINE[name]}"
                 if base and base.get("output_throughput") else "")
        failed = r.get("num_prompts", 0) - r.get("completed", 0)
        rows.append(f"| {name} | {peer.weights}; {peer.dtype} | {_fmt(r.get('output_throughput'))} | "
                    f"{_fmt(r.get('total_token_throughput'))} | {_fmt(r.get('request_throughput'), '.2f')} | "
                    f"{_fmt(r.get('median_ttft_ms'), '.0f')} | {_fmt(r.get('median_tpot_ms'), '.1f')} | "
                    f"{r.get('total_output_tokens')} ({expected_out * r.get('num_prompts', 0)}) | {failed} | {ratio} | "
                    f"{meta.get(name, {}).get(f'load_c{concurrency}', '—')} |")
    return rows


def plots(args: argparse.Namespace, img_dir: Path) -> list[Path]:
    out = []
    for tag, names in PLOTS.items():
        files = [str(p) for n in names for p in sorted(args.results_dir.glob(f"{n}-c*.json"))]
        if not files:
            continue
        png = img_dir / f"peers-{tag}.png"
        argv = [TOKENMILL_PY, "-m", "tokenmill.entrypoints.cli", "bench", "plot", *files, "-o", str(png),
                "--title", f"SmolLM2-135M on {os.cpu_count()} CPU cores ({tag} peers)"]
        if subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode == 0:
            out.append(png)
    return out


def headline(results_dir: Path, top: int) -> list[str]:
    lines = []
    for ours, theirs in (("tokenmill-fp32", "vllm-cpu-fp32"), ("tokenmill-bf16", "vllm-cpu-bf16"),
                         ("tokenmill-fp32", "llamaserver-q4_1"), ("tokenmill-fp32", "llamacpp-q4_1")):
        a, b = load(results_dir, ours, top), load(results_dir, theirs, top)
        if a and b:
            ratio = a["output_throughput"] / b["output_throughput"]
            lines.append(f"- concurrency {top}: {ours} {a['output_throughput']:.1f} output tok/s vs {theirs} "
                         f"{b['output_throughput']:.1f}: **{ratio:.2f}x**")
    return lines


def prompts_text(args: argparse.Namespace) -> str:
    """How many prompts each run sent, e.g. `prompts per run (concurrency: count) 1: 4, 4: 8, ...`."""
    counts = ", ".join(f"{c}: {n}" for c, n in args.prompt_counts.items())
    per_slot = min((n // c for c, n in args.prompt_counts.items()), default=0)
    return (f"prompts per run (concurrency: prompts) {counts}, i.e. at least {per_slot} per slot, "
            "the same prompts for every peer (sized so that the whole sweep fits a ~35-minute quiet window on "
            "this machine; benchmarks/peers/README.md says how)")


def section(args: argparse.Namespace) -> str:
    doc_dir = args.doc.parent
    img_dir = doc_dir / "img" if doc_dir == ROOT / "docs" else doc_dir
    pngs = plots(args, img_dir)
    meta_path = args.results_dir / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    commands_path = args.results_dir / "commands.json"
    commands = json.loads(commands_path.read_text()) if commands_path.is_file() else {}
    names = [p.name for p in args.peer_list] if not args.report_only else list(ALL_PEERS)
    names = [n for n in ALL_PEERS if n in names or any(args.results_dir.glob(f"{n}-c*.json"))]
    quick = " (QUICK smoke-test lengths, not the real sweep)" if args.quick else ""
    out = [SECTION, "", *([f"> {args.note}", ""] if args.note else []),
           f"Written by `benchmarks/peers/run_peers.py`{quick}. Same model everywhere: SmolLM2-135M-Instruct, "
           "the bundled Q4_1 GGUF for llama.cpp and, for the others, an HF-format copy made from it "
           "(`benchmarks/peers/convert_gguf.py`: dequantized to float32, so all peers hold the same weights). "
           f"Random prompts of {args.input_len} tokens, {args.output_len} output tokens each with EOS ignored "
           "(llama-cpp-python has no `ignore_eos`: EOS ids get logit bias -100), greedy, seed "
           f"{args.seed}, `--request-rate inf`, {prompts_text(args)}. "
           "llama.cpp reads 4-bit weights, so it is a reference, not a like-for-like target. "
           "The transformers floor is offline `generate` in static batches of size = concurrency "
           "(no TTFT/TPOT; a batch's requests all wait for it). llama-cpp-python's server has no parallel "
           "slots (one request at a time behind a lock; `--interrupt_requests False` so a new request does not "
           "cut the streaming one short); `llamaserver-q4_1` is llama.cpp's own `llama-server` (the server "
           "Ollama's runner is built on) compiled from the source llama-cpp-python vendors, with "
           "`-np` = concurrency slots of 1024 tokens each. vLLM CPU runs with its defaults "
           "(`VLLM_CPU_OMP_THREADS_BIND=auto`: on 2 cores it binds its model worker to core 0 and reserves core 1 "
           "for the API server and scheduler; tokenmill's engine core takes both cores, 2 torch threads, "
           "and its API server shares them: tokenmill reserves a core for the front end only from 8 CPUs on, "
           "`core_num_threads` in tokenmill/engine/core_proc.py; `VLLM_USE_AOT_COMPILE=0` only picks the compile "
           "cache that vLLM 0.32 can load again on CPU, so a start takes ~1-2 min instead of recompiling). "
           "The opt-in row `vllm-cpu-bf16-allcpus`, where present, is vLLM CPU with "
           "`VLLM_CPU_NUM_OF_RESERVED_CPU=0`: no core reserved, its worker runs 2 threads as tokenmill's core does. "
           "\"load at start\" is the machine's 1-minute load "
           "average when the run began: above ~2 (the core count) other work shared the cores and the row "
           "understates that peer.", "",
           "Reproduce everything: `bash benchmarks/peers/setup_peers.sh && "
           "/tmp/venv/bin/python benchmarks/peers/run_peers.py" + (" --quick" if args.quick else "") + "`. "
           f"Below, `{TOKENMILL}` is `PYTHONPATH=. /tmp/venv/bin/python -m tokenmill.entrypoints.cli` "
           "run from the repository root; each server command runs until its benchmarks end.", "",
           "### Versions", "", *[f"- {v}" for v in versions()], ""]
    if hl := headline(args.results_dir, max(args.conc_list)):
        out += ["### Headline (targets: tokenmill >= 1.0x vLLM CPU in the same dtype at the top concurrency)", "",
                *hl, ""]
    if meta:
        out += ["### Sanity: greedy answer to \"What is the capital of France?\" (chat, 16 tokens)", "",
                "llama.cpp may answer otherwise: in float32 the first token's two best candidates, 'The' and "
                "'L', are 0.08 log-prob apart, and llama.cpp's 8-bit activations (Q4_1 x Q8_1 dot products) "
                "are enough to swap them.", ""]
        out += [f"- {n}: {m.get('answer', '—')!r}" + (f" (tokenmill commit {m['commit']})"
                                                     if n.startswith("tokenmill") and m.get("commit") else "")
                + (f" — ERROR: {m['error']}" if m.get("error") else "")
                for n, m in meta.items() if "answer" in m or "error" in m]
        out.append("")
    for png in pngs:
        out += [f"![{png.stem}]({os.path.relpath(png, doc_dir)})", ""]
    for c in args.conc_list:
        out += [f"### Concurrency {c}", "", *table(args.results_dir, c, names, args.output_len, meta), "",
                "Commands:", "", "```sh"]
        for n in names:
            if entry := commands.get(f"{n}-c{c}"):
                out += [f"# {n}", *_command(entry)]
        out += ["```", ""]
    return "\n".join(out)


def write_report(args: argparse.Namespace) -> Path:
    """Replace (or add) SECTION in `args.doc`; return its path."""
    text = args.doc.read_text() if args.doc.is_file() else "# Benchmarks\n"
    lines = text.splitlines()
    new = section(args).splitlines()
    if SECTION in lines:
        start = lines.index(SECTION)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = new + ([""] if end < len(lines) else [])
    else:
        lines += ["", *new]
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.doc}")
    return args.doc
