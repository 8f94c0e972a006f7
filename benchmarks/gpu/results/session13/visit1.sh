#!/usr/bin/env bash
# Session 13 (H200), first visit: bash visit1.sh [budget_s] (GIT_COMMIT=... set by the caller).
# Issue 24's long-context figures, never measured by tokenmill before: one request at 126k tokens (TTFT, TPOT;
# the TTFT's 8 prefill chunks under the profiler), 16 x 32k prompts' prefill rate; then issue 21's FP8 KV cache
# offline with 4 full-batch steps profiled (it ran slower than the bf16 cache in session 12: why).
set -u
BUDGET=${1:-570}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=30 step long126k 230 $OB --part tpot --tpot-input 126000 --tpot-output 64 --max-model-len 131072 \
  --profile-steps 4 --json-out $OUT/long126k.json
TAILN=6 step prefill32k 140 $OB --part prefill --json-out $OUT/prefill32k.json
TAILN=30 step kvfp8-prof 160 $OB --part offline --hf-prompts 0 --kv-cache-dtype fp8 --profile-offline-steps 4 \
  --profile-offline-first 200 --json-out $OUT/kvfp8-prof.json
