"""A server's dispatcher: a thread of the server parent that starts the supervisors of the queued detached jobs
of its state directory when their turn comes, or as they reach the head of their line
(rpycdl.scheduler.locks.GPULockManager.dispatch; rpycdl.server.supervisor.start and confirm). Any server of the
lock directory that shares the state directory dispatches them; with none up, they wait."""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Any

from rpycdl.defaults import DISPATCH_SETTLE, WAIT_FALLBACK_POLL
from rpycdl.scheduler import lockdir, procs
from rpycdl.scheduler.queuedir import Place
from rpycdl.server import supervisor
from rpycdl.server.context import ServerContext
from rpycdl.states import JobState

log = logging.getLogger("rpycdl.server")


class Dispatcher:
    """Dispatches for the server of `context`, claiming under `forking` (the lock the server parent forks under),
    its supervisors forked by the server's forkserver (context.launcher)."""

    def __init__(self, context: ServerContext, forking: threading.Lock) -> None:
        self.context, self._forking = context, forking
        self._name = f"dispatcher-{context.server_id}"

    def run(self, stop: threading.Event) -> None:
        """Dispatch until `stop` is set, woken with every waiter (a release, a grant, a submission) and every
        WAIT_FALLBACK_POLL at least. From a claim to its GO it holds the lock the server forks under: a process
        forked meanwhile would inherit the claim's FIFO, and hold the row claimed for its own life, or the GO
        pipe, and keep a supervisor told nothing waiting."""
        ctx = self.context
        wake = ctx.locks.listen(self._name)
        while not stop.is_set():
            with self._forking:
                try:
                    claimed = ctx.locks.dispatch(lambda entry: entry.get("state_dir") == ctx.state_dir)
                except Exception:  # a dispatch must never take the server down
                    log.exception("dispatch failed")
                    claimed = []
                for entry, place in claimed:
                    try:
                        self._start(entry, place)
                    except Exception:  # its claim lapses: the row is dispatched again
                        log.exception("could not start the supervisor of job %s", entry["job_id"])
                    finally:
                        os.close(place.fifo_fd)  # the supervisor holds the claim now, or nobody does
            if select.select([wake], [], [], WAIT_FALLBACK_POLL)[0]:
                time.sleep(DISPATCH_SETTLE)  # a release woke the waiting supervisors too: they go first
            lockdir.drain(wake)

    def close(self) -> None:
        """Remove the wake-up FIFO (the thread ends with the server)."""
        self.context.locks.unlisten(self._name)

    def _start(self, entry: dict[str, Any], place: Place) -> None:
        """Start the supervisor of a row this server claimed, if the row still waits in the ledger with no live
        owner (it may be there a moment after its entry: supervisor.hand_over), and tell it GO once it owns the
        row; a row that ended leaves the queue."""
        ctx = self.context
        record = ctx.ledger.get(entry["job_id"])
        if record is None or record.state is not JobState.PENDING or procs.alive(record.owner_pid,
                                                                                   record.owner_start):
            if record is not None and record.state.finished:
                ctx.locks.leave(entry["ticket"])
            return
        pid, go = supervisor.start(entry, place, ctx.launcher)
        if not supervisor.confirm(ctx.ledger, record, pid, go):
            log.info("job %s was cancelled or started elsewhere as its supervisor started", entry["job_id"])
