#!/usr/bin/env bash
# Issue 24's server target on one GPU: `tokenmill serve` with dummy weights from a config in benchmarks/configs/,
# measured by `tokenmill bench serve` on the offline benchmark's workload (1000 prompts, input and output
# lengths uniform in about [100, 1024]: random-input-len 562, range ratio 0.822, EOS ignored) at max
# concurrency 512, after a warm-up run of 64 prompts. Prints the bench's report (throughput, TTFT, TPOT, ITL
# percentiles 50/90/99) and writes its JSON to $OUT (or /tmp/serve-bench).
#
# The model directory is built in /tmp from the config and the SmolLM2 tokenizer (carried in
# .devcarry/serve-tok by benchmarks/peers/gpu_carry.sh), its BPE vocabulary padded to the config's vocab_size with
# entries "<xN>" that no merge produces (so prompts tokenize as before) and that decode to text. Without the
# padding, ids past the tokenizer's 49,152 entries decode to nothing, their stream chunks carry no text, and the
# bench (which times text-carrying chunks, as vLLM's does) measured ITL over ~2.6 tokens per gap (session 12,
# visit 1).
#
# Usage, on the GPU machine, in the repository root (carry `.devcarry`):
#   bash benchmarks/peers/gpu_carry.sh            # here, once, with network
#   bash benchmarks/gpu/serve_bench.sh [CONFIG] [-- extra `tokenmill serve` flags]
# Environment: PYTHON (python3), CONCURRENCY (512), NUM_PROMPTS (1000), LABEL (tokenmill), DRY=1 (a CPU check:
# 8 prompts of 16-64 tokens, concurrency 4, no warm-up).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
CONFIG="benchmarks/configs/llama-3.1-8b.json"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then CONFIG=$1; shift; fi
[ "${1:-}" = "--" ] && shift
EXTRA=("$@")
TOK="$ROOT/.devcarry/serve-tok"
[ -f "$TOK/tokenizer.json" ] || { echo "no $TOK/tokenizer.json: run benchmarks/peers/gpu_carry.sh here first" >&2; exit 1; }
RES="${OUT:-/tmp/serve-bench}"
mkdir -p "$RES"
C="${CONCURRENCY:-512}"
N="${NUM_PROMPTS:-1000}"
LEN=562; RATIO=0.822; WARM=64
if [ "${DRY:-0}" = 1 ]; then C=4; N=8; LEN=40; RATIO=0.6; WARM=0; fi
NAME="$(basename "$CONFIG" .json)"
MODEL="/tmp/serve-model/$NAME"
mkdir -p "$MODEL"
cp "$CONFIG" "$MODEL/config.json"
cp "$TOK"/* "$MODEL/"
"$PY" - "$MODEL" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
vocab_size = json.loads((d / "config.json").read_text())["vocab_size"]
tok = json.loads((d / "tokenizer.json").read_text())
vocab = tok["model"]["vocab"]
taken = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
for i in range(vocab_size):
    if i not in taken:
        vocab[f"<x{i}>"] = i
(d / "tokenizer.json").write_text(json.dumps(tok))
print(f"[serve_bench] tokenizer padded to {len(vocab) + len(tok['added_tokens'])} ids (config vocab {vocab_size})")
PYEOF

# Serving packages the GPU image lacks, from the carried wheels.
if ! "$PY" -c "import fastapi, uvicorn, zmq, msgspec, pydantic" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$ROOT"/.devcarry/gpu-peer/wheels/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG="$RES/serve-$NAME.log"
setsid "$PY" -m tokenmill.entrypoints.cli serve "$MODEL" --load-format dummy --host 127.0.0.1 --port "$PORT" \
    --max-model-len 4096 --served-model-name m --disable-uvicorn-access-log "${EXTRA[@]}" > "$LOG" 2>&1 &
PID=$!
trap 'kill -INT -- "-$PID" 2>/dev/null; sleep 5; kill -KILL -- "-$PID" 2>/dev/null || true' EXIT
t=0
until "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/v1/models', timeout=5)" 2>/dev/null; do
    kill -0 "$PID" 2>/dev/null || { echo "server exited:" >&2; tail -30 "$LOG" >&2; exit 1; }
    sleep 1; t=$((t + 1)); [ $t -lt 600 ] || { echo "not ready after 600 s" >&2; exit 1; }
done
echo "[serve_bench] ready after ~${t} s: $(grep -E 'KV cache:|Captured' "$LOG" | tail -2 | cut -c1-200)"

bench() {  # bench NUM_PROMPTS SAVE(0/1)
    local save=()
    [ "$2" = 1 ] && save=(--save-result --result-dir "$RES" --result-filename "serve-$NAME-c$C.json")
    "$PY" -m tokenmill.entrypoints.cli bench serve --base-url "http://127.0.0.1:$PORT" --model m \
        --tokenizer "$MODEL" --dataset-name random --random-input-len "$LEN" --random-output-len "$LEN" \
        --random-range-ratio "$RATIO" --num-prompts "$1" --max-concurrency "$C" --request-rate inf --ignore-eos \
        --temperature 0 --seed 0 --label "${LABEL:-tokenmill}" --percentile-metrics ttft,tpot,itl,e2el \
        --metric-percentiles 50,90,99 --disable-tqdm "${save[@]}"
}
[ "$WARM" -gt 0 ] && bench "$WARM" 0 > "$RES/serve-$NAME-warmup.log" 2>&1
bench "$N" 1 2>&1 | tee "$RES/serve-$NAME-bench.log" | { grep -vE "^(Mean|P50) " || true; }
rc=${PIPESTATUS[0]}
grep -E "preempt|ERROR|Traceback" "$LOG" | tail -5 || true
exit "$rc"
