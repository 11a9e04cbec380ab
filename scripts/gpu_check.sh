#!/usr/bin/env bash
# Run the GPU tests and the quick benchmark on a CUDA host; logs and records go to $OUT
# (or ./bench-results/gpu). Wheels in .whl/ (platformdirs, pyelftools: pure Python) are installed first
# when present, for hosts without a package index.
#   FLASHCORE_CACHE_DIR=.cache/sm90 bash scripts/gpu_check.sh     # prebuilt kernels, no DSL
set -uo pipefail
out=${OUT:-bench-results/gpu}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fc-site .whl/*.whl && export PYTHONPATH=/tmp/fc-site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import flashcore.cli as c; c.main(['info'])" | tee -a "$out/gpu.txt"
python3 -m pytest -m gpu --hypothesis-show-statistics -p no:cacheprovider -q -rs -s \
  ${PYTEST_ARGS:-tests} 2>&1 | tee "$out/gpu-tests.log"
status=${PIPESTATUS[0]}
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m flashcore.bench --quick --out "$out" 2>&1 | tee "$out/bench.log"
fi
exit "$status"
