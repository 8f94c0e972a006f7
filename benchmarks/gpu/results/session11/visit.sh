#!/usr/bin/env bash
# Session 11 (H200). Visit 1: bash visit.sh a|b|c|d [budget_s], calls in quick succession; visit 2: e, then f.
# a: start the llama.cpp CUDA build (benchmarks/peers/gpu_peer.sh build, niced, in the background) and, beside
#    it, the GPU tests never run on a GPU: the chunked-prefill-beside-decodes graph test ([48]), the mixed-step
#    sync test, the FP8 GEMV test, the FP8 MoE checkpoint test under W8A8; then wait for the build.
# b: finish the build if needed, write the random Llama-3.1-8B GGUF, serve it with llama-server and bench it.
# c: serve the same GGUF with tokenmill, bench, print the table.
# d (a later visit): the mixed-step attention A/B (decode tiles for the decodes of a mixed step) and offline.
set -u
BUDGET=${2:-560}
source benchmarks/gpu/visit_steps.sh
export RESULTS_DIR=/tmp/gpu-peer/results GPU_PEER_WORK=/tmp/gpu-peer
mkdir -p $RESULTS_DIR
peer() { bash benchmarks/peers/gpu_peer.sh "$@"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case ${1:-a} in
a)
  (nice -n 10 bash benchmarks/peers/gpu_peer.sh build > /tmp/gpu-peer/build.log 2>&1; echo "build rc=$?" >> /tmp/gpu-peer/build.log) &
  TAILN=14 step gputests 300 $PT -m gpu tests/gpu/test_cuda_graphs.py "tests/gpu/test_fp8_gpu.py::test_fp8_moe_checkpoint_on_cuda" \
    "tests/kernels/test_fp8_gemm.py::test_gpu_gemv_llama_shapes"
  while ! grep -q "build rc=" /tmp/gpu-peer/build.log && (( $(date +%s) - T0 < BUDGET - 10 )); do sleep 5; done
  tail -5 /tmp/gpu-peer/build.log; cp /tmp/gpu-peer/build.log $OUT/ 2>/dev/null
  ls -la .build/llama-server-cuda/bin/llama-server 2>&1 | tail -1
  grep -c "Building CUDA" .build/llama-server-cuda/build.log 2>/dev/null; tail -2 .build/llama-server-cuda/build.log 2>/dev/null ;;
b)
  [ -x .build/llama-server-cuda/bin/llama-server ] || TAILN=8 step build 400 bash benchmarks/peers/gpu_peer.sh build
  TAILN=30 step llamaserver $(( BUDGET - ($(date +%s) - T0) - 5 )) bash benchmarks/peers/gpu_peer.sh gguf llamaserver
  cp /tmp/gpu-peer/results/logs/llamaserver-c1.log $OUT/ 2>/dev/null ;;
c)
  TAILN=30 step tokenmill 330 bash benchmarks/peers/gpu_peer.sh tokenmill report ;;
e)  # visit 2, cold: the peer again with the bench client's one connection per request (llama-server had
    # dropped kept-alive connections), beside the split-decode A/B under graphs, TTFT and gpt-oss checks
  (JOBS=12 nice -n 10 bash benchmarks/peers/build_llama_server.sh --cuda --src .devcarry/gpu-peer/llama.cpp.tar.gz \
     --out .build/llama-server-cuda > /tmp/gpu-peer/build.log 2>&1; echo "build rc=$?" >> /tmp/gpu-peer/build.log) &
  TAILN=10 step mixed-ab 60 python benchmarks/gpu/sweep_tiles.py --mixed
  TAILN=4 step ttft 70 $OB --part tpot --json-out $OUT/ttft.json
  grep -E "^TTFT of" "$OUT/ttft.log"
  TAILN=5 step oss20-cc70 90 $OB --part tpot --config $L/gpt-oss-20b.json --force-cc70 --json-out $OUT/oss20-cc70.json
  grep -i -E "finite" "$OUT/oss20-cc70.log" | head -3
  TAILN=4 step oss20-offline 130 $OB --part offline --hf-prompts 0 --config $L/gpt-oss-20b.json --json-out $OUT/oss20-offline.json
  while ! grep -q "build rc=" /tmp/gpu-peer/build.log && (( $(date +%s) - T0 < BUDGET - 10 )); do sleep 5; done
  tail -2 /tmp/gpu-peer/build.log
  TAILN=30 step llamaserver $(( BUDGET - ($(date +%s) - T0) - 5 )) bash benchmarks/peers/gpu_peer.sh gguf llamaserver ;;
f)
  TAILN=30 step llamaserver2 300 bash benchmarks/peers/gpu_peer.sh llamaserver
  TAILN=30 step tokenmill 300 bash benchmarks/peers/gpu_peer.sh tokenmill report ;;
d)
  TAILN=20 step mixed-ab 90 python benchmarks/gpu/sweep_tiles.py --mixed
  TAILN=30 step offline 140 $OB --part offline --hf-prompts 0 --profile-offline-steps 8 --json-out $OUT/offline.json ;;
esac
