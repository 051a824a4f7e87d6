"""rpycdl: run Python functions on shared GPU servers over RPyC, first come, first served.

The public API: `connect` (and the Connection it returns), `job` (a detached job's handle, found by
id or name), job states, every exception a user can see, `output_dir` inside a job, and
`simulate_memory` for jobs on simulated GPUs. Everything else is reached through its sub-package."""

from __future__ import annotations

import os

from rpycdl.client import Connection, Job, JobStatus, connect, job
from rpycdl.defaults import OUTPUT_DIR_VARIABLE
from rpycdl.errors import (
    AuthFailedError,
    ContainerError,
    DiscoveryError,
    GPUMemoryExceededError,
    InvalidRequestError,
    JobCancelledError,
    JobCrashedError,
    JobLostError,
    JobNotFinishedError,
    JobTimeoutError,
    LedgerError,
    LimitError,
    NoInventoryError,
    NotAllowedError,
    QueueTimeoutError,
    RemoteError,
    RpycdlError,
    VersionMismatchError,
)
from rpycdl.gpu.inventory import simulate_memory
from rpycdl.states import JobState

__version__ = "0.1.0"

__all__ = [
    "AuthFailedError", "Connection", "ContainerError", "DiscoveryError", "GPUMemoryExceededError",
    "InvalidRequestError", "Job", "JobCancelledError", "JobCrashedError", "JobLostError", "JobNotFinishedError",
    "JobState", "JobStatus", "JobTimeoutError", "LedgerError", "LimitError", "NoInventoryError", "NotAllowedError",
    "QueueTimeoutError", "RemoteError", "RpycdlError", "VersionMismatchError", "__version__", "connect", "job",
    "output_dir", "simulate_memory",
]


def output_dir() -> str:
    """Inside a job: its output directory, whose files go to the site's artifact store when the job ends
    (under your user and the job's id; `job.download()` fetches them).

    Raises:
        RuntimeError: not called inside an rpycdl job.
    """
    path = os.environ.get(OUTPUT_DIR_VARIABLE)
    if not path:
        raise RuntimeError(f"rpycdl.output_dir() is for code running as an rpycdl job (${OUTPUT_DIR_VARIABLE} "
                           "is not set)")
    return path
