"""rpycdl: run Python functions on shared GPU servers over RPyC, first come, first served.

The public API: `connect` (and the Connection it returns), every exception a user can see, and
`simulate_memory` for jobs on simulated GPUs. Everything else is reached through its sub-package."""

from __future__ import annotations

from rpycdl.client import Connection, connect
from rpycdl.errors import (
    AuthFailedError,
    ContainerError,
    DiscoveryError,
    GPUMemoryExceededError,
    InvalidRequestError,
    JobCancelledError,
    JobCrashedError,
    JobTimeoutError,
    LimitError,
    NoInventoryError,
    NotAllowedError,
    QueueTimeoutError,
    RemoteError,
    RpycdlError,
    VersionMismatchError,
)
from rpycdl.gpu.inventory import simulate_memory

__version__ = "0.1.0"

__all__ = [
    "AuthFailedError", "Connection", "ContainerError", "DiscoveryError", "GPUMemoryExceededError",
    "InvalidRequestError", "JobCancelledError", "JobCrashedError", "JobTimeoutError", "LimitError", "NoInventoryError",
    "NotAllowedError", "QueueTimeoutError", "RemoteError", "RpycdlError", "VersionMismatchError", "__version__",
    "connect", "simulate_memory",
]
