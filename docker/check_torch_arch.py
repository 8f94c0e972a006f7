"""Fail the GPU image build when the installed torch lacks sm_70 (V100) kernels.

Reads `torch._C._cuda_getArchFlags()`, the list `torch.cuda.get_arch_list()`
returns once a GPU is present (`get_arch_list()` itself answers [] without a
GPU, as during `docker build`). Env REQUIRE_SM70=0 only reports the list.
Exit status 1 with a sentence when sm_70 is required and missing.
"""

import os
import sys

import torch

flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)()
arches = flags.split() if flags else []
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, arch list {arches}")
if os.environ.get("REQUIRE_SM70", "1") == "1" and "sm_70" not in arches:
    sys.exit(f"torch {torch.__version__} has no sm_70 kernels (arch list {arches}), so V100 GPUs would fail. "
             "Install a CUDA 12.6 build (TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126), "
             "or build with --build-arg REQUIRE_SM70=0 for Turing or newer GPUs only.")
