#!/usr/bin/env bash
# One command on a fresh machine: install rpycdl in .venv, start a local registry and a server
# (real GPUs through NVML, else a simulated fake:2 inventory), run clients/three_jobs.py, stop, and
# print the next steps. Extra arguments go to `rpycdl demo` (scripts/quickstart.sh --keep).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
started=$SECONDS
if [ ! -x .venv/bin/python ]; then
    echo "quickstart: creating a virtual environment in .venv ($("$PYTHON" --version))"
    "$PYTHON" -m venv .venv
fi
echo "quickstart: installing rpycdl and its server packages into .venv (about a minute the first time)"
# shellcheck source=common.sh
. scripts/common.sh
install_editable .venv/bin/python ".[server]"
echo "quickstart: installed in $((SECONDS - started)) s; starting the demo"
exec .venv/bin/rpycdl demo "$@"
