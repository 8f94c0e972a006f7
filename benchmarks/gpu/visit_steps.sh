# Sourced by the GPU visit scripts (benchmarks/gpu/results/session*/visit*.sh) on the H200: the environment,
# the wheels the image lacks (.whl/, carried), and `step NAME LIMIT CMD...`, which runs CMD under a time limit
# with its output in $OUT/NAME.log and prints its exit code, seconds and last $TAILN lines; a step whose limit no
# longer fits in the visit's budget ($BUDGET seconds from $T0) is skipped with a line saying so.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
unset TRITON_INTERPRET TOKENMILL_FORCE_CC70 TOKENMILL_MIXED_CUDA_GRAPHS
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
C=${GIT_COMMIT:-unknown}
T0=$(date +%s)
PT="python -m pytest -q -p no:cacheprovider -rfE --durations=5"
OB="python benchmarks/gpu/offline_bench.py --git-commit $C"
L=benchmarks/configs
step() { local name=$1 lim=$2; shift 2; local left=$(( BUDGET - ($(date +%s) - T0) ))
  if (( left < lim )); then echo "=== $name SKIPPED (limit ${lim}s, ${left}s left)"; return; fi
  local t0=$(date +%s); timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; tail -n ${TAILN:-6} "$OUT/$name.log"; }
