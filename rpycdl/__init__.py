"""rpycdl: run Python functions on shared GPU servers over RPyC, first come, first served.

The public API: `connect` (and the Connection it returns), `job` (a detached job's handle, found by
id or name), job states, every exception a user can see, `output_dir`, `save_artifact`, `attempt`, `on_preempt` and
`preempting` inside a job, and `simulate_memory` for jobs on simulated GPUs. Everything else is reached through its
sub-package."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from rpycdl.artifacts import saving
from rpycdl.defaults import ATTEMPT_VARIABLE, OUTPUT_DIR_VARIABLE
from rpycdl.errors import (
    ArtifactStoreError,
    AuthFailedError,
    ConnectionDroppedError,
    ConnectionFailedError,
    ConnectionLostError,
    ContainerError,
    DependencyError,
    DiscoveryError,
    GPUMemoryExceededError,
    GPUNotGrantedError,
    HostMemoryExceededError,
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
    OutputLimitError,
    PreemptedError,
    QueueTimeoutError,
    RemoteError,
    ResultIntegrityError,
    RpycdlError,
    ServerStoppingError,
    UnverifiableResultError,
    UploadTimeoutError,
    VersionMismatchError,
)
from rpycdl.gpu.inventory import simulate_memory
from rpycdl.gpu.preempt import on_preempt, preempting
from rpycdl.states import JobState

if TYPE_CHECKING:
    from rpycdl.client import ArrayJob, Connection, Job, JobStatus, Session, connect, job

__version__ = "0.1.0"

_CLIENT = ("ArrayJob", "Connection", "Job", "JobStatus", "Session", "connect", "job")
"""Names of rpycdl.client, imported when first asked for: the server's own processes (supervisors, keepers,
job processes) start without the client's modules."""


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from rpycdl import client

        return getattr(client, name)
    raise AttributeError(f"module 'rpycdl' has no attribute {name!r}")

__all__ = [
    "ArrayJob", "ArtifactStoreError", "AuthFailedError",
    "Connection", "ConnectionDroppedError", "ConnectionFailedError",
    "ConnectionLostError", "ContainerError", "DependencyError", "DiscoveryError", "GPUMemoryExceededError",
    "GPUNotGrantedError",
    "HostMemoryExceededError", "InvalidRequestError", "Job",
    "JobCancelledError", "JobCrashedError", "JobLostError", "JobNotFinishedError",
    "JobState", "JobStatus", "JobTimeoutError", "LedgerError", "LimitError", "NoInventoryError", "NotAllowedError",
    "OutputLimitError", "PreemptedError", "QueueTimeoutError", "RemoteError", "ResultIntegrityError", "RpycdlError",
    "ServerStoppingError", "Session", "UnverifiableResultError",
    "UploadTimeoutError", "VersionMismatchError",
    "__version__", "array_index", "attempt", "connect", "job", "on_preempt", "output_dir", "preempting",
    "save_artifact", "simulate_memory",
]


def array_index() -> int | None:
    """Inside an array's element (submit_array, rpycdl submit --array): its index in its array; None elsewhere."""
    from rpycdl.defaults import ARRAY_INDEX_VARIABLE

    value = os.environ.get(ARRAY_INDEX_VARIABLE)
    return None if value is None else int(value)


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


def attempt() -> int:
    """Inside a job: which attempt of it this is, 1 for the first. A detached job submitted with `retries=` is
    requeued when its server or supervisor dies while it runs, or a signal kills it (`retry_on_failure=True`: also
    when it raised); its next attempt sees 2, then 3, with the same output directory (rpycdl.output_dir()), so that
    it can resume from what an earlier attempt saved there. Outside a job (nothing set it): 1, so that code run
    both locally and as a job starts afresh."""
    try:
        return max(1, int(os.environ.get(ATTEMPT_VARIABLE, "1")))
    except ValueError:
        return 1


def save_artifact(path: str | os.PathLike[str], name: str | None = None) -> str:
    """Inside a job: upload the file `path` to the job's artifacts now (a checkpoint), so that it is kept
    however the job ends. `path` is a file under the job's output directory (rpycdl.output_dir()) or its
    working directory; it is put in the output directory under `name` (default: its path under the
    directory that holds it; hard-linked, else copied) and the server that owns the job uploads it to
    the artifact store with its own credentials, lists it (`job.artifacts()`), and returns once it is
    there. Saving a name again replaces the artifact; a file saved and unchanged at the job's end is not
    uploaded twice. Do not change the file until this returns (call it from a thread of yours to train on
    meanwhile): a file that changes while it is read is not put in place.

    Returns:
        The artifact's name.

    Raises:
        InvalidRequestError: `path` is outside the job's own directories, not a regular file, or a symbolic
            link is on its way (not followed); `name` is not a relative path.
        ArtifactStoreError: the store failed, or the file changed while it was read: not saved now, but
            it stays in the output directory, which goes up when the job ends.
        RuntimeError: not called inside an rpycdl job, or inside a container job (not supported).
    """
    return saving.save_artifact(path, name)
