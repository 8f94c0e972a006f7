#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the server Ollama's engine is built on)
# from the llama.cpp source that the `llama-cpp-python` sdist on PyPI vendors
# under vendor/llama.cpp.  Only the llama-server target is built.
#
# Usage:
#   bash benchmarks/peers/build_llama_server.sh [--cuda] [--src SRC] [--out DIR]
#   bash benchmarks/peers/build_llama_server.sh --pack OUT.tar.gz [--src SRC]
#
#   --cuda     build the CUDA backend for sm_90 (H100/H200): -DGGML_CUDA=ON
#              -DCMAKE_CUDA_ARCHITECTURES=90 (nvcc on PATH or CUDACXX).  The
#              default is a CPU build.
#   --src SRC  the source: the sdist (.tar.gz), an unpacked sdist, a
#              llama.cpp folder, or a tarball written by --pack.  Default: the
#              sdist downloaded with `pip download` into the build folder
#              (needs network; a machine without one passes --src).
#   --out DIR  build folder (default .build/llama-server-cpu or
#              .build/llama-server-cuda under the repository root; git-ignored).
#              The binary ends up in DIR/bin/llama-server; its path is the
#              last line printed.
#   --pack OUT write a trimmed llama.cpp source tarball (no models/docs/media/
#              benches/tests, ~10 MB instead of the 77 MB sdist) to carry to a
#              machine without network, then exit.
#
# Environment: JOBS (compile jobs, default 2), LLAMA_CPP_PYTHON_VERSION
# (default 0.3.36, the version measured so far), PYTHON (for pip download and
# for finding pip-installed cuBLAS), CONFIGURE_ONLY=1 (run CMake, build nothing).
#
# CUDA: cuBLAS is taken from beside nvcc, else from pip wheels (site-packages/
# nvidia/*/include/cublas_v2.h, as in images whose CUDA libraries are Python
# packages); libcuda from the driver's folders or the toolkit's stubs, else the
# build sets GGML_CUDA_NO_VMM=ON.
# The build folder is kept, so a second run only relinks.
#
# x86 CPUs: -march=native minus AMX.  With AMX, ggml's Q4_1 matmul dies with
# SIGILL (`tilezero` in tinygemm_kernel_amx) on the CPU machine's VM although
# the CPU lists amx_tile/amx_int8; the AVX-512 (VNNI) dot products stay.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
JOBS="${JOBS:-2}"
LCP_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"

cuda=0; src=""; out=""; pack=""
while [ $# -gt 0 ]; do
    case "$1" in
        --cuda) cuda=1 ;;
        --src) src="$2"; shift ;;
        --out) out="$2"; shift ;;
        --pack) pack="$2"; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
log() { echo "[build_llama_server $(date +%H:%M:%S)] $*" >&2; }

WORK="$ROOT/.build"
mkdir -p "$WORK"

# Resolve the llama.cpp source folder (the one with ggml/ and tools/server/).
llama_dir() {
    local s="$1"
    if [ -z "$s" ]; then
        s="$WORK/llama_cpp_python-$LCP_VERSION.tar.gz"
        if [ ! -f "$s" ]; then
            log "downloading the llama-cpp-python $LCP_VERSION sdist"
            "$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$LCP_VERSION" >&2
        fi
    fi
    if [ -f "$s" ]; then  # a tarball: unpack once (unpacking again would make the build recompile everything)
        local dest="$WORK/src-$(basename "$s" .tar.gz)"
        if [ ! -f "$dest/.unpacked" ]; then
            mkdir -p "$dest"
            tar -xzf "$s" -C "$dest"
            touch "$dest/.unpacked"
        fi
        s="$dest"
    fi
    local d
    for d in "$s" "$s/llama.cpp" "$s/vendor/llama.cpp" "$s"/*/vendor/llama.cpp "$s"/*/llama.cpp; do
        if [ -f "$d/ggml/CMakeLists.txt" ] && [ -d "$d/tools/server" ]; then
            (cd "$d" && pwd); return
        fi
    done
    echo "no llama.cpp source (ggml/ and tools/server/) under $s" >&2
    exit 1
}

SRC="$(llama_dir "$src")"
log "llama.cpp source: $SRC"

