#!/usr/bin/env bash
# Device run with the CuTe DSL installed on the GPU host (../shared/tools/dsl-wheels, call 2):
# the quick benchmark with every peer in one run: torch SDPA's backends, FlashAttention-4, and
# NVIDIA's CuTe DSL FA2 example when FLASHCORE_NV_FA2 names a fetched copy of it (kept outside
# git). flashcore's kernels are JIT-compiled there on first use. Everything lands in $OUT.
#   JIT_TESTS=1 also compiles every GPU-test kernel (16 workers) and runs the GPU tests first.
set -u
export PYTHONUNBUFFERED=1 FLASHCORE_NO_SHRINK=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fc-site .whl/*.whl
export PYTHONPATH=/tmp/fc-site:${PYTHONPATH:-}
export FLASHCORE_CACHE_DIR=/tmp/fc-jit
python3 -c "import flashcore.cli as c; c.main(['info'])" > "$OUT/jit-info.txt" 2>&1
if [ "${JIT_TESTS:-0}" = 1 ]; then
  ( time timeout -s KILL 200 python3 -m tests.gpu_specs --arch sm_90 --out /tmp/fc-jit --jobs 16 \
      > "$OUT/jit-build.log" 2>&1 ) 2>> "$OUT/jit-build.log"
  timeout -s KILL "${TEST_S:-200}" python3 -m pytest -m gpu --hypothesis-show-statistics \
    -p no:cacheprovider -q -rs -s tests > "$OUT/jit-tests.log" 2>&1
  echo "tests exit $?" >> "$OUT/jit-tests.log"
  grep -E "passed|failed|Falsifying|FP8 worst|exit" "$OUT/jit-tests.log" | tail -8
fi
FLASHCORE_TUNED=${TUNED:-flashcore/tuned} timeout -s KILL "${BENCH_S:-420}" python3 -m flashcore.bench \
  --quick ${BENCH_ARGS:-} --out "$OUT" > "$OUT/bench-all-peers.log" 2>&1
cat "$OUT/jit-info.txt" | head -5; tail -14 "$OUT/bench-all-peers.log"
