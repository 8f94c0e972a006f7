#!/usr/bin/env bash
# Session 12 (H200), first visit: bash visit.sh a|b|c [budget_s], calls in quick succession (carry .devcarry).
# a: offline at the engine's default limits (1024 sequences, 16,384 batched tokens; every earlier offline figure
#    used 256 sequences): Llama-3.1-8B bf16 with 8 profiled steps; TTFT as a median of fresh prompts; gpt-oss-20b.
# b: the server at max concurrency 512 (serve_bench.sh, the offline workload), Qwen3-30B-A3B offline.
# c: the FP8 and AWQ checkpoints offline.
set -u
BUDGET=${2:-570}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${1:-a} in
a)
  TAILN=40 step offline 230 $OB --part offline --hf-prompts 0 --profile-offline-steps 8 --json-out $OUT/offline.json
  TAILN=4 step ttft 110 $OB --part tpot --host-profile --json-out $OUT/ttft.json
  grep -E "TTFT" "$OUT/ttft.log" | head -12
  TAILN=6 step oss20-offline 200 $OB --part offline --hf-prompts 0 --config $L/gpt-oss-20b.json --json-out $OUT/oss20-offline.json ;;
b)
  TAILN=40 step serve512 330 bash benchmarks/gpu/serve_bench.sh
  TAILN=6 step qwen3moe-offline 220 $OB --part offline --hf-prompts 0 --config $L/qwen3-30b-a3b.json --json-out $OUT/qwen3moe-offline.json ;;
c)
  TAILN=6 step fp8-offline 200 $OB --part offline --hf-prompts 0 --config $L/llama-3.1-8b-fp8.json --json-out $OUT/fp8-offline.json
  TAILN=6 step awq-offline 200 $OB --part offline --hf-prompts 0 --config $L/llama-3.1-8b-awq.json --json-out $OUT/awq-offline.json ;;
esac
