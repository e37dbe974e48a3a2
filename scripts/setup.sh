#!/usr/bin/env bash
# Set up a virtual environment in .venv with tgraph (editable) and its test dependencies.
#
# - A torch that is already importable by python3 is kept untouched (the venv sees system packages;
#   TGRAPH_ISOLATED_VENV=1 makes a venv without them).
# - Otherwise, when no CUDA is wanted (no nvidia-smi, or TGRAPH_CUDA=0), the CPU build
#   `torch==2.13.0+cpu` where pip's configured sources reach one, else pip's default build of
#   torch 2.13.0. With CUDA wanted, pip's default build.
# - Only pip's configured sources are used; TGRAPH_EXTRA_INDEX_URL adds an index of your own.
# Environment variables: tgraph/envs.py (`python -m tgraph.envs`).
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
if [ -n "${TGRAPH_EXTRA_INDEX_URL:-}" ]; then
    PIP+=(--extra-index-url "$TGRAPH_EXTRA_INDEX_URL")
fi

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    want_cuda=${TGRAPH_CUDA:-}
    if [ -z "$want_cuda" ]; then
        if command -v nvidia-smi >/dev/null 2>&1; then want_cuda=1; else want_cuda=0; fi
    fi
    if [ "$want_cuda" = "1" ]; then
        "${PIP[@]}" "torch>=2.11"
    else
        # The exact local version never matches a CUDA build.
        "${PIP[@]}" "torch==2.13.0+cpu" || "${PIP[@]}" "torch==2.13.0"
    fi
fi
"${PIP[@]}" -e ".[test]"
