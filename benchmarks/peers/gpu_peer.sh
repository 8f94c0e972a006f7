#!/usr/bin/env bash
# tokenmill vs llama.cpp's llama-server (Ollama's engine) on one GPU, one GGUF file both load: a
# Llama-3.1-8B-shaped model with random float16 weights (make_random_gguf.py, generated there), served
# by each engine in turn and measured by `tokenmill bench serve` at concurrency 1, 16, 64, 256
# (random prompts of 128 tokens, 128 output tokens with EOS ignored, 2 prompts per slot, at least 8).
# Prints one table (output tok/s, median TTFT, median TPOT, tokenmill / llama.cpp) and writes it to
# RESULTS/table.md, the per-run JSON beside it.
#
# Before (on a machine with network, in the repository root): bash benchmarks/peers/gpu_carry.sh
# (wheels, trimmed llama.cpp source, SmolLM2 vocabulary into .devcarry/gpu-peer/; carry `.devcarry`).
#
# Usage, on the GPU machine, in the repository root:
#   bash benchmarks/peers/gpu_peer.sh [build] [gguf] [llamaserver] [tokenmill] [report]   (none: all five)
# Phases, each resumable (a built binary, the GGUF and result files that exist are kept):
#   build        llama-server with CUDA for sm_90 (build_llama_server.sh --cuda, all cores): several minutes
#   gguf         the 16 GB random GGUF into $GPU_PEER_WORK (about a minute)
#   llamaserver  one llama-server per concurrency (-np C parallel slots, continuous batching, all layers on
#                the GPU, flash attention on auto: as a user would start it), bench at each concurrency
#   tokenmill    one `tokenmill serve` for all concurrencies (--max-num-seqs 256), bench at each
#   report       the table
# The device tool's calls last at most 10 minutes and a machine stays warm ~30 s after a call, so run
# `build`, then `gguf llamaserver`, then `tokenmill report` as three calls in quick succession (a cold
# machine starts bare: build and gguf again).  Results also go to $OUT when it is set.
#
# Environment: PYTHON (default python3), GPU_PEER_WORK (default /tmp/gpu-peer: the GGUF and logs),
# RESULTS_DIR (default benchmarks/peers/results-gpu), CONCURRENCY (default 1,16,64,256), INPUT_LEN,
# OUTPUT_LEN (default 128 each), TM_DTYPE (tokenmill --dtype, default bfloat16; the file is float16),
# FORCE=1 (measure again even where a result exists); for a dry run on a CPU machine: GGUF_SHAPE=tiny
# (make_random_gguf.py's 2-layer shape), LLAMA_SERVER (a CPU build's binary), CONCURRENCY=1,4.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
CARRY="$ROOT/.devcarry/gpu-peer"
PY="${PYTHON:-python3}"
WORK="${GPU_PEER_WORK:-/tmp/gpu-peer}"
RESULTS="${RESULTS_DIR:-$HERE/results-gpu}"
CONC="${CONCURRENCY:-1,16,64,256}"
IN="${INPUT_LEN:-128}"
OUTLEN="${OUTPUT_LEN:-128}"
TM_DTYPE="${TM_DTYPE:-bfloat16}"
SHAPE="${GGUF_SHAPE:-llama-3.1-8b}"
GGUF="$WORK/$SHAPE-random-f16.gguf"
LLAMA_SERVER="${LLAMA_SERVER:-$ROOT/.build/llama-server-cuda/bin/llama-server}"
SLOT_CTX=$(( (IN + OUTLEN + 64 + 255) / 256 * 256 ))  # context per llama.cpp slot / tokenmill max-model-len
MODEL_NAME=llama-3.1-8b-random
mkdir -p "$WORK" "$RESULTS/logs"
log() { echo "[gpu_peer $(date +%H:%M:%S)] $*"; }

