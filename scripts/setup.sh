#!/usr/bin/env bash
# Set up a virtual environment in .venv with tgraph (editable) and its test dependencies.
#
# - A torch that is already importable by python3 is kept untouched (the venv sees system packages;
#   TGRAPH_ISOLATED_VENV=1 makes a venv without them).
# - Otherwise the CPU build of torch 2.13.0 is installed when no CUDA is wanted (no nvidia-smi, or
#   TGRAPH_CUDA=0): `torch==2.13.0+cpu` from pip's configured sources (a local wheel directory
#   where there is one), else from the PyTorch CPU index. With CUDA wanted, pip's default build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    if [ "${TGRAPH_ISOLATED_VENV:-0}" = "1" ]; then
        "$PYTHON" -m venv .venv
    else
        "$PYTHON" -m venv --system-site-packages .venv
    fi
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
        # The exact local version never matches a CUDA build on PyPI.
        "${PIP[@]}" "torch==2.13.0+cpu" \
            || "${PIP[@]}" "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu \
                   --extra-index-url https://pypi.org/simple
    fi
fi
"${PIP[@]}" -e ".[test]"
