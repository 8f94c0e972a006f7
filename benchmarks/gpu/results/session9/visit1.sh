#!/usr/bin/env bash
# Session 9, visit 1 (H200): FP8 GPU tests (native + forced cc 7.0), fp8 KV GPU tests, int4 tensor-core
# GEMV + PTX-dequant MoE GPU tests, the int4 sweep with the "dot" path, FP8 per-layer timings in graphs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
unset TRITON_INTERPRET TOKENMILL_FORCE_CC70
PT="python -m pytest -q -p no:cacheprovider -rfE --durations=5"
step() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n 6 "$OUT/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step fp8tests 160 $PT tests/gpu/test_fp8_gpu.py tests/gpu/test_kv_cache_fp8_cuda.py tests/kernels/test_kv_fp8.py tests/kernels/test_fp8_gemm.py -m gpu
step fp8tests_cc70 90 env TOKENMILL_FORCE_CC70=1 $PT tests/gpu/test_fp8_gpu.py tests/gpu/test_kv_cache_fp8_cuda.py -m gpu
step int4tc 110 $PT tests/kernels/test_quant_linear.py tests/kernels/test_fused_moe_quant.py -m gpu -k "tensor_core or ptx"
step sweep 200 python benchmarks/gpu/sweep_quant.py --ms 1,2,4,8,16,32 --json-out $OUT/sweep.json
grep -E "best|default|M=|^ *[0-9]" "$OUT/sweep.log" | tail -n 60
