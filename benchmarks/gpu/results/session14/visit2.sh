#!/usr/bin/env bash
# Session 14, visit 2: where the int4 GEMV's time goes at M = 1 (gemv_probe.py: each tile's GEMV against a
# load-only kernel of the same access pattern, and the split-K reduction alone), the GEMV's GPU tests with the
# new register prefetch, then the AWQ TPOT at 1024 context with the committed defaults (the baseline).
# GIT_COMMIT=<sha> bash benchmarks/gpu/results/session14/visit2.sh [budget_s]
set -u
BUDGET=${1:-590}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
TAILN=6 step gemvtests 120 $PT -m gpu tests/kernels/test_quant_linear.py -k "gemv"
TAILN=8 step probe 330 python benchmarks/gpu/gemv_probe.py --json-out $OUT/probe.json
TAILN=8 step tpot-awq 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --json-out $OUT/tpot-awq.json
# The same TPOT with the GEMV's register prefetch on (no code change: --override), then with the probe's
# 128-row, 8-word tile if it won (edit the override to the probe's best tile before running).
Q=tokenmill.kernels.triton.quant_linear
TAILN=8 step tpot-awq-pf 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --override $Q.GEMV_PREFETCH=True --json-out $OUT/tpot-awq-pf.json
TAILN=8 step tpot-awq-128x8 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --override $Q.GEMV_BLOCK_N=128 --override $Q.GEMV_BLOCK_KW=8 --override $Q.GEMV_PREFETCH=True \
  --json-out $OUT/tpot-awq-128x8.json
