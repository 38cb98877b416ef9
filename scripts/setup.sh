#!/usr/bin/env bash
# Idempotent set-up behind `make demo`, `make test` and `make docs`: a virtual environment in .venv
# with the package installed in editable mode plus its test and docs extras.
#
# The installs go through uv (put into the venv by pip; it resolves the same versions as pip, in a
# tenth of the time: about 20 s instead of 90 s on a 2-core machine) and fall back to pip where uv
# cannot be installed (RESIHP_INSTALLER=pip forces pip). torch comes first: with no torch present,
# the resolver would take `torch` for DeepSpeed/Lightning from PyPI, a multi-GB CUDA build. On a
# machine without torch we install TORCH_SPEC (default torch==2.13.0: the CPU wheel where pip's
# find-links hold it; RESIHP_TORCH_SPEC may carry options, e.g. "--index-url URL torch==2.13.0");
# pip's find-links (PIP_FIND_LINKS, or `pip config` global.find-links) are handed to uv as well.
# Bytecode is compiled at install: where PYTHONDONTWRITEBYTECODE is set, every process would
# otherwise compile what it imports again (12 s instead of 5 s to import the strategy).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RESIHP_VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${RESIHP_TORCH_SPEC:-torch==2.13.0}
INSTALLER=${RESIHP_INSTALLER:-uv}
STAMP="$VENV/.resihp-setup-stamp"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi

case "$INSTALLER" in
    uv|pip) ;;
    *) echo "[setup] RESIHP_INSTALLER=$INSTALLER: expected uv or pip" >&2; exit 2 ;;
esac
if [ "$INSTALLER" = uv ] && [ ! -x "$VENV/bin/uv" ]; then
    "$VENV/bin/python" -m pip install --quiet uv || {
        echo "[setup] uv could not be installed: installing with pip"
        INSTALLER=pip
    }
fi

# install ARGS...: into the venv, with uv (pip's find-links passed on) or pip.
install() {
    if [ "$INSTALLER" = uv ]; then
        local links=() link
        for link in ${PIP_FIND_LINKS:-$("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null || true)}; do
            links+=(--find-links "$link")
        done
        "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python" "${links[@]}" "$@"
    else
        "$VENV/bin/python" -m pip install --quiet "$@"
    fi
}

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing $TORCH_SPEC first (so that no other torch build is pulled in)"
    # shellcheck disable=SC2086  # the spec may carry options (--index-url URL torch==X)
    install $TORCH_SPEC
fi

want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
have=$(cat "$STAMP" 2>/dev/null || true)
if [ "$want" != "$have" ]; then
    echo "[setup] installing resihp-lightning and its dependencies ($INSTALLER)"
    install -e '.[test,docs]'
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
