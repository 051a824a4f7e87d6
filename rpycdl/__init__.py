"""rpycdl: run Python functions on shared GPU servers over RPyC, first come, first served."""

from __future__ import annotations

from rpycdl.client import Connection, connect
from rpycdl.errors import (
                           DiscoveryError,
                           InvalidRequestError,
                           JobCancelledError,
                           JobCrashedError,
                           JobTimeoutError,
                           NoInventoryError,
                           QueueTimeoutError,
                           RemoteError,
                           RpycdlError,
                           VersionMismatchError,
)

__version__ = "0.1.0"

__all__ = [
    "Connection", "connect", "DiscoveryError", "InvalidRequestError", "JobCancelledError", "JobCrashedError",
    "JobTimeoutError", "NoInventoryError", "QueueTimeoutError", "RemoteError", "RpycdlError",
    "VersionMismatchError", "__version__",
]
