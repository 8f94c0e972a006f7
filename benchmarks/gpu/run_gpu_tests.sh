#!/usr/bin/env bash
# Every test that needs (or changes behaviour on) a CUDA GPU, in one pytest run. From the repo root:
#
#   bash benchmarks/gpu/run_gpu_tests.sh                 # all of them, stop at the first failure
#   bash benchmarks/gpu/run_gpu_tests.sh -k parity       # extra arguments go to pytest
#
# Environment: PYTHON (default python), LOG (a file for the full output; default a temp file).
# The last line is a one-line summary: "run_gpu_tests: rc=<pytest exit code> <pytest summary> (script <s>s, log <file>)".
#
# Modules: tests/gpu, tests/kernels, tests/worker, plus the other modules with CUDA-only tests
# (`grep -rl cuda.is_available tests`): tests/attention, tests/platforms,
# tests/model_loader/test_dummy_weights.py, tests/entrypoints/test_env.py. None of them imports
# fastapi, uvicorn, zmq, msgspec, gguf, ray, xgrammar, schemathesis, openai or prometheus_client
# (absent on the GPU image): they were collected and tests/worker run on CPU with those imports
# blocked. The rest of tests/model_loader and tests/entrypoints needs them, so it is not listed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
LOG=${LOG:-$(mktemp -t run_gpu_tests.XXXXXX)}
# Compiled kernels, not the interpreter; the real device, not the cc-7.0 simulation (the tests
# that want it set it themselves); no hub access.
unset TRITON_INTERPRET TOKENMILL_FORCE_CC70
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=.

TESTS=(
  tests/gpu
  tests/kernels
  tests/worker
  tests/attention
  tests/platforms
  tests/model_loader/test_dummy_weights.py
  tests/entrypoints/test_env.py
)

"$PY" - <<'EOF' || { echo "run_gpu_tests: rc=2 no CUDA device visible"; exit 2; }
import sys

import torch
import transformers
import triton

if not torch.cuda.is_available():
    sys.exit(1)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
EOF

start=$(date +%s)
"$PY" -m pytest -q -x -p no:cacheprovider -rfEs --durations=15 "${TESTS[@]}" "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
# pytest's own last line, e.g. "3 failed, 120 passed, 4 skipped in 95.1s" or "no tests ran in 0.5s".
summary=$(grep -E "^(=+ )?([0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?|tests? collected)|no tests ran)" "$LOG" \
  | tail -n 1 | sed -e 's/^=* *//' -e 's/ *=*$//')
echo "run_gpu_tests: rc=$rc ${summary:-no pytest summary} (script $(( $(date +%s) - start ))s, log $LOG)"
exit "$rc"
