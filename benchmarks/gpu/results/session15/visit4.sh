#!/usr/bin/env bash
# Session 15, visit 4: where the FP8 W8A8 time goes (issue 21: offline 14,151 vs >= 15,000, TPOT 4.00 vs <= 3.0
# in visit 3): the offline run with 4 full-batch steps under the profiler and the TPOT kernel table; then
# Qwen3-30B-A3B GPTQ-Int4 offline next to bf16 (issue 20; 4,697 in session 7).
#   GIT_COMMIT=<sha> bash benchmarks/gpu/results/session15/visit4.sh [budget_s]
set -u
BUDGET=${1:-470}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=36 step offline-fp8-prof 110 $OB --part offline --config $L/llama-3.1-8b-fp8.json --hf-prompts 0 \
  --profile-offline-steps 4 --profile-offline-first 200 --json-out $OUT/offline-fp8-prof.json
TAILN=30 step tpot-fp8 50 $OB --part tpot --config $L/llama-3.1-8b-fp8.json --hf-prompts 0 --profile-steps 4 \
  --json-out $OUT/tpot-fp8.json
TAILN=4 step offline-qwen-gptq 150 $OB --part offline --config $L/qwen3-30b-a3b-gptq-int4.json --hf-prompts 0 \
  --json-out $OUT/offline-qwen-gptq.json
TAILN=4 step offline-qwen-bf16 140 $OB --part offline --config $L/qwen3-30b-a3b.json --hf-prompts 0 \
  --json-out $OUT/offline-qwen-bf16.json
