#!/usr/bin/env bash
# Session 12 (H200), second visit: bash visit2.sh a|b [budget_s], in quick succession.
# a: the quantized linears at batch-sized M against bf16 (large_m_paths.py), then the FP8 checkpoint offline with
#    torch._scaled_mm's fast accumulation and the AWQ one with the Triton tiled GEMM up to M = 1024 (--override),
#    beside visit 1's 10,862 and 9,199 tok/s.
# b: kernel tables of full-batch offline steps (steps 200..207): Qwen3-30B-A3B, Llama-3.1-8B, gpt-oss-20b.
set -u
BUDGET=${2:-570}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${1:-a} in
a)
  TAILN=12 step large-m 150 python benchmarks/gpu/large_m_paths.py
  TAILN=4 step fp8-fastacc 130 $OB --part offline --hf-prompts 0 --config $L/llama-3.1-8b-fp8.json \
    --override tokenmill.kernels.triton.fp8_gemm.SCALED_MM_FAST_ACCUM=True --json-out $OUT/fp8-fastacc.json
  TAILN=4 step awq-tiled1024 140 $OB --part offline --hf-prompts 0 --config $L/llama-3.1-8b-awq.json \
    --override tokenmill.kernels.triton.quant_linear.LARGE_M_MIN=1024 --json-out $OUT/awq-tiled1024.json ;;
b)
  P="--part offline --hf-prompts 0 --profile-offline-steps 8 --profile-offline-first 200"
  TAILN=30 step qwen3moe-prof 170 $OB $P --config $L/qwen3-30b-a3b.json --json-out $OUT/qwen3moe-prof.json
  TAILN=24 step llama-prof 120 $OB $P --json-out $OUT/llama-prof.json
  TAILN=24 step oss20-prof 130 $OB $P --config $L/gpt-oss-20b.json --json-out $OUT/oss20-prof.json ;;
esac
