#!/usr/bin/env bash
# Run on the GPU machine (no installs there): GPU tests and benchmarks, logs into $OUT.
# Usage: bash scripts/gpu_run.sh [tests PATHS...] | [slow-tests PATHS...] | [kernels]
#        | [models PRESETS...] | [cmd ...]
# The test tiers run on pytest-xdist's 4 workers (one GPU, Triton compiles in parallel); a test
# hung past 15 minutes fails (pytest-timeout) instead of using up the run.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-tests}; shift || true
case "$what" in
  tests)   python3 -m pytest -q -m gpu -n 4 -rf --timeout=900 "${@:-tests}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 ;;
  slow-tests) python3 -m pytest -q -m slow_gpu -n 4 -rf --timeout=900 "${@:-tests}" 2>&1 | tee "$OUT/slow_gpu_tests.log" | tail -60 ;;
  kernels) python3 -m tgraph.bench kernels --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" ;;
  models)  python3 -m tgraph.bench models --json "$OUT/models.json" --png "$OUT/models.png" --presets "$@" 2>&1 | tee "$OUT/models.log" ;;
  *)       "$what" "$@" ;;
esac
