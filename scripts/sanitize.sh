#!/usr/bin/env bash
# compute-sanitizer over every kernel family on ragged shapes (scripts/sanitize_cases.py):
# memcheck, racecheck, synccheck. Logs and a summary go to $OUT (or ./bench-results/sanitize).
#   bash scripts/sanitize.sh                 # the kernels of this GPU's arch
#   FLASHCORE_ARCH=sm_89 bash scripts/sanitize.sh   # an L4's kernels, from PTX, on an H100
#   SANITIZE_MODES="backward-hopper" bash scripts/sanitize.sh   # some of sanitize_cases.py's modes
#   bash scripts/sanitize.sh --modes           # the default modes here
set -uo pipefail
# the default modes: every family's cases, the backward's too (the Hopper backward's on sm_90)
modes="all splits-equal splits-unequal backward backward-deterministic backward-varlen"
if [ -z "${FLASHCORE_ARCH:-}" ] \
    && nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | grep -q '^9\.0'; then
  modes="$modes backward-hopper"
fi
if [ "${1:-}" = --modes ]; then echo "$modes"; exit 0; fi
out=${OUT:-bench-results/sanitize}
mkdir -p "$out"
tag=${FLASHCORE_ARCH:-native}
export PYTHONUNBUFFERED=1
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  for mode in ${SANITIZE_MODES:-$modes}; do
    log="$out/sanitize-$tag-$tool-$mode.log"
    # racecheck prints every report (no backtraces) so that each is grouped and judged
    # (scripts/race_summary.py): a print limit would hide new reports behind known ones
    extra="--print-limit 20"
    [ "$tool" = racecheck ] && extra="--racecheck-report hazard --print-limit 10000000 --show-backtrace no"
    timeout -s KILL "${SANITIZE_S:-300}" compute-sanitizer --tool "$tool" $extra \
      python3 scripts/sanitize_cases.py "$mode" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases ok" "$log" | tr '\n' ' ')
    if [ "$tool" = racecheck ]; then
      python3 scripts/race_summary.py "$log" > "$log.groups" || rc=1
      summary="$summary($(tail -n 2 "$log.groups" | tr '\n' ' '), groups in $log.groups)"
    fi
    echo "$tag $tool $mode rc=$rc: $summary" | tee -a "$out/sanitize-summary.txt"
    [ $rc -ne 0 ] && status=1
  done
done
exit $status
