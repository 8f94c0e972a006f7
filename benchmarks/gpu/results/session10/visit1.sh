#!/usr/bin/env bash
# Session 10, visit 1 (H200). bash visit1.sh a|b [budget_s]. Each step has a time limit; a step whose limit no
# longer fits in the budget left is skipped (printed).
# a: the GPU tests of everything changed since its last GPU run (routing NaN clamp, moe_sum / activation in the
#    int4 / MXFP4 / FP8 MoE, the FP8 MoE checkpoint test, the M = 2 planner, the FP8 W8A8 MoE mode, heavy-first
#    attention order), the attention launch-order A/B, the FP8 MoE modes, bf16 TPOT/TTFT.
# b: end to end: gpt-oss-20b offline and TPOT, AWQ TPOT (GEMV defaults of 353bb0f, never run end to end), FP8
#    TPOT with the host-side operator table of the prefill step.
set -u
BUDGET=${2:-580}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ ${1:-a} == a ]]; then
  TAILN=16 step gputests 300 $PT -m gpu tests/kernels/test_moe_routing.py tests/kernels/test_fused_moe_fp8.py \
    tests/gpu/test_fp8_gpu.py tests/kernels/test_fused_moe_quant.py tests/kernels/test_fused_moe_mxfp4.py \
    tests/kernels/test_triton_paged_attention.py tests/kernels/test_quant_linear.py tests/gpu/test_quantized_gpu.py
  TAILN=8 step order 60 python benchmarks/gpu/sweep_tiles.py --order
  TAILN=14 step fp8moek 80 python benchmarks/gpu/fp8_moe.py --json-out $OUT/fp8_moe.json
  TAILN=30 step tpot 80 $OB --part tpot --json-out $OUT/tpot.json
else
  for p in "oss20-offline 180 --part offline --hf-prompts 0 --config $L/gpt-oss-20b.json" \
           "oss20-tpot 80 --part tpot --config $L/gpt-oss-20b.json" \
           "qtpot-awq 80 --part tpot --config $L/llama-3.1-8b-awq.json" \
           "qtpot-fp8 80 --part tpot --config $L/llama-3.1-8b-fp8.json"; do
    set -- $p; name=$1; lim=$2; shift 2
    TAILN=6 step $name $lim $OB "$@" --json-out $OUT/$name.json
    [[ -f $OUT/$name.log ]] && grep -E "KV cache:|weights .*GiB|GPU activities|host operators" -A0 "$OUT/$name.log" | head -5
  done
  sed -n '/host operators/,$p' "$OUT/qtpot-fp8.log" 2>/dev/null | head -14
fi