# Serving packages the GPU image lacks, from the carried wheels.
if ! "$PY" -c "import fastapi, uvicorn, zmq, msgspec, gguf, pydantic" 2>/dev/null; then
    ls "$CARRY"/wheels/*.whl >/dev/null 2>&1 || { echo "no wheels in $CARRY/wheels: run gpu_carry.sh here first" >&2; exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/wheels/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

phase_build() {
    if [ -x "$LLAMA_SERVER" ]; then log "llama-server built: $LLAMA_SERVER"; return; fi
    log "building llama-server (CUDA, sm_90) with $(nproc) jobs"
    PYTHON="$PY" JOBS="$(nproc)" bash "$HERE/build_llama_server.sh" --cuda --src "$CARRY/llama.cpp.tar.gz" \
        --out "$ROOT/.build/llama-server-cuda"
}

phase_gguf() {
    if [ -f "$GGUF" ]; then log "GGUF exists: $GGUF"; return; fi
    "$PY" "$HERE/make_random_gguf.py" --shape "$SHAPE" --vocab-from "$CARRY/smollm2-vocab.json.gz" \
        --out "$GGUF.part"
    mv "$GGUF.part" "$GGUF"
}

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_ready() {  # wait_ready PORT PID LOG: until /v1/models answers (15 min at most), then one greedy answer
    local t=0
    until "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/v1/models', timeout=5)" 2>/dev/null; do
        kill -0 "$2" 2>/dev/null || { echo "server exited; log $3:" >&2; tail -30 "$3" >&2; return 1; }
        sleep 2; t=$((t + 2))
        [ $t -lt 900 ] || { echo "server not ready after 900 s; log $3" >&2; return 1; }
    done
    log "ready after ~${t} s; answer: $(PORT=$1 MODEL=$MODEL_NAME "$PY" - <<'PYEOF' 2>/dev/null || echo '?'
import json, os, urllib.request
body = {"model": os.environ["MODEL"], "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
req = urllib.request.Request(f"http://127.0.0.1:{os.environ['PORT']}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print(repr(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]))
PYEOF
)"
}

stop_server() {  # stop_server PID: SIGINT to its process group, SIGKILL after 30 s
    kill -INT -- "-$1" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- "-$1" 2>/dev/null || true
}

bench() {  # bench ENGINE PORT C [EXTRA_BODY]
    local engine=$1 port=$2 c=$3 n=$(( 2 * $3 > 8 ? 2 * $3 : 8 )) name="$1-c$3.json"
    local extra=()
    [ -n "${4:-}" ] && extra=(--extra-body "$4")
    log "$engine concurrency $c: $n prompts"
    timeout 540 "$PY" -m tokenmill.entrypoints.cli bench serve --base-url "http://127.0.0.1:$port" \
        --model "$MODEL_NAME" --tokenizer "$GGUF" --dataset-name random --random-input-len "$IN" \
        --random-output-len "$OUTLEN" --num-prompts "$n" --max-concurrency "$c" --request-rate inf --ignore-eos \
        --temperature 0 --seed 0 --label "$engine" --save-result --result-dir "$RESULTS" --result-filename "$name" \
        --disable-tqdm "${extra[@]}" > "$RESULTS/logs/$engine-c$c-bench.log" 2>&1 \
        || { echo "bench failed; log:" >&2; tail -20 "$RESULTS/logs/$engine-c$c-bench.log" >&2; return 1; }
    grep -E "Output token throughput|Median TTFT|Median TPOT" "$RESULTS/logs/$engine-c$c-bench.log" | sed 's/^/    /'
}

todo() { [ "${FORCE:-0}" = 1 ] || [ ! -f "$RESULTS/$1-c$2.json" ]; }

phase_llamaserver() {
    [ -x "$LLAMA_SERVER" ] || { echo "no $LLAMA_SERVER: run the build phase" >&2; return 1; }
    [ -f "$GGUF" ] || { echo "no $GGUF: run the gguf phase" >&2; return 1; }
    local c port pid lg
    for c in ${CONC//,/ }; do
        todo llamaserver "$c" || { log "llamaserver c$c exists"; continue; }
        port=$(free_port); lg="$RESULTS/logs/llamaserver-c$c.log"
        # -np C slots share -c tokens; EOS (ids 0 and 2 of the SmolLM2 vocabulary) banned by the client.
        setsid "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$port" --alias "$MODEL_NAME" -ngl 999 \
            -np "$c" -c $((SLOT_CTX * c)) --cont-batching --no-webui > "$lg" 2>&1 &
        pid=$!
        if wait_ready "$port" "$pid" "$lg"; then
            bench llamaserver "$port" "$c" '{"logit_bias": {"0": -100, "2": -100}}' || true
        fi
        stop_server "$pid"
    done
}

phase_tokenmill() {
    [ -f "$GGUF" ] || { echo "no $GGUF: run the gguf phase" >&2; return 1; }
    local c need=0 port pid lg="$RESULTS/logs/tokenmill.log"
    for c in ${CONC//,/ }; do todo tokenmill "$c" && need=1; done
    [ $need = 1 ] || { log "tokenmill results exist"; return; }
    port=$(free_port)
    setsid "$PY" -m tokenmill.entrypoints.cli serve "$GGUF" --host 127.0.0.1 --port "$port" --dtype "$TM_DTYPE" \
        --max-model-len "$SLOT_CTX" --max-num-seqs 256 --served-model-name "$MODEL_NAME" \
        --disable-uvicorn-access-log > "$lg" 2>&1 &
    pid=$!
    if wait_ready "$port" "$pid" "$lg"; then
        for c in ${CONC//,/ }; do
            todo tokenmill "$c" || { log "tokenmill c$c exists"; continue; }
            bench tokenmill "$port" "$c" || true
        done
    fi
    stop_server "$pid"
}

phase_report() {
    RESULTS="$RESULTS" CONC="$CONC" "$PY" - <<'PYEOF'
import json, os
from pathlib import Path

res = Path(os.environ["RESULTS"])
def get(engine, c):
    p = res / f"{engine}-c{c}.json"
    return json.loads(p.read_text()) if p.is_file() else None
rows = ["| concurrency | llama.cpp out tok/s | tokenmill out tok/s | tokenmill / llama.cpp | median TTFT ms (llama.cpp / tokenmill) "
        "| median TPOT ms (llama.cpp / tokenmill) |", "|---:|---:|---:|---:|---:|---:|"]
fmt = lambda r, k, f=".1f": format(r[k], f) if r and k in r else "-"
for c in os.environ["CONC"].split(","):
    a, b = get("llamaserver", c), get("tokenmill", c)
    ratio = f"{b['output_throughput'] / a['output_throughput']:.2f}x" if a and b and a["output_throughput"] else "-"
    rows.append(f"| {c} | {fmt(a, 'output_throughput')} | {fmt(b, 'output_throughput')} | {ratio} | "
                f"{fmt(a, 'median_ttft_ms')} / {fmt(b, 'median_ttft_ms')} | {fmt(a, 'median_tpot_ms', '.2f')} / "
                f"{fmt(b, 'median_tpot_ms', '.2f')} |")
table = "\n".join(rows)
print(table)
(res / "table.md").write_text(table + "\n")
PYEOF
    if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
        tar -czf "$OUT/gpu-peer-results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
        cp "$RESULTS/table.md" "$OUT/gpu-peer-table.md"
    fi
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(build gguf llamaserver tokenmill report)
for ph in "${phases[@]}"; do
    case "$ph" in
        build) phase_build ;;
        gguf) phase_gguf ;;
        llamaserver) phase_llamaserver ;;
        tokenmill) phase_tokenmill ;;
        report) phase_report ;;
        *) echo "unknown phase: $ph (build gguf llamaserver tokenmill report)" >&2; exit 2 ;;
    esac
done
