#!/usr/bin/env bash
# Session 14 (prepared; not run: no device time was left): the int4 GEMV at M = 1 on the H200.
#   GIT_COMMIT=<sha> bash benchmarks/gpu/results/session14/visit2.sh [budget_s]
# 1. the GEMV's tests compiled on CUDA (rows 1-3, four-word tiles, the register prefetch; these tests take the
#    GPU when there is one), 2. the AWQ TPOT at 1024 context with the committed defaults, 3. the same with the
#    GEMV's register prefetch on (--override, no code change), 4. gemv_probe.py (each tile's GEMV against a
#    load-only kernel of the same access pattern and the split-K reduction alone; JSON written after each shape,
#    exit 1 if a tile's output is wrong). The TPOT with the probe's best tile goes in the next visit
#    (--override quant_linear.GEMV_BLOCK_N / GEMV_BLOCK_KW / GEMV_WARPS / GEMV_PROGRAMS_PER_SM / GEMV_PREFETCH).
set -u
BUDGET=${1:-590}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
Q=tokenmill.kernels.triton.quant_linear
TAILN=6 step gemvtests 90 $PT tests/kernels/test_quant_linear.py -k "gemv_rows or gemv_prefetch or gemv_four"
TAILN=8 step tpot-awq 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --json-out $OUT/tpot-awq.json
TAILN=8 step tpot-awq-pf 110 $OB --part tpot --config $L/llama-3.1-8b-awq.json --hf-prompts 0 --profile-steps 4 \
  --override $Q.GEMV_PREFETCH=True --json-out $OUT/tpot-awq-pf.json
TAILN=8 step probe 270 python benchmarks/gpu/gemv_probe.py --json-out $OUT/probe.json
