#!/usr/bin/env bash
# Session 12 (H200), third visit: bash visit3.sh a|b [budget_s], in quick succession (carry .devcarry and .whl).
# a: the new kernels' GPU tests (the gpt-oss clamped SwiGLU's bit-equality, the int4 tensor-core GEMM at real
#    sizes), then the server at concurrency 512 with the stall-free prefill cap and the batched front-end.
# b: if the capped server missed ITL p99 <= 150 ms, the same server without the cap; else the int4 tensor-core GEMM
#    against the planned path at batch-sized M, AWQ offline with it up to the largest M where it won every row of
#    the sweep (--override quant_linear.TC_M_MAX), the FP8 KV cache offline. ($OUT persists between warm calls.)
set -u
BUDGET=${2:-570}
source benchmarks/gpu/visit_steps.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${1:-a} in
a)
  TAILN=8 step gputests 100 $PT -m gpu tests/gpu/test_fused_elementwise_cuda.py -k swiglu \
    tests/kernels/test_quant_gemm_tc.py -k gpu "tests/kernels/test_fp8_gemm.py::test_gpu_real_sizes"
  TAILN=40 step serve512 260 bash benchmarks/gpu/serve_bench.sh
  mkdir -p /tmp/s12 && cp $OUT/serve-llama-3.1-8b-c512.json /tmp/s12/ 2>/dev/null ;;
b)
  # The prefill cap's A/B when the capped server missed ITL p99 <= 150 ms; else the int4 kernel's parts.
  P99=$(python -c "import json; print(round(json.load(open('/tmp/s12/serve-llama-3.1-8b-c512.json'))['p99_itl_ms']))" 2>/dev/null || echo 0)
  echo "capped server ITL p99: $P99 ms"
  if [ "$P99" -gt 150 ]; then
    TAILN=40 step serve512-capoff 260 env OUT=$OUT/capoff bash benchmarks/gpu/serve_bench.sh -- \
      --max-prefill-tokens-with-decodes 0
    exit 0
  fi
  TAILN=14 step large-m 60 python benchmarks/gpu/large_m_paths.py --m 128 256 512 1024 2048 4096
  TC=$(python - "$OUT/large-m.log" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.split()[1:2] == ["layer"]]
best = 0
for r in rows:  # M, "layer", bf16, smm, smm_fast, fp8_tri, q4, q4_tiled, q4_deq, q4_tc, tc_64x256
    try:
        won = float(r[9]) < float(r[6])
    except (IndexError, ValueError):  # a column that did not run: stop there
        break
    if not won:
        break
    best = int(r[0])
print(best)
PY
)
  echo "TC_M_MAX from the sweep: $TC"
  if [ "${TC:-0}" -gt 0 ]; then
    TAILN=4 step awq-tc 130 $OB --part offline --hf-prompts 0 --config $L/llama-3.1-8b-awq.json \
      --override tokenmill.kernels.triton.quant_linear.TC_M_MAX=$TC --json-out $OUT/awq-tc.json
  fi
  TAILN=4 step kvfp8-offline 120 $OB --part offline --hf-prompts 0 --kv-cache-dtype fp8 --json-out $OUT/kvfp8.json ;;
esac
