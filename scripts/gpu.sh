#!/usr/bin/env bash
# The one driver for GPU hosts. Phases run in the order named, each taking the words after it
# up to the next phase; logs and records go to $OUT (default bench-results/gpu).
#
#   bash scripts/gpu.sh setup build sm_90 sm_89 tests sm_90 sm_89 sanitize sm_90 bench
#   GPU=1 bash scripts/gpu.sh tests sm_89 &     # one phase per GPU, side by side
#
#   setup             pure-Python wheels in .whl/ (platformdirs, pyelftools) into /tmp/fc-site;
#                     the CuTe DSL where ../shared/tools/dsl-wheels installed it (/root/dsl)
#   build ARCH...     tests.gpu_specs into one catalog per arch ($CACHE_ROOT-ARCH, default
#                     /tmp/fc-ARCH; BUILD_ARGS, default "--buckets": e.g. "--only serving")
#   tests ARCH...     the GPU tests with ARCH's kernels (sm_89 runs an L4's PTX on an H100);
#                     PYTEST_ARGS picks files, FLASHCORE_GPU_EXAMPLES the examples a property
#   split ARCH...     the same tests as one process per test function, SPLIT_JOBS at a time
#                     (default: half the cores) over the host's GPUs: kernels compile on first
#                     use, so this is the fast way without a catalog; a log per function
#   sanitize ARCH...  memcheck, racecheck, synccheck over SANITIZE_MODES (scripts/sanitize.sh)
#                     one after another; with SPLIT_JOBS set, each (tool, mode) as its own
#                     process over the host's GPUs
#   bench             python -m flashcore.bench --quick $BENCH_ARGS: every peer in one run
#   decode            the decode sweep (scripts/decode_sweep.py $DECODE_ARGS)
#   hostprof          eager host time per call of this tree, and of OLD_TREE if set
#   ab                scripts/ab_trees.py: OLD_TREE against this tree ($AB_ARGS)
#   generation        eager generation through transformers at batch 1 and 8 with the
#                     no-attention bound (examples/generate_transformers.py), then
#                     scripts/generation_profile.py at batch ${PROFILE_BATCH:-1}
#   tune              the autotuner into $OUT/sm_90.json, then the quick benchmark with it
#
# A phase's time limit is ${PHASE}_S seconds (BUILD_S, TESTS_S, ...); GPU=i pins the phases to
# GPU i; GPUS=n spreads split and sanitize over GPUs 0..n-1 only (the rest stay free, e.g. for a
# benchmark beside them); JOBS sets the build's workers (default: the host's cores).
set -u
out=${OUT:-bench-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLASHCORE_NO_SHRINK=1
[ -n "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$GPU
cache=${CACHE_ROOT:-/tmp/fc}
status=0
tag=${GPU:+gpu$GPU-}

limit() {  # the phase's time limit: ${PHASE}_S, else the default given
  local var
  var="$(echo "$1" | tr '[:lower:]' '[:upper:]')_S"
  echo "${!var:-$2}"
}

use_arch() {  # kernels of ARCH: its catalog, and FLASHCORE_ARCH unless it is this GPU's own
  export FLASHCORE_CACHE_DIR=$cache-$1
  # a catalog built from other sources is all misses: every kernel would compile here
  [ -f "$cache-$1/index.json" ] && { python3 -m tests.gpu_specs --check "$cache-$1" \
    || echo "gpu.sh: $cache-$1 was built from other sources; its kernels compile again here"; }
  if [ "$1" = "$(python3 -c 'from flashcore.runtime.device import arch_of; print(arch_of(0))' \
                  2>/dev/null)" ]
  then unset FLASHCORE_ARCH; else export FLASHCORE_ARCH=$1; fi
}

summary() {  # the lines of a log worth reading in the call's output
  grep -E "$2" "$1" | tail -"${3:-20}"
}

setup() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    [ -d /tmp/fc-site ] || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/fc-site .whl/*.whl
    export PYTHONPATH=/tmp/fc-site:${PYTHONPATH:-}
  fi
  [ -f /root/dsl/env.sh ] && source /root/dsl/env.sh
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
}

build() {
  local log="$out/build-$1.log"
  ( time timeout -s KILL "$(limit build 300)" python3 -m tests.gpu_specs --arch "$1" \
      --out "$cache-$1" --jobs "${JOBS:-$(nproc)}" ${BUILD_ARGS:---buckets} ) > "$log" 2>&1
  summary "$log" "kernels|real|Error" 4
}

tests() {
  local log="$out/${tag}gpu-tests-$1.log"
  use_arch "$1"
  timeout -s KILL "$(limit tests 300)" python3 -m pytest -m gpu --hypothesis-show-statistics \
    -p no:cacheprovider -q -rfEs ${PYTEST_ARGS:-tests} > "$log" 2>&1
  local rc=$?
  echo "tests $1 exit $rc" | tee -a "$log"
  [ $rc -ne 0 ] && status=1
  summary "$log" "passed|failed|Falsifying|^FAILED|^ERROR" 25
}

split() {
  use_arch "$1"
  local dir="$out/${tag}split-$1" gpus deadline
  mkdir -p "$dir"
  gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  [ "$gpus" -gt 0 ] && [ -z "${GPU:-}" ] || gpus=1
  deadline=$(( $(date +%s) + $(limit split 540) ))
  # test functions, parametrised cases together (they share kernels)
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider ${PYTEST_ARGS:-tests} \
    2>/dev/null | grep '::' | sed 's/\[.*//' | awk '!seen[$0]++' > "$dir/functions"
  awk -v g="$gpus" '{ print (NR - 1) % g, $0 }' "$dir/functions" \
    | DIR=$dir DEADLINE=$deadline PINNED=${GPU:-} xargs -P "${SPLIT_JOBS:-$(( $(nproc) / 2 ))}" \
        -L 1 bash -c '
      node=$1; log="$DIR/$(echo "$node" | tr "/:" "__").log"
      [ -z "$PINNED" ] && export CUDA_VISIBLE_DEVICES=$0
      timeout -s KILL $(( DEADLINE - $(date +%s) )) python3 -m pytest -m gpu -q \
        -p no:cacheprovider -rfEs --hypothesis-show-statistics "$node" > "$log" 2>&1
      rc=$?
      echo "$node rc=$rc $(grep -E "passed|failed|skipped|error" "$log" | tail -1)"
      [ $rc -eq 0 ] || [ $rc -eq 5 ]' | tee "$dir/summary"
  [ "${PIPESTATUS[1]}" -eq 0 ] || status=1
  grep -hE "^(FAILED|ERROR)|Falsifying" "$dir"/*.log | head -20
}

sanitize() {
  use_arch "$1"
  if [ -z "${SPLIT_JOBS:-}" ]; then
    OUT="$out/${tag}sanitize" SANITIZE_S=$(limit sanitize 300) bash scripts/sanitize.sh || status=1
    return
  fi
  local gpus i=0 pids=()
  gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  [ "$gpus" -gt 0 ] && [ -z "${GPU:-}" ] || gpus=1
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    for mode in ${SANITIZE_MODES:-$(bash scripts/sanitize.sh --modes)}; do
      ( [ -z "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$(( i % gpus ))
        OUT="$out/${tag}sanitize" SANITIZE_S=$(limit sanitize 300) SANITIZE_TOOLS=$tool \
          SANITIZE_MODES=$mode bash scripts/sanitize.sh ) &
      pids+=($!); i=$((i + 1))
      if [ ${#pids[@]} -ge "$SPLIT_JOBS" ]; then wait "${pids[0]}" || status=1; pids=("${pids[@]:1}"); fi
    done
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
}

run_phase() {  # a phase without arch words
  case "$1" in
    bench) timeout -s KILL "$(limit bench 400)" python3 -m flashcore.bench --quick \
             ${BENCH_ARGS:-} --out "$out" > "$out/${tag}bench.log" 2>&1
           tail -30 "$out/${tag}bench.log" ;;
    decode) timeout -s KILL "$(limit decode 240)" python3 scripts/decode_sweep.py \
              ${DECODE_ARGS:-} > "$out/${tag}decode-sweep.log" 2>&1
            tail -60 "$out/${tag}decode-sweep.log" ;;
    hostprof) local log="$out/${tag}host-overhead.log"
              timeout -s KILL "$(limit hostprof 120)" python3 scripts/host_overhead.py \
                --tag new > "$log" 2>&1
              if [ -n "${OLD_TREE:-}" ]; then
                (cd "$OLD_TREE" && FLASHCORE_CACHE_DIR=$cache-old PYTHONPATH="$PWD:$PYTHONPATH" \
                   timeout -s KILL "$(limit hostprof 120)" python3 scripts/host_overhead.py \
                   --tag old) >> "$log" 2>&1
              fi
              grep "per call" "$log" ;;
    ab) timeout -s KILL "$(limit ab 330)" python3 scripts/ab_trees.py --old "${OLD_TREE:?}" \
          --new . --old-cache "$cache-old" ${AB_ARGS:-} > "$out/${tag}ab.log" 2>&1
        tail -12 "$out/${tag}ab.log" ;;
    generation) local log="$out/${tag}generation.log"
                for b in 1 8; do
                  timeout -s KILL "$(limit generation 150)" python3 \
                    examples/generate_transformers.py --layers 16 --new 64 --rounds 5 --bound \
                    --batch "$b" 2>&1 | tail -5 | tee -a "$log"
                done
                timeout -s KILL "$(limit generation 150)" python3 scripts/generation_profile.py \
                  --batch "${PROFILE_BATCH:-1}" > "$out/${tag}generation-profile.log" 2>&1
                grep "^round" "$out/${tag}generation-profile.log" ;;
    tune) cp flashcore/tuned/sm_90.json "$out/sm_90.json"
          timeout -s KILL "$(limit tune 240)" python3 -m flashcore.autotune run \
            --out "$out/sm_90.json" ${TUNE_BUCKETS:+--buckets $TUNE_BUCKETS} \
            > "$out/autotune.log" 2>&1
          FLASHCORE_TUNED="$out" timeout -s KILL "$(limit bench 300)" python3 -m flashcore.bench \
            --quick --out "$out" > "$out/bench-tuned.log" 2>&1
          tail -16 "$out/bench-tuned.log" ;;
  esac
}

phase=""
for word in "$@"; do
  case "$word" in
    setup) setup; phase="" ;;
    build|tests|split|sanitize) phase=$word ;;
    bench|decode|hostprof|ab|generation|tune) phase=""; run_phase "$word" ;;
    *) if [ -z "$phase" ]; then echo "gpu.sh: '$word' follows no phase that takes an arch" >&2
         exit 2; fi
       "$phase" "$word" ;;
  esac
done
exit "$status"
