#!/usr/bin/env bash
# Session 13 (H200), second visit: bash visit2.sh [budget_s] (GIT_COMMIT=... set by the caller).
# The fp8 KV decode (native conversions + float16 dots) and graphs at every context length: GPU tests, the
# attention A/B, long-context attention tiles and decode splits, then 126k TPOT and the fp8-KV offline run again.
set -u
BUDGET=${1:-570}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=8 step gputests 120 $PT -m gpu tests/kernels/test_kv_fp8.py tests/gpu/test_kv_cache_fp8_cuda.py tests/gpu/test_cuda_graphs.py
TAILN=4 step fp8-ab 60 python benchmarks/gpu/sweep_tiles.py --fp8
TAILN=40 step long-attn 90 python benchmarks/gpu/sweep_tiles.py --long
TAILN=6 step long126k 200 $OB --part tpot --tpot-input 126000 --tpot-output 64 --max-model-len 131072 \
  --profile-steps 4 --json-out $OUT/long126k.json
TAILN=4 step kvfp8-offline 120 $OB --part offline --hf-prompts 0 --kv-cache-dtype fp8 --json-out $OUT/kvfp8.json
