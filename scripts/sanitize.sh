#!/usr/bin/env bash
# compute-sanitizer over every kernel family on ragged shapes (scripts/sanitize_cases.py):
# memcheck, racecheck, synccheck. Logs and a summary go to $OUT (or ./bench-results/sanitize).
#   bash scripts/sanitize.sh                 # the kernels of this GPU's arch
#   FLASHCORE_ARCH=sm_89 bash scripts/sanitize.sh   # an L4's kernels, from PTX, on an H100
set -uo pipefail
out=${OUT:-bench-results/sanitize}
mkdir -p "$out"
tag=${FLASHCORE_ARCH:-native}
export PYTHONUNBUFFERED=1
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  for mode in ${SANITIZE_MODES:-all splits-equal splits-unequal}; do
    log="$out/sanitize-$tag-$tool-$mode.log"
    extra=""
    [ "$tool" = racecheck ] && extra="--racecheck-report hazard"
    timeout -s KILL "${SANITIZE_S:-300}" compute-sanitizer --tool "$tool" $extra \
      --print-limit 20 python3 scripts/sanitize_cases.py "$mode" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases ok" "$log" | tr '\n' ' ')
    races=$(grep -c "Race reported" "$log")
    if [ "$tool" = racecheck ] && [ "$races" -gt 0 ] \
        && [ "$races" -eq "$(grep "Race reported" "$log" | grep -c "_k2_")" ]; then
      summary="$summary(every report in a two-key-group kernel: the known one, README)"
    fi
    echo "$tag $tool $mode rc=$rc: $summary" | tee -a "$out/sanitize-summary.txt"
    [ $rc -ne 0 ] && status=1
  done
done
exit $status
