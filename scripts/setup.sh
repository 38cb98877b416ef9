#!/usr/bin/env bash
# Idempotent set-up behind `make demo`, `make test` and `make docs`: a virtual environment in .venv
# with the package installed in editable mode plus its test and docs extras.
#
# torch comes first: with no torch present, pip would resolve `torch` from DeepSpeed/Lightning to a
# multi-GB CUDA build. On a machine without torch we install the CPU wheel (override with
# RESIHP_TORCH_SPEC, e.g. RESIHP_TORCH_SPEC="torch==2.5.1" or a CUDA index URL of your own).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RESIHP_VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${RESIHP_TORCH_SPEC:-torch==2.13.0}
STAMP="$VENV/.resihp-setup-stamp"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_SPEC (CPU wheel first, so no CUDA build is pulled in)"
    "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
fi

want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
have=$(cat "$STAMP" 2>/dev/null || true)
if [ "$want" != "$have" ]; then
    echo "[setup] installing resihp-lightning and its dependencies"
    "$VENV/bin/python" -m pip install --quiet -e '.[test,docs]'
    echo "$want" > "$STAMP"
fi
