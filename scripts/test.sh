#!/usr/bin/env bash
# One command on a fresh machine: install rpycdl with its test tools in .venv, lint, run every test.
# Extra arguments go to pytest (scripts/test.sh -k locks -x).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/ruff check rpycdl servers clients scripts tests bench
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
