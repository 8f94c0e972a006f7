#!/bin/sh
# Install the PyTorch build that fits this host into a Python environment (called by the Makefile).
#
#   scripts/install_torch.sh PYTHON            install (skipped when PYTHON already imports torch)
#   scripts/install_torch.sh PYTHON --dry-run  print the pip command it would run, run nothing
#
# The choice reads `nvidia-smi --query-gpu=compute_cap --format=csv,noheader`:
#   a GPU of compute capability 7.x (V100 7.0, T4 / RTX 20xx 7.5) -> PyTorch's CUDA 12.6 build:
#       the CUDA 12.8+ and 13 builds dropped sm_70 (and 13 sm_75), so their kernels would not load
#   any other NVIDIA GPU -> pip's default torch (a current CUDA build)
#   no NVIDIA GPU (nvidia-smi missing or failing) -> the CPU build (a +cpu wheel; the CUDA one is GBs larger)
set -eu

PY="${1:?usage: scripts/install_torch.sh PYTHON [--dry-run]}"
DRY_RUN="${2:-}"
CU126_INDEX="https://download.pytorch.org/whl/cu126"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
CPU_TORCH_VERSION="2.13.0"

run() {
    if [ "$DRY_RUN" = "--dry-run" ]; then
        echo "$*"
    else
        echo "+ $*" >&2
        "$@"
    fi
}

if [ "$DRY_RUN" != "--dry-run" ] && "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "torch is already installed for $PY" >&2
    exit 0
fi

if caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null); then
    # The oldest GPU decides: one build must run on all of them.
    lowest=$(printf '%s\n' "$caps" | tr -d ' ' | grep -E '^[0-9]+\.[0-9]+$' | sort -n | head -n 1)
    case "$lowest" in
        7.*)
            echo "NVIDIA GPU with compute capability $lowest: installing PyTorch's CUDA 12.6 build (the last with sm_70/sm_75 kernels)" >&2
            run "$PY" -m pip install torch --index-url "$CU126_INDEX"
            ;;
        *)
            run "$PY" -m pip install torch
            ;;
    esac
else
    # +cpu wheels sort above the plain version of the same release, so pip takes the CPU build. The release is
    # pinned (the one CI tests): left open, pip could pick a newer release that exists only as a CUDA build on
    # PyPI. Where the CPU index cannot be reached (CI machines reach PyPI only), pip's find-links still
    # offer the +cpu wheel.
    run "$PY" -m pip install "torch==$CPU_TORCH_VERSION" --extra-index-url "$CPU_INDEX"
fi
