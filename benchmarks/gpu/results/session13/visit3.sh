#!/usr/bin/env bash
# Session 13 (H200), third visit: bash visit3.sh [budget_s] (GIT_COMMIT=... set by the caller).
# GPU tests of the new kernels (int4 tensor-core GEMM rewrite, long-prefill tiles, long decode graphs), the int4
# tile sweep at batch-sized M, then issue 24's long-context figures with the new splits, graphs and tiles.
set -u
BUDGET=${1:-560}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=10 step gputests 150 $PT -m gpu tests/kernels/test_quant_gemm_tc.py tests/kernels/test_triton_paged_attention.py \
  tests/gpu/test_cuda_graphs.py
TAILN=60 step large-m-tc 200 python benchmarks/gpu/large_m_paths.py --json-out $OUT/large_m_tc.json
TAILN=6 step long126k 150 $OB --part tpot --tpot-input 126000 --tpot-output 64 --max-model-len 131072 \
  --profile-steps 4 --json-out $OUT/long126k.json
TAILN=6 step prefill32k 90 $OB --part prefill --json-out $OUT/prefill32k.json
