#!/usr/bin/env bash
# Session 9, final visit (H200). bash visit3.sh a|b [budget_s]. Each step has a time limit; a step whose limit
# no longer fits in the budget left is skipped (printed). a: GPU tests of the new kernels (FP8 fused MoE, MoE
# sort / routing / tiles, int4 tensor-core default), the FP8 MoE kernel timing, the bf16 MoE tile sweep, FP8
# TPOT. b: end to end offline runs (Qwen3-30B-A3B bf16 and FP8, Llama-3.1-8B FP8), then the fp8 KV TPOT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
unset TRITON_INTERPRET TOKENMILL_FORCE_CC70
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
C=${GIT_COMMIT:-unknown}
BUDGET=${2:-580}; T0=$(date +%s)
PT="python -m pytest -q -p no:cacheprovider -rfE --durations=8"
OB="python benchmarks/gpu/offline_bench.py --git-commit $C"
L=benchmarks/configs
step() { local name=$1 lim=$2; shift 2; local left=$(( BUDGET - ($(date +%s) - T0) ))
  if (( left < lim )); then echo "=== $name SKIPPED (limit ${lim}s, ${left}s left)"; return; fi
  local t0=$(date +%s); timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n ${TAILN:-6} "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ ${1:-a} == a ]]; then
  TAILN=14 step gputests 200 $PT -m gpu tests/kernels/test_fused_moe_fp8.py tests/gpu/test_fp8_gpu.py tests/kernels/test_triton_moe.py tests/kernels/test_moe_routing.py tests/kernels/test_fused_moe_mxfp4.py tests/kernels/test_fused_moe_quant.py tests/kernels/test_quant_linear.py tests/gpu/test_quantized_gpu.py -k "not every_path"
  TAILN=30 step fp8moek 60 python benchmarks/gpu/fp8_moe.py --json-out $OUT/fp8_moe.json
  TAILN=60 step moesweep 150 python benchmarks/gpu/sweep_moe.py --tokens 1,16,256,1024,4096 --json-out $OUT/sweep_moe.json
  TAILN=4 step qtpot-fp8 80 $OB --part tpot --config $L/llama-3.1-8b-fp8.json --json-out $OUT/qtpot-fp8.json
  grep -E "KV cache|weights .*GiB|GPU activities|^  +[0-9.]+ ms" "$OUT/qtpot-fp8.log" | head -8
else
  for p in "qmoe-fp8 170 --part offline --hf-prompts 0 --config $L/qwen3-30b-a3b-fp8.json" \
           "moe 170 --part offline --hf-prompts 0 --config $L/qwen3-30b-a3b.json" \
           "qoffline-fp8 130 --part offline --hf-prompts 0 --config $L/llama-3.1-8b-fp8.json" \
           "kvfp8-tpot 75 --part tpot --kv-cache-dtype fp8" \
           "qtpot-fp8-atload 75 --part tpot --config $L/llama-3.1-8b.json --quantization fp8"; do
    set -- $p; name=$1; lim=$2; shift 2
    TAILN=4 step $name $lim $OB "$@" --json-out $OUT/$name.json
    [[ -f $OUT/$name.log ]] && grep -E "KV cache|weights .*GiB" "$OUT/$name.log" | head -2
  done
fi
