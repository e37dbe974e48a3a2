#!/usr/bin/env bash
# One command: set up, then run the main job (tgraph's demo) on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m tgraph demo "$@"
