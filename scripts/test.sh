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
"$VENV/bin/ruff" check rpycdl servers clients scripts tests bench
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