if [ -n "$pack" ]; then
    # Everything CMake needs for llama-server; models (test vocabularies),
    # docs, media, benches and tests are what make the sdist large.
    tar -czf "$pack" -C "$(dirname "$SRC")" \
        --exclude="llama.cpp/models" --exclude="llama.cpp/docs" --exclude="llama.cpp/media" \
        --exclude="llama.cpp/benches" --exclude="llama.cpp/tests" --exclude="llama.cpp/.git" \
        "$(basename "$SRC")"
    log "packed $(du -h "$pack" | cut -f1) into $pack"
    echo "$pack"
    exit 0
fi

if [ -z "$out" ]; then
    out="$WORK/llama-server-$([ $cuda = 1 ] && echo cuda || echo cpu)"
fi
mkdir -p "$out"

args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON)
if [ "$(uname -m)" = x86_64 ]; then
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    args+=(-DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX")
fi
if [ $cuda = 1 ]; then
    command -v nvcc >/dev/null || [ -n "${CUDACXX:-}" ] || { echo "--cuda needs nvcc on PATH or CUDACXX" >&2; exit 1; }
    args+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
    nvcc_bin="$(command -v nvcc || echo "$CUDACXX")"
    toolkit="$(cd "$(dirname "$(readlink -f "$nvcc_bin")")/.." && pwd)"
    # cuBLAS from pip wheels (nvidia/cu13 or nvidia/cublas under site-packages) when the toolkit lacks it,
    # as in images whose CUDA libraries are Python packages: CMake's FindCUDAToolkit looks only beside nvcc.
    if ! ls "$toolkit"/include/cublas_v2.h "$toolkit"/targets/*/include/cublas_v2.h >/dev/null 2>&1; then
        hdr="$("$PY" - <<'PYEOF' 2>/dev/null || true
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
hits = [h for r in roots for h in glob.glob(f"{r}/nvidia/*/include/cublas_v2.h")]
print(hits[0] if hits else "")
PYEOF
)"
        if [ -n "$hdr" ]; then
            pipcuda="$(dirname "$(dirname "$hdr")")"
            lib="$(ls -d "$pipcuda"/lib "$pipcuda"/lib64 2>/dev/null | head -1 || true)"
            log "cuBLAS from $pipcuda"
            args+=(-DCUDA_cublas_LIBRARY="$(ls "$lib"/libcublas.so* 2>/dev/null | head -1 || true)"
                   -DCUDA_cublasLt_LIBRARY="$(ls "$lib"/libcublasLt.so* 2>/dev/null | head -1 || true)"
                   -DCMAKE_CUDA_FLAGS="-I$pipcuda/include")
            NO_AMX="${NO_AMX:-} -I$pipcuda/include"
            args+=(-DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX")
            export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}" LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
    # libcuda (the driver) for ggml's virtual-memory pool; without one, build with GGML_CUDA_NO_VMM.
    driver="$(ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* \
              "$toolkit"/lib64/stubs/libcuda.so "$toolkit"/targets/*/lib/stubs/libcuda.so 2>/dev/null | head -1 || true)"
    if [ -n "$driver" ]; then
        args+=(-DCUDA_cuda_driver_LIBRARY="$driver")
    else
        log "no libcuda found: building with GGML_CUDA_NO_VMM=ON"
        args+=(-DGGML_CUDA_NO_VMM=ON)
    fi
fi
if ! command -v cmake >/dev/null; then
    echo "cmake is not installed: pip install cmake (into any venv on PATH)" >&2
    exit 1
fi
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

log "configuring ($([ $cuda = 1 ] && echo CUDA sm_90 || echo CPU)) in $out"
cmake -S "$SRC" -B "$out" "${gen[@]}" "${args[@]}" > "$out/configure.log" 2>&1 \
    || { tail -30 "$out/configure.log" >&2; exit 1; }
[ "${CONFIGURE_ONLY:-0}" = 1 ] && { log "configured (CONFIGURE_ONLY=1)"; exit 0; }
log "building llama-server with $JOBS jobs (log: $out/build.log)"
cmake --build "$out" --target llama-server -j "$JOBS" > "$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; exit 1; }
"$out/bin/llama-server" --version 2>&1 | tail -2 >&2
log "built"
echo "$out/bin/llama-server"
