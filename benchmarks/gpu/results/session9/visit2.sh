#!/usr/bin/env bash
# Session 9, visit 2 (H200). bash visit2.sh a: GPU tests after the fixes (FP8 native + forced cc 7.0 with the
# carried compressed-tensors wheels; int4 tensor-core GEMV + PTX MoE), the int4 sweep with the "dot" path,
# FP8 per-layer times in CUDA graphs. bash visit2.sh b: FP8 end to end (Llama-3.1-8B config, dummy weights).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
unset TRITON_INTERPRET TOKENMILL_FORCE_CC70
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
C=${GIT_COMMIT:-unknown}
PT="python -m pytest -q -p no:cacheprovider -rfE --durations=5"
OB="python benchmarks/gpu/offline_bench.py --git-commit $C"
L=benchmarks/configs
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n ${TAILN:-6} "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [[ ${1:-a} == a ]]; then
  step fp8tests 150 $PT tests/gpu/test_fp8_gpu.py tests/gpu/test_kv_cache_fp8_cuda.py tests/kernels/test_kv_fp8.py tests/kernels/test_fp8_gemm.py -m gpu
  grep -E "^E  .*(err|bound|diverged)" "$OUT/fp8tests.log" | head -5
  step fp8tests_cc70 90 env TOKENMILL_FORCE_CC70=1 $PT tests/gpu/test_fp8_gpu.py tests/gpu/test_kv_cache_fp8_cuda.py tests/kernels/test_fp8_gemm.py -m gpu
  step int4tc 110 $PT tests/kernels/test_quant_linear.py tests/kernels/test_fused_moe_quant.py -m gpu -k "tensor_core or ptx or gemv or paths"
  step fp8k 100 python benchmarks/gpu/fp8_gemm.py --graphs --cc70 --m 1 2 16 256
  TAILN=0 step sweep 170 python benchmarks/gpu/sweep_quant.py --ms 2,4,8,16,32,64,256 --json-out $OUT/sweep.json
  grep -E "^(qkv|o |gate_up|down|moe)" "$OUT/sweep.log" | sed -E 's/err .*\| us by path/| /' | cut -c1-190
  cat "$OUT/fp8k.log"
else
  for p in "qtpot-fp8 --part tpot --config $L/llama-3.1-8b-fp8.json" \
           "qtpot-fp8-atload --part tpot --config $L/llama-3.1-8b.json --quantization fp8" \
           "kvfp8-tpot --part tpot --kv-cache-dtype fp8" \
           "qtpot-cc70-fp8 --part tpot --force-cc70 --config $L/llama-3.1-8b-fp8.json" \
           "qoffline-fp8 --part offline --hf-prompts 0 --config $L/llama-3.1-8b-fp8.json" \
           "kvfp8-offline --part offline --hf-prompts 0 --kv-cache-dtype fp8"; do
    set -- $p; name=$1; shift
    TAILN=4 step $name 150 $OB "$@" --json-out $OUT/$name.json
    grep -E "KV cache|weights .*GiB" "$OUT/$name.log" | head -2
  done
fi
