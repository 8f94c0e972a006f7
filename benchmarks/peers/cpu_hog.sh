#!/usr/bin/env bash
# Issue 25: does a server's throughput degrade in proportion to the cores it loses? Runs run_peers.py at one
# concurrency for each peer twice, first alone, then with a CPU hog (a busy Python loop pinned to the last core)
# beside it, and prints output tok/s and median TPOT side by side with the ratio hog / alone. On this 2-core
# machine losing one core should cost about half, not 15x (docs/benchmarks.md, "CPU threads under a CPU hog").
#
# Usage (repository root, peers set up by setup_peers.sh):
#   TOKENMILL_PYTHON=.venv/bin/python bash benchmarks/peers/cpu_hog.sh
# Environment: PEERS (default tokenmill-bf16,vllm-cpu-bf16-allcpus), C (concurrency, default 64), PY (the python
# that runs run_peers.py, default .venv/bin/python), OUT (results folder, default /tmp/cpu-hog).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PEERS="${PEERS:-tokenmill-bf16,vllm-cpu-bf16-allcpus}"
C="${C:-64}"
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-/tmp/cpu-hog}"
LAST=$(( $(nproc) - 1 ))
HOG=""
trap '[ -n "$HOG" ] && kill "$HOG" 2>/dev/null || true' EXIT
for mode in alone hog; do
    if [ "$mode" = hog ]; then
        taskset -c "$LAST" "$PY" -c 'while 1: pass' &
        HOG=$!
        echo "[cpu_hog] hog pid $HOG on core $LAST"
    fi
    echo "[cpu_hog] $mode: load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$PY" benchmarks/peers/run_peers.py --peers "$PEERS" -c "$C" --force --results-dir "$OUT/$mode" \
        --doc "$OUT/$mode/peers.md"  # its report and plots stay beside the results, not in docs/
    if [ -n "$HOG" ]; then kill "$HOG"; HOG=""; fi
done
OUT="$OUT" PEERS="$PEERS" C="$C" "$PY" - <<'PYEOF'
import json, os
from pathlib import Path
out, c = Path(os.environ["OUT"]), os.environ["C"]
print(f"| peer | alone tok/s | with a hog tok/s | hog / alone | median TPOT ms (alone / hog) |")
print("|---|---:|---:|---:|---:|")
for peer in os.environ["PEERS"].split(","):
    r = {m: json.loads((out / m / f"{peer}-c{c}.json").read_text()) for m in ("alone", "hog")
         if (out / m / f"{peer}-c{c}.json").is_file()}
    if len(r) < 2:
        print(f"| {peer} | (missing) | | | |")
        continue
    a, h = r["alone"], r["hog"]
    print(f"| {peer} | {a['output_throughput']:.1f} | {h['output_throughput']:.1f} | "
          f"{h['output_throughput'] / a['output_throughput']:.2f} | {a['median_tpot_ms']:.1f} / {h['median_tpot_ms']:.1f} |")
PYEOF
