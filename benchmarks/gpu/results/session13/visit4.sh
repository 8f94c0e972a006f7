#!/usr/bin/env bash
# Session 13 (H200), fourth visit: bash visit4.sh [budget_s] (GIT_COMMIT=... set by the caller).
# The attention kernel's K/V loads now pipeline (EVEN_D): every GPU test, then what it changes: bf16 offline
# (issue 24's 13,500), 126k TTFT/TPOT, the attention A/Bs, 16 x 32k prefill, fp8-KV offline.
set -u
BUDGET=${1:-560}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=4 step gputests 200 bash benchmarks/gpu/run_gpu_tests.sh -m gpu
grep -q "rc=0" $OUT/gputests.log || { echo "GPU tests failed: stopping"; grep -E "FAILED|Error" $OUT/gputests.log | head -20; exit 1; }
TAILN=4 step offline 130 $OB --part offline --hf-prompts 0 --json-out $OUT/offline.json
TAILN=6 step long126k 120 $OB --part tpot --tpot-input 126000 --tpot-output 64 --max-model-len 131072 \
  --profile-steps 4 --json-out $OUT/long126k.json
TAILN=4 step fp8-ab 45 python benchmarks/gpu/sweep_tiles.py --fp8
TAILN=6 step prefill32k 70 $OB --part prefill --json-out $OUT/prefill32k.json
TAILN=4 step kvfp8-offline 100 $OB --part offline --hf-prompts 0 --kv-cache-dtype fp8 --json-out $OUT/kvfp8.json
