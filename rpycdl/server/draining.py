"""A server's stop as its connection processes live it (SIGTERM to `rpycdl serve`): the parent stops accepting
and tells each connection process (DRAIN_SIGNAL); from then on that process refuses new jobs with
ServerStoppingError, lets the attached job or session under way run until `--drain-timeout` has passed and
then cancels it, and closes its connection once nothing of its runs past that time. Detached jobs (their
supervisors) are not told: they belong to the host."""

from __future__ import annotations

import signal
import time

from rpycdl.errors import ServerStoppingError

DRAIN_SIGNAL = signal.SIGUSR1
"""What the server parent sends its connection processes when it is told to stop."""

REASON = "its server was told to stop, and its --drain-timeout passed"
"""Why a job or session still running past its server's drain is cancelled."""

_SINCE: list[float | None] = [None]
_TIMEOUT: list[float] = [0.0]


def listen(timeout: float) -> None:
    """In a connection process: begin draining when DRAIN_SIGNAL comes, with `timeout` seconds for what runs."""
    _TIMEOUT[0] = timeout
    signal.signal(DRAIN_SIGNAL, lambda *_: begin())


def begin() -> None:
    """Begin draining now (once: a second signal changes nothing)."""
    if _SINCE[0] is None:
        _SINCE[0] = time.monotonic()


def stopping() -> bool:
    """Whether this process was told its server stops."""
    return _SINCE[0] is not None


def overdue() -> bool:
    """Whether what still runs here has had its --drain-timeout since the server was told to stop."""
    since = _SINCE[0]
    return since is not None and time.monotonic() - since >= _TIMEOUT[0]


def refuse_new_jobs() -> None:
    """Raise ServerStoppingError if this process's server was told to stop.

    Raises:
        ServerStoppingError: saying so, and what to do.
    """
    if stopping():
        raise ServerStoppingError("server stopping: it takes no new job (its jobs under way run on, up to its "
                                  "--drain-timeout); connect again for another server, or the one started in its place")
