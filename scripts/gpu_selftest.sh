#!/usr/bin/env bash
# GPU self-test for a machine with real NVIDIA GPUs and PyTorch: NVML inventory against nvidia-smi,
# a PyTorch job seeing exactly its granted GPU, a job waiting for a busy GPU, and fractional grants:
# two PyTorch jobs with gpus=0.25 running at once on one GPU, a PyTorch job allocating past its
# quarter getting PyTorch's out-of-memory error, and a job allocating past its quarter outside
# PyTorch (CuPy without its limit if installed, else cudaMalloc through ctypes) stopped by the
# server's memory watchdog. Prints a report; exits non-zero if a check failed. Arguments go to
# `rpycdl selftest` (--report FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# shellcheck source=common.sh
. scripts/common.sh
if ! "$PYTHON" -c 'import rpycdl' 2>/dev/null; then
    install_editable "$PYTHON" ".[server]"
fi
exec "$PYTHON" -m rpycdl selftest "$@"
