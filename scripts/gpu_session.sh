#!/usr/bin/env bash
# Device runs with the CuTe DSL installed on the GPU host (see README, "Running the GPU tests"):
# compile every kernel the tests and the benchmark use there (16 workers), then run the phases
# named on the command line. Logs and records go to $OUT (or ./bench-results/gpu).
#   build ARCH...   compile tests.gpu_specs for each arch (sm_90; sm_89 = an L4's kernels)
#   tests ARCH      the GPU tests, the kernels of ARCH (sm_89 runs from PTX on an H100)
#   sanitize ARCH   compute-sanitizer memcheck, racecheck, synccheck (scripts/sanitize.sh)
#   decode          the decode sweep (scripts/decode_sweep.py)
#   bench           python -m flashcore.bench --quick, every peer (FLASHCORE_NV_FA2 names
#                   NVIDIA's CuTe DSL FA2 example, fetched outside git)
#   hostprof        eager host time at the mission shape, this tree and OLD_TREE if set
set -u
out=${OUT:-bench-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLASHCORE_NO_SHRINK=1
cache=${CACHE_ROOT:-/tmp/fc}  # one cache per arch: tests.gpu_specs writes a catalog index there
export FLASHCORE_CACHE_DIR=$cache-sm_90
phase=""
for word in "$@"; do
  case "$word" in
    build|tests|sanitize|decode|bench|hostprof) phase=$word
      [ "$phase" = decode ] && { timeout -s KILL "${DECODE_S:-240}" python3 scripts/decode_sweep.py \
          ${DECODE_ARGS:-} > "$out/decode-sweep.log" 2>&1; tail -60 "$out/decode-sweep.log"; }
      [ "$phase" = bench ] && { timeout -s KILL "${BENCH_S:-400}" python3 -m flashcore.bench --quick \
          ${BENCH_ARGS:-} --out "$out" > "$out/bench.log" 2>&1; tail -30 "$out/bench.log"; }
      [ "$phase" = hostprof ] && {
        timeout -s KILL 120 python3 scripts/host_overhead.py --tag new > "$out/host-overhead.log" 2>&1
        [ -n "${OLD_TREE:-}" ] && FLASHCORE_CACHE_DIR=/tmp/fc-old PYTHONPATH="$OLD_TREE:${PYTHONPATH:-}" \
          timeout -s KILL 150 python3 scripts/host_overhead.py --tag old >> "$out/host-overhead.log" 2>&1
        cat "$out/host-overhead.log" | grep "per call"; }
      continue ;;
  esac
  arch=$word
  export FLASHCORE_CACHE_DIR=$cache-$arch
  if [ "$phase" = build ]; then
    ( time timeout -s KILL "${BUILD_S:-300}" python3 -m tests.gpu_specs --arch "$arch" \
        --out "$FLASHCORE_CACHE_DIR" --jobs 16 ${BUILD_ARGS:---buckets} ) > "$out/build-$arch.log" 2>&1
    grep -E "kernels|real|Error" "$out/build-$arch.log" | tail -4
  elif [ "$phase" = tests ]; then
    [ "$arch" = sm_90 ] && unset FLASHCORE_ARCH || export FLASHCORE_ARCH=$arch
    timeout -s KILL "${TEST_S:-300}" python3 -m pytest -m gpu --hypothesis-show-statistics \
      -p no:cacheprovider -q -rs ${PYTEST_ARGS:-tests} > "$out/gpu-tests-$arch.log" 2>&1
    echo "tests exit $?" >> "$out/gpu-tests-$arch.log"
    grep -E "passed|failed|Falsifying|^FAILED|^ERROR|exit" "$out/gpu-tests-$arch.log" | tail -25
    unset FLASHCORE_ARCH
  elif [ "$phase" = sanitize ]; then
    [ "$arch" = sm_90 ] && unset FLASHCORE_ARCH || export FLASHCORE_ARCH=$arch
    OUT="$out" bash scripts/sanitize.sh
    unset FLASHCORE_ARCH
  fi
  export FLASHCORE_CACHE_DIR=$cache-sm_90
done
