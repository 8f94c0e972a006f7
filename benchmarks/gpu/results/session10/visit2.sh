#!/usr/bin/env bash
# Session 10, visit 2 (H200). bash visit2.sh a|b [budget_s]. Steps as visit1.sh (limit each; skipped when the
# budget left is below the limit).
# a: GPU tests of mixed-step CUDA graphs, the FP8 GEMV and the last quantized test; the FP8 MoE greedy test
#    under TOKENMILL_FORCE_CC70=1 (weight-only, no activation quantization: does the W8A8 noise explain its
#    divergence?); the FP8 GEMV timing; TTFT with and without mixed graphs (+ cProfile of a prefill step).
# b: offline Llama-3.1-8B bf16 with mixed graphs on (kernel table of steps 1000..1007) and off; FP8 TPOT (GEMV);
#    gpt-oss-20b offline; gpt-oss-120b TPOT; gpt-oss-20b KV without the window saving and TPOT on the cc-7.0
#    path; Qwen3-30B-A3B FP8 offline.
set -u
BUDGET=${2:-580}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ ${1:-a} == a ]]; then
  TAILN=12 step gputests 200 $PT -m gpu tests/gpu/test_cuda_graphs.py tests/gpu/test_gpu_llama_parity.py \
    "tests/gpu/test_quantized_gpu.py::test_engine_on_gpu_matches_the_cpu" tests/kernels/test_fp8_gemm.py
  TAILN=6 step fp8moe-cc70 60 env TOKENMILL_FORCE_CC70=1 $PT tests/gpu/test_fp8_gpu.py::test_fp8_moe_checkpoint_on_cuda
  TAILN=40 step fp8gemv 80 python benchmarks/gpu/fp8_gemm.py --sweep-gemv
  TAILN=4 step ttft-graphs 60 $OB --part tpot --host-profile --json-out $OUT/ttft-graphs.json
  grep -E "^TTFT of|under cProfile" "$OUT/ttft-graphs.log"
  TAILN=4 step ttft-eager 60 env TOKENMILL_MIXED_CUDA_GRAPHS=0 $OB --part tpot --host-profile --json-out $OUT/ttft-eager.json
  grep -E "^TTFT of|under cProfile" "$OUT/ttft-eager.log"
else
  TAILN=25 step gemvtest 40 $PT -m gpu -x --tb=short "tests/kernels/test_fp8_gemm.py::test_gpu_gemv_llama_shapes"
  TAILN=40 step fp8gemv-graphs 70 python benchmarks/gpu/fp8_gemm.py --graphs --sweep-gemv
  TAILN=30 step offline-graphs 110 $OB --part offline --hf-prompts 0 --profile-offline-steps 8 --json-out $OUT/offline-graphs.json
  TAILN=4 step offline-eager 110 env TOKENMILL_MIXED_CUDA_GRAPHS=0 $OB --part offline --hf-prompts 0 --json-out $OUT/offline-eager.json
  TAILN=4 step qtpot-fp8 60 $OB --part tpot --config $L/llama-3.1-8b-fp8.json --json-out $OUT/qtpot-fp8.json
  TAILN=4 step oss20-offline 120 $OB --part offline --hf-prompts 0 --config $L/gpt-oss-20b.json --json-out $OUT/oss20-offline.json
  TAILN=4 step oss120-tpot 100 $OB --part tpot --config $L/gpt-oss-120b.json --json-out $OUT/oss120-tpot.json
  grep -E "KV cache:" "$OUT/oss120-tpot.log" | head -2
  TAILN=4 step oss20-nowindow 60 $OB --part tpot --config $L/gpt-oss-20b.json --disable-hybrid-kv-cache-manager --tpot-output 32 --json-out $OUT/oss20-nowindow.json
  grep -E "KV cache:" "$OUT/oss20-nowindow.log" | head -2
  TAILN=4 step oss20-cc70 80 $OB --part tpot --config $L/gpt-oss-20b.json --force-cc70 --json-out $OUT/oss20-cc70.json
  TAILN=4 step qmoe-fp8 200 $OB --part offline --hf-prompts 0 --config $L/qwen3-30b-a3b-fp8.json --json-out $OUT/qmoe-fp8.json
fi
