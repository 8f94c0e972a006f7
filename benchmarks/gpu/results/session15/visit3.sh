#!/usr/bin/env bash
# Session 15, visit 3: the other quantized figures at this commit beside bf16 (issues 20, 21, 24): GPTQ offline and
# TPOT, bf16 offline and TPOT (no regression: 11,778 / 4.92 ms in session 12), FP8 W8A8 offline and TPOT.
#   GIT_COMMIT=<sha> bash benchmarks/gpu/results/session15/visit3.sh [budget_s]
set -u
BUDGET=${1:-560}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=4 step offline-gptq 110 $OB --part offline --config $L/llama-3.1-8b-gptq.json --hf-prompts 0 \
  --json-out $OUT/offline-gptq.json
TAILN=4 step tpot-gptq 50 $OB --part tpot --config $L/llama-3.1-8b-gptq.json --hf-prompts 0 --profile-steps 4 \
  --json-out $OUT/tpot-gptq.json
TAILN=4 step offline-bf16 110 $OB --part offline --hf-prompts 0 --json-out $OUT/offline-bf16.json
TAILN=4 step tpot-bf16 50 $OB --part tpot --hf-prompts 0 --profile-steps 4 --json-out $OUT/tpot-bf16.json
TAILN=4 step offline-fp8 110 $OB --part offline --config $L/llama-3.1-8b-fp8.json --hf-prompts 0 \
  --json-out $OUT/offline-fp8.json
TAILN=4 step tpot-fp8 50 $OB --part tpot --config $L/llama-3.1-8b-fp8.json --hf-prompts 0 --profile-steps 4 \
  --json-out $OUT/tpot-fp8.json
