#!/usr/bin/env bash
# Device run with the CuTe DSL installed on the GPU host (../shared/tools/dsl-wheels, call 2):
# compile every test kernel there (JIT, 16 workers), run the GPU tests from that cache, then the
# quick benchmark with FlashAttention-4 as a peer. Everything lands in $OUT.
set -u
export PYTHONUNBUFFERED=1 FLASHCORE_NO_SHRINK=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fc-site .whl/*.whl
export PYTHONPATH=/tmp/fc-site:${PYTHONPATH:-}
export FLASHCORE_CACHE_DIR=/tmp/fc-jit
python3 -c "import flashcore.cli as c; c.main(['info'])" > "$OUT/jit-info.txt" 2>&1
( time timeout -s KILL 200 python3 -m tests.gpu_specs --arch sm_90 --out /tmp/fc-jit --jobs 16 \
    > "$OUT/jit-build.log" 2>&1 ) 2>> "$OUT/jit-build.log"
timeout -s KILL "${TEST_S:-200}" python3 -m pytest -m gpu --hypothesis-show-statistics \
  -p no:cacheprovider -q -rs -s tests > "$OUT/jit-tests.log" 2>&1
echo "tests exit $?" >> "$OUT/jit-tests.log"
FLASHCORE_TUNED=${TUNED:-flashcore/tuned} timeout -s KILL "${BENCH_S:-200}" python3 -m flashcore.bench \
  --quick --fp8 --out "$OUT" > "$OUT/bench-fa4.log" 2>&1
cat "$OUT/jit-info.txt"; tail -4 "$OUT/jit-build.log"
grep -E "passed|failed|Falsifying|FP8 worst|exit" "$OUT/jit-tests.log" | tail -8; tail -12 "$OUT/bench-fa4.log"
