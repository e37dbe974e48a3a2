#!/usr/bin/env bash
# Set up a virtual environment in .venv with tgraph (editable) and its test dependencies.
#
# - A torch that is already importable by python3 is kept untouched (the venv sees system packages).
# - Otherwise the CPU build of torch 2.13.0 is installed when no CUDA is wanted (no nvidia-smi, or
#   TGRAPH_CUDA=0): first from a local wheel directory configured for pip (find-links), else from
#   the PyTorch CPU index. With CUDA wanted, pip's default torch build is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    want_cuda=${TGRAPH_CUDA:-}
    if [ -z "$want_cuda" ]; then
        if command -v nvidia-smi >/dev/null 2>&1; then want_cuda=1; else want_cuda=0; fi
    fi
    if [ "$want_cuda" = "1" ]; then
        "${PIP[@]}" "torch>=2.11"
    else
        "${PIP[@]}" --no-index "torch==2.13.0" 2>/dev/null \
            || "${PIP[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
"${PIP[@]}" -e ".[test]"
