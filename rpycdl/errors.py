"""Exceptions raised by rpycdl, on the server and re-raised on the client."""

from __future__ import annotations

import importlib.util
import types
from typing import Any


class RpycdlError(Exception):
    """Base class of every error rpycdl raises itself. IPython shows one without rpycdl's own frames
    (`_render_traceback_`)."""

    def _render_traceback_(self) -> list[str]:
        return short_traceback(self)


def short_traceback(exc: BaseException) -> list[str]:
    """What IPython shows of `exc` (its `_render_traceback_`): its traceback as IPython formats it, less the
    frames that hide themselves (`__tracebackhide__`: rpycdl's, IPython's own), so that the last one shown
    is the caller's, not rpycdl's (IPython shows the last frame even when it hides itself).

    Raises:
        ImportError: not in IPython (which then formats it as usual).
    """
    from IPython import get_ipython  # only ever called by IPython

    shell = get_ipython()
    if shell is None:
        raise ImportError("not in IPython")
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_locals.get("__tracebackhide__"):
            frames.append(tb)
        tb = tb.tb_next
    kept = None
    for frame in reversed(frames):
        kept = types.TracebackType(kept, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return shell.InteractiveTB.structured_traceback(type(exc), exc, kept, tb_offset=0)


class InvalidRequestError(RpycdlError, ValueError):
    """A request that can never be served: bad ngpus, bad timeout, unreadable callable."""


class NoInventoryError(RpycdlError):
    """No GPU inventory could be loaded (NVML failed and no simulated one was asked for)."""


class LimitError(RpycdlError):
    """A request over one of the server's limits (the message names the limit and its option), or
    one the machine has no process to spare for."""


class ConnectionDroppedError(LimitError):
    """The server dropped the connection before authenticating it, as a busy server does (--max-startups,
    --per-source-startups); the client connects again within its connect timeout, and raises this only
    once that has passed."""


class OutputLimitError(LimitError):
    """A job left more in its output directory than the server's --max-output, and was stopped; what it
    wrote is kept (uploaded as any job's outputs)."""


class QueueTimeoutError(RpycdlError, TimeoutError):
    """A request waited longer than its queue_timeout for its GPUs."""


class JobTimeoutError(RpycdlError, TimeoutError):
    """A job ran longer than its timeout and was stopped."""


class ServerStoppingError(RpycdlError):
    """The server was told to stop: it takes no new job on this connection (another server, or the one started
    in its place, does: connect again)."""


class JobCancelledError(RpycdlError):
    """A job was cancelled (by its owner, an operator, or the client going away)."""


class IdleReclaimedError(RpycdlError):
    """A job or session whose GPUs showed no utilization for the server's --idle-reclaim was ended, so that others
    get them (a detached job with retries left is requeued instead); ask with idle_reclaim=False to keep them."""


class PreemptedError(JobCancelledError):
    """A job was preempted: a waiting job of a higher priority needed its GPUs (`rpycdl serve --preempt`). An attached
    job or a session ends so; a detached one too under `--preempt cancel` (under `--preempt requeue` it is requeued,
    and resumes from what it saved: rpycdl.on_preempt, rpycdl.attempt())."""


class JobCrashedError(RpycdlError):
    """The job process ended without a result (killed by a signal, or exited early)."""


class GPUMemoryExceededError(RpycdlError):
    """A job on a share of a GPU used more memory than its grant plus the allowance, and was stopped."""


class HostMemoryExceededError(RpycdlError):
    """A job used all the host memory its cgroup allows (its memory=, or the server's --job-memory), and the
    kernel stopped it; the message names the limit and its peak."""


class GPUNotGrantedError(RpycdlError):
    """A job used a GPU it was not granted (it reset CUDA_VISIBLE_DEVICES), and was stopped."""


class JobLostError(RpycdlError):
    """A detached job's supervising process died before the job ended: its outcome is unknown."""


class DependencyError(RpycdlError):
    """A detached job's dependency (submit's `after=`) cannot be met: the job it waits for ended the wrong way, so
    it never runs; the message names the dependency and how it ended. Also a submit refused for that reason."""


class JobNotFinishedError(RpycdlError):
    """A detached job's result was asked for without waiting, and the job has not ended yet."""


class ResultIntegrityError(RpycdlError):
    """A detached job's result was refused, nothing of it unpickled: its result file was not written by the job
    (its seal does not match the key the client gave the job at submit: the file was replaced or changed on
    the server; security.results). `job.result(verify=False)` unpickles it anyway, which runs whatever code it
    holds: only for a result you trust."""


class UnverifiableResultError(ResultIntegrityError):
    """A detached job's result cannot be verified by this client, so it was refused, nothing of it unpickled:
    the job was sealed with another client's key (submitted from another machine or account; an admin reading
    another user's job), or has no seal (submitted before sealed results), or the server predates them.
    `job.result(verify=False)` unpickles it unverified: only for a result you trust."""


class LedgerError(RpycdlError):
    """The job ledger cannot be used (missing, corrupted, from a newer rpycdl): the message names its file."""


class VersionMismatchError(RpycdlError):
    """Client and server run different Python minor versions, so dill cannot move code."""


class AuthFailedError(RpycdlError):
    """Client and server could not authenticate each other: a wrong or missing shared secret or
    certificate, a certificate the other side does not trust, or a server that asks for none."""


class NotAllowedError(RpycdlError, PermissionError):
    """The authenticated user may not do this (e.g. cancel another user's job without being an admin)."""


class MissingExtraError(RpycdlError):
    """What this install of rpycdl lacks for a command: the message names the extra to install."""


def require_extra(extra: str, *modules: str) -> None:
    """Refuse, naming the extra to install (`pip install 'rpycdl[server]'`), what needs modules this
    install lacks; a client-only install (plain `pip install rpycdl`) has no server or site modules.

    Raises:
        MissingExtraError: one of `modules` cannot be imported.
    """
    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtraError(f"this needs rpycdl's {extra} extra ({', '.join(missing)} is not installed): "
                                f"pip install 'rpycdl[{extra}]'")


class DiscoveryError(RpycdlError):
    """No live server of the requested service could be found."""


class ConnectionFailedError(RpycdlError, ConnectionError):
    """A server could not be reached (refused, unreachable, timed out, a host name that does not resolve),
    or the connection to it broke: the message names its address. Also a ConnectionError (an OSError) whose
    `errno` is the socket's, and the kind of OSError the socket raised where there was one
    (ConnectionRefusedError, TimeoutError, socket.gaierror, ...: `connection_failed` makes it), so that code
    catching those still does.

    Attributes:
        address: the server's (host, port).
    """

    _kind: type[OSError] | None = None  # the OSError subclass mixed in, by connection_failed

    def __init__(self, message: str, address: tuple[str, int] | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.errno = errno  # without strerror: str() stays the message

    def __str__(self) -> str:  # the message, whatever the kind mixed in says of its arguments
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self._kind is not None:
            return connection_failed, (str(self), self.address, self._kind, self.errno)
        return type(self), (str(self), self.address, self.errno)


_KINDS: dict[type[OSError], type[ConnectionFailedError]] = {}


def connection_failed(message: str, address: tuple[str, int] | None, kind: type[OSError] | None = None,
                      errno: int | None = None) -> ConnectionFailedError:
    """A ConnectionFailedError that is also a `kind` of OSError (the one a socket raised: ConnectionRefusedError,
    TimeoutError, socket.gaierror, ...), so that code catching that kind still does."""
    if kind is None or kind in (OSError, ConnectionError) or issubclass(kind, RpycdlError):
        return ConnectionFailedError(message, address, errno)
    if kind not in _KINDS:
        try:
            _KINDS[kind] = type("ConnectionFailedError", (ConnectionFailedError, kind),
                                {"__module__": __name__, "__doc__": ConnectionFailedError.__doc__, "_kind": kind})
        except TypeError:  # a kind whose layout does not mix: the plain one
            return ConnectionFailedError(message, address, errno)
    return _KINDS[kind](message, address, errno)


class ConnectionLostError(ConnectionFailedError, EOFError):
    """The connection to a server closed while a call waited for its answer (the server or its connection
    process died, or the network dropped it): an attached job on it is cancelled with it. Also an EOFError,
    as RPyC raises for a connection that ends."""


class UploadTimeoutError(RpycdlError, TimeoutError):
    """A job's outputs were still uploading to the artifact store when a download's timeout passed: try
    again later (`rpycdl artifacts JOB` says where they stand)."""


class RemoteError(RpycdlError):
    """A remote exception whose type could not be rebuilt on the client.

    Attributes:
        type_name: qualified name of the remote exception type.
        remote_traceback: the formatted traceback from the server.
    """

    def __init__(self, type_name: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        return RemoteError, (self.type_name, self.message, self.remote_traceback)


class ContainerError(RpycdlError):
    """A job container exited with a non-zero code; the message ends with its last log lines."""

    def __init__(self, message: str, exit_code: int = -1, log_tail: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.log_tail = log_tail

    def __reduce__(self) -> tuple[type, tuple[str, int, str]]:
        return type(self), (str(self), self.exit_code, self.log_tail)


class ArtifactStoreError(RpycdlError):
    """The artifact store could not be reached or refused an operation (down, refused credentials, no
    such bucket, not writable), or a file changed while it was uploaded (not put in place); the files to
    upload stay where they were."""
