"""rpycdl: run Python functions on shared GPU servers over RPyC, first come, first served."""

from __future__ import annotations

from rpycdl.client import Connection, connect
from rpycdl.errors import (
    AuthFailedError,
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

__version__ = "0.1.0"

__all__ = [
    "AuthFailedError", "Connection", "connect", "DiscoveryError", "GPUMemoryExceededError", "InvalidRequestError",
    "JobCancelledError", "JobCrashedError", "JobTimeoutError", "LimitError", "NoInventoryError", "NotAllowedError",
    "QueueTimeoutError",
    "RemoteError", "RpycdlError", "VersionMismatchError", "__version__",
]
