#!/usr/bin/env bash
# Device runs from a carried sm_90 catalog (no DSL on the host); everything lands in $OUT
# (or ./bench-results/gpu).
#   bash scripts/gpu_session_a.sh tests          # the GPU tests
#   bash scripts/gpu_session_a.sh tune           # autotuner, then the quick benchmark with its table
#   bash scripts/gpu_session_a.sh tests tune     # both, in one call
# TUNE_BUCKETS="short" limits the autotuner (winners of other buckets are kept).
set -u
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHCORE_NO_SHRINK=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fc-site .whl/*.whl
export PYTHONPATH=/tmp/fc-site
for mode in "$@"; do
  if [ "$mode" = tests ]; then
    timeout -s KILL "${TEST_S:-420}" python3 -m pytest -m gpu --hypothesis-show-statistics \
      -p no:cacheprovider -q -rs -s ${PYTEST_ARGS:-tests} > "$OUT/gpu-tests.log" 2>&1
    echo "tests exit $?" >> "$OUT/gpu-tests.log"
    grep -E "passed|failed|Falsifying|Error|assert|FP8 worst|exit" "$OUT/gpu-tests.log" | tail -30
  elif [ "$mode" = tune ]; then
    cp flashcore/tuned/sm_90.json "$OUT/sm_90.json"
    timeout -s KILL "${TUNE_S:-240}" python3 -m flashcore.autotune run --out "$OUT/sm_90.json" \
      ${TUNE_BUCKETS:+--buckets $TUNE_BUCKETS} > "$OUT/autotune.log" 2>&1
    FLASHCORE_TUNED="$OUT" timeout -s KILL "${BENCH_S:-300}" python3 -m flashcore.bench --quick \
      --fp8 --out "$OUT" > "$OUT/bench.log" 2>&1
    grep -v "spills, skipped" "$OUT/autotune.log" | tail -20; tail -16 "$OUT/bench.log"
  fi
done
