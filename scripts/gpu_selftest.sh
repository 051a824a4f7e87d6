#!/usr/bin/env bash
# GPU self-test for a machine with real NVIDIA GPUs and PyTorch: NVML inventory against nvidia-smi,
# a PyTorch job seeing exactly its granted GPU, and a job waiting for a busy GPU. Prints a report;
# exits non-zero if a check failed. Arguments go to `rpycdl selftest` (--report FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import rpycdl' 2>/dev/null; then
    "$PYTHON" -m pip install -q --disable-pip-version-check -e .
fi
exec "$PYTHON" -m rpycdl selftest "$@"
