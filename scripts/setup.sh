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

# etcd, for the tests of the replicated fail-stop store (docs/machines.md). Best effort: only as root
# with apt-get (Debian's etcd-server, etcd-client); anywhere else those tests skip and say why.
# RESIHP_SKIP_ETCD=1 skips it (on a machine with systemd the package also starts a system etcd).
if ! command -v etcd >/dev/null 2>&1 && [ -z "${RESIHP_SKIP_ETCD:-}" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "[setup] installing etcd-server and etcd-client (apt-get)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends etcd-server etcd-client >/dev/null 2>&1 \
            || echo "[setup] etcd not installed (apt-get failed): the etcd store tests will skip"
    else
        echo "[setup] etcd not installed (needs root and apt-get): the etcd store tests will skip"
    fi
fi
