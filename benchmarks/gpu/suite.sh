#!/usr/bin/env bash
# One GPU visit = one call of this script with the parts to run, in order; each part logs to
# $OUT/<part>.log (and JSON where the tool writes one) and a summary table is printed at the end.
#
#   bash benchmarks/gpu/suite.sh tests tpot short       # on nvidia-h200
#   bash benchmarks/gpu/suite.sh offline
#   bash benchmarks/gpu/suite.sh cc70 moe prefix
#   bash benchmarks/gpu/suite.sh tp                      # on nvidia-h200-x2
#
# Parts (commands as written in docs/benchmarks.md):
#   gputests tests/gpu and tests/kernels only, not stopping at the first failure
#   (part:seconds sets that part's time limit, default $PART_TIMEOUT or 560)
#   tests    GPU tests (tests/gpu, CUDA kernel tests) via benchmarks/gpu/run_gpu_tests.sh if present
#   tpot     offline_bench.py --part tpot   (Llama-3.1-8B config, dummy weights, bf16)
#   short    offline_bench.py --part short  (256 x 128 in / 128 out, both engines)
#   offline  offline_bench.py --part offline --hf-prompts 0 (1000 prompts; no transformers baseline)
#   cc70     offline_bench.py --part offline --force-cc70 (fp16, V100 code paths)
#   moe      offline_bench.py --part offline --config qwen3-30b-a3b.json --hf-prompts 0
#   prefix   prefix_cache_bench.py, 200 requests, Llama-3.1-8B config
#   tp       tp_bench.py (TP=1 vs TP=2; two GPUs)
#   qktests  the int4/int8 and FP8 kernel tests only, FP8 fused MoE included (GPU-marked ones run at real sizes)
#   fp8k     fp8_gemm.py --cc70: FP8 GEMMs vs bf16 at Llama-3.1-8B shapes
#   fp8moek  fp8_moe.py --sweep: the FP8 fused MoE vs dequantize-all + bf16 vs bf16 at Qwen3-30B-A3B expert shapes
#   quantk   quant_gemm.py: int4/int8 kernels vs bf16 at Llama-3.1-8B / Qwen3-30B-A3B shapes
#   qtpot-awq, qtpot-gptq, qoffline-awq, qoffline-gptq   tpot / offline with the W4A16 configs
#            (benchmarks/configs/llama-3.1-8b-{awq,gptq}.json: dummy 4-bit weights, group 128)
#   qtpot-fp8, qoffline-fp8   tpot / offline with benchmarks/configs/llama-3.1-8b-fp8.json (dummy FP8 weights,
#            per-channel scales, W8A8 dynamic per-token: torch._scaled_mm on cc >= 8.9)
#   qtpot-fp8-block, qoffline-fp8-block   the same with 128x128 block scales (llama-3.1-8b-fp8-block.json)
#   qtpot-fp8-atload, qoffline-fp8-atload   the bf16 config with --quantization fp8 (quantized at load)
#   qcc70-fp8  offline, the FP8 config on the cc-7.0 path (weight-only, e4m3 bits decoded in the kernel; fp16)
#   qmoe     offline, Qwen3-30B-A3B GPTQ-Int4 config
#   qmoe-fp8 offline, Qwen3-30B-A3B with Qwen3-30B-A3B-FP8's quantization_config (benchmarks/configs/
#            qwen3-30b-a3b-fp8.json: dummy e4m3 weights, 128x128 blocks; experts in the FP8 fused-MoE kernel)
#   qcc70, qtpot-cc70   the AWQ config on the cc-7.0 path (fp16)
#   kvfp8    the fp8 KV-cache kernel tests at real sizes (tests/kernels/test_kv_fp8.py), the engine ones
#            (tests/gpu/test_kv_cache_fp8_cuda.py: CUDA graphs, 2x tokens) and the 16-bit
#            paged-attention / cache-write tests (nothing regressed)
#   kvfp8-tpot, kvfp8-offline   tpot / offline (--hf-prompts 0) with --kv-cache-dtype fp8 (Llama-3.1-8B
#            config, bf16 weights): compare TPOT and "KV cache: ... tokens" with the tpot / offline parts
#   kvfp8-cc70   tpot with --kv-cache-dtype fp8 on the cc-7.0 path (fp16, TOKENMILL_FORCE_CC70=1)
#   osstests the MXFP4 fused-MoE kernel tests (GPU-marked one at gpt-oss-20b sizes) and the gpt-oss model tests
#   moesweep sweep_moe.py: bf16 fused-MoE tiles per T and the layer by part (routing, sort, GEMMs, activation,
#            top-k sum) at Qwen3-30B-A3B / gpt-oss-20b expert shapes; prints _TABLE rows for fused_moe.py
#   moetests the fused-MoE kernel tests (bf16 / int4 / MXFP4, GPU-marked ones at real sizes) and the MoE model tests
#   mxfp4k   mxfp4_moe.py --sweep: the MXFP4 fused MoE vs decode-all + bf16 at gpt-oss-20b expert shapes
#   osstpot-20b, osstpot-120b      tpot, gpt-oss-{20b,120b} configs (dummy MXFP4 experts), bf16
#   ossoffline-20b, ossoffline-120b  offline, 1000 prompts in/out U[100, 1024], no transformers baseline
#   osscc70-20b, osstpot-cc70-20b  gpt-oss-20b offline / tpot on the cc-7.0 path (fp16)
#   (gpt-oss-120b's tpot/offline need ~63 GB of weights loaded: give them part:seconds headroom)
# Python packages the GPU image lacks (compressed-tensors and pydantic for the FP8 checkpoint tests) travel as
# wheels in .whl/ (the device README's pip download line; .whl/ is git-ignored); they are installed into
# /tmp/site and put on PYTHONPATH when present.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
unset TRITON_INTERPRET
COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
LIMIT=${PART_TIMEOUT:-560}
summary=()
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for spec in "$@"; do
  part=${spec%%:*}
  limit=$LIMIT
  [[ $spec == *:* ]] && limit=${spec##*:}  # part:seconds
  start=$(date +%s)
  case $part in
    tests)   cmd="bash benchmarks/gpu/run_gpu_tests.sh" ;;
    gputests) cmd="python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/gpu tests/kernels" ;;
    tpot)    cmd="python benchmarks/gpu/offline_bench.py --part tpot --git-commit $COMMIT --json-out $OUT/tpot.json" ;;
    short)   cmd="python benchmarks/gpu/offline_bench.py --part short --git-commit $COMMIT --json-out $OUT/short.json" ;;
    offline) cmd="python benchmarks/gpu/offline_bench.py --part offline --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/offline.json" ;;
    cc70)    cmd="python benchmarks/gpu/offline_bench.py --part offline --force-cc70 --git-commit $COMMIT --json-out $OUT/cc70.json" ;;
    moe)     cmd="python benchmarks/gpu/offline_bench.py --part offline --config benchmarks/configs/qwen3-30b-a3b.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/moe.json" ;;
    prefix)  cmd="python benchmarks/prefix_cache_bench.py --config benchmarks/configs/llama-3.1-8b.json --load-format dummy --skip-tokenizer-init --dtype bfloat16 --num-requests 200 --request-rate 8 --output-len 32 --json-out $OUT/prefix.json" ;;
    tp)      cmd="python benchmarks/gpu/tp_bench.py --json-out $OUT/tp.json" ;;
    quantk)  cmd="python benchmarks/gpu/quant_gemm.py --json-out $OUT/quant_gemm.json" ;;
    qktests) cmd="python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/kernels/test_quant_linear.py tests/kernels/test_fused_moe_quant.py tests/kernels/test_quant_pack.py tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_reference.py tests/kernels/test_fused_moe_fp8.py" ;;
    fp8k)    cmd="python benchmarks/gpu/fp8_gemm.py --cc70" ;;
    fp8moek) cmd="python benchmarks/gpu/fp8_moe.py --sweep --json-out $OUT/fp8_moe.json" ;;
    qtpot-awq|qtpot-gptq|qoffline-awq|qoffline-gptq)
             m=${part#*-}; p=${part%-*}; p=${p#q}
             cmd="python benchmarks/gpu/offline_bench.py --part $p --config benchmarks/configs/llama-3.1-8b-$m.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/$part.json" ;;
    qtpot-fp8|qoffline-fp8|qtpot-fp8-block|qoffline-fp8-block)
             p=${part%%-*}; p=${p#q}; m=${part#*-}
             cmd="python benchmarks/gpu/offline_bench.py --part $p --config benchmarks/configs/llama-3.1-8b-$m.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/$part.json" ;;
    qtpot-fp8-atload|qoffline-fp8-atload)
             p=${part%%-*}; p=${p#q}
             cmd="python benchmarks/gpu/offline_bench.py --part $p --config benchmarks/configs/llama-3.1-8b.json --quantization fp8 --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/$part.json" ;;
    qcc70-fp8) cmd="python benchmarks/gpu/offline_bench.py --part offline --force-cc70 --config benchmarks/configs/llama-3.1-8b-fp8.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/qcc70-fp8.json" ;;
    qmoe)    cmd="python benchmarks/gpu/offline_bench.py --part offline --config benchmarks/configs/qwen3-30b-a3b-gptq-int4.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/qmoe.json" ;;
    qmoe-fp8) cmd="python benchmarks/gpu/offline_bench.py --part offline --config benchmarks/configs/qwen3-30b-a3b-fp8.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/qmoe-fp8.json" ;;
    qcc70)   cmd="python benchmarks/gpu/offline_bench.py --part offline --force-cc70 --config benchmarks/configs/llama-3.1-8b-awq.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/qcc70.json" ;;
    qtpot-cc70) cmd="python benchmarks/gpu/offline_bench.py --part tpot --force-cc70 --config benchmarks/configs/llama-3.1-8b-awq.json --git-commit $COMMIT --json-out $OUT/qtpot-cc70.json" ;;
    kvfp8)   cmd="python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/kernels/test_kv_fp8.py tests/gpu/test_kv_cache_fp8_cuda.py tests/kernels/test_triton_paged_attention.py tests/kernels/test_triton_reshape_and_cache.py" ;;
    kvfp8-tpot) cmd="python benchmarks/gpu/offline_bench.py --part tpot --kv-cache-dtype fp8 --git-commit $COMMIT --json-out $OUT/kvfp8-tpot.json" ;;
    kvfp8-offline) cmd="python benchmarks/gpu/offline_bench.py --part offline --hf-prompts 0 --kv-cache-dtype fp8 --git-commit $COMMIT --json-out $OUT/kvfp8-offline.json" ;;
    kvfp8-cc70) cmd="python benchmarks/gpu/offline_bench.py --part tpot --force-cc70 --kv-cache-dtype fp8 --git-commit $COMMIT --json-out $OUT/kvfp8-cc70.json" ;;
    osstests) cmd="python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/kernels/test_fused_moe_mxfp4.py tests/kernels/test_mxfp4_dequant.py tests/kernels/test_triton_moe.py tests/models/test_gpt_oss.py" ;;
    moesweep) cmd="python benchmarks/gpu/sweep_moe.py --json-out $OUT/sweep_moe.json" ;;
    moetests) cmd="python -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/kernels/test_triton_moe.py tests/kernels/test_moe_routing.py tests/kernels/test_fused_moe_quant.py tests/kernels/test_fused_moe_mxfp4.py tests/models/test_families.py tests/models/test_gpt_oss.py" ;;
    mxfp4k)  cmd="python benchmarks/gpu/mxfp4_moe.py --sweep --json-out $OUT/mxfp4_moe.json" ;;
    osstpot-20b|osstpot-120b|ossoffline-20b|ossoffline-120b)
             m=${part#*-}; p=${part%-*}; p=${p#oss}
             cmd="python benchmarks/gpu/offline_bench.py --part $p --config benchmarks/configs/gpt-oss-$m.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/$part.json" ;;
    osscc70-20b) cmd="python benchmarks/gpu/offline_bench.py --part offline --force-cc70 --config benchmarks/configs/gpt-oss-20b.json --hf-prompts 0 --git-commit $COMMIT --json-out $OUT/$part.json" ;;
    osstpot-cc70-20b) cmd="python benchmarks/gpu/offline_bench.py --part tpot --force-cc70 --config benchmarks/configs/gpt-oss-20b.json --git-commit $COMMIT --json-out $OUT/$part.json" ;;
    *) echo "unknown part $part"; continue ;;
  esac
  echo "=== $part: $cmd"
  timeout "$limit" $cmd > "$OUT/$part.log" 2>&1
  rc=$?
  tail -n 40 "$OUT/$part.log"
  summary+=("$part rc=$rc $(( $(date +%s) - start ))s")
done
echo "=== summary (commit $COMMIT)"
printf '%s\n' "${summary[@]}"
