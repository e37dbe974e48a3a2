#!/usr/bin/env bash
# One command: set up, lint, then run the test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
# Two pytest-xdist workers: about half the wall time on the 2-core CI machine.
exec .venv/bin/python -m pytest -q -n 2 "$@"
