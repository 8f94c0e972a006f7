#!/usr/bin/env bash
# Session 14 (prepared; not run): the figures not re-measured at the final code of sessions 13-14.
#   GIT_COMMIT=<sha> bash benchmarks/gpu/results/session14/visit3.sh [budget_s]
# bf16 offline (issue 24: >= 13,500) and TPOT at 1024 (<= 4.3 ms); the FP8 checkpoint with an fp8 KV cache
# offline (issue 21: W8A8 >= 15,000); the 126k-token TPOT with the corrected GPU-time accounting (<= 9 ms).
# The server figures (issue 24: >= 95% of offline, ITL p99 <= 150 ms) changed front end since they were measured
# (DELTA outputs, the event-loop reader): `bash benchmarks/gpu/serve_bench.sh` in its own visit (carry .whl).
set -u
BUDGET=${1:-590}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=6 step offline-bf16 150 $OB --part offline --hf-prompts 0 --json-out $OUT/offline-bf16.json
TAILN=6 step tpot-bf16 80 $OB --part tpot --hf-prompts 0 --profile-steps 4 --json-out $OUT/tpot-bf16.json
TAILN=6 step offline-fp8-fp8kv 160 $OB --part offline --config $L/llama-3.1-8b-fp8.json --hf-prompts 0 \
  --kv-cache-dtype fp8 --json-out $OUT/offline-fp8-fp8kv.json
TAILN=6 step long126k 150 $OB --part tpot --tpot-input 126000 --tpot-output 64 --max-model-len 131072 \
  --profile-steps 4 --json-out $OUT/long126k.json
