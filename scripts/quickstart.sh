#!/usr/bin/env bash
# One command on a fresh machine: install rpycdl in .venv, start a local registry and a server
# (real GPUs through NVML, else a simulated fake:2 inventory), run clients/three_jobs.py, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck source=common.sh
. scripts/common.sh
install_editable .venv/bin/python ".[server]"
exec .venv/bin/rpycdl demo "$@"
