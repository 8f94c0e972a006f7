#!/usr/bin/env bash
# Session 15, visit 2: the six GPU tests that visit 1's suite run did not reach in its 575 s (329 of 335 passed),
# then issue 20 at M = 1 and at full batch: the AWQ TPOT at 1024 context with the committed defaults and with
# the GEMV's register prefetch (--override, no code change), and the AWQ offline run with 4 full-batch steps
# under the profiler (where its 0.78x of bf16 goes).
#   GIT_COMMIT=<sha> bash benchmarks/gpu/results/session15/visit2.sh [budget_s]
set -u
BUDGET=${1:-585}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
Q=tokenmill.kernels.triton.quant_linear
TAILN=8 step gpu-tail 150 $PT -m gpu tests/worker/test_model_runner.py tests/attention/test_torch_sdpa.py \
  tests/model_loader/test_dummy_weights.py tests/entrypoints/test_env.py
TAILN=8 step tpot-awq 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --json-out $OUT/tpot-awq.json
TAILN=8 step tpot-awq-pf 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --override $Q.GEMV_PREFETCH=True --json-out $OUT/tpot-awq-pf.json
TAILN=40 step offline-awq-prof 200 $OB --part offline --config $L/llama-3.1-8b-awq.json --hf-prompts 0 \
  --profile-offline-steps 4 --profile-offline-first 200 --json-out $OUT/offline-awq-prof.json
