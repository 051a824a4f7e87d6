"""A server parent's thread for the host's limits (`rpycdl serve --limits FILE`): the file read again on SIGHUP or
when it changes and published to the lock directory (a bad file keeps the old limits, and the error is logged),
and each account's GPU-hours refreshed from the ledger for every process that grants (rpycdl.scheduler.limits)."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from rpycdl.defaults import LIMITS_REFRESH
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import limits
from rpycdl.scheduler.ledger import Ledger

log = logging.getLogger("rpycdl.server")


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What changes when the file is written or replaced (None: it cannot be read)."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size, found.st_ino


class LimitsWatch:
    """Keeps the lock directory's limits and usage current while its server lives.

    Args:
        path: the server's --limits file (None: it was given none, and only refreshes the usage of the limits
            another server published).
        root: the lock directory.
        ledger: the host's job ledger, whose jobs' GPU time counts against the GPU-hours limits.
        interval: seconds between two looks at the file and refreshes of the usage.
    """

    def __init__(self, path: str | None, root: Path, ledger: Ledger, interval: float = LIMITS_REFRESH) -> None:
        self.path, self.root, self.ledger, self.interval = path, root, ledger, interval
        self._stamp = None if path is None else _stamp(path)
        self._hup, self._stop = threading.Event(), threading.Event()

    def start(self) -> None:
        """Check once now (the usage is current before the server takes its first job), then run in a daemon
        thread until stop()."""
        self._step()
        threading.Thread(target=self._run, name="rpycdl-limits", daemon=True).start()

    def reload(self) -> None:
        """Read the file again now (SIGHUP's handler: it only sets a flag)."""
        self._hup.set()

    def stop(self) -> None:
        self._stop.set()
        self._hup.set()

    def check(self, now: float | None = None) -> None:
        """One step: the file read again if asked or changed, then the usage refreshed if a GPU-hours limit is in
        force."""
        if self.path is not None and (self._hup.is_set() or _stamp(self.path) != self._stamp):
            self._hup.clear()
            self._stamp = _stamp(self.path)
            try:
                read = limits.read(self.path)
            except InvalidRequestError as exc:
                log.error("the limits file was not read again, the limits in force stay: %s", exc)
            else:
                limits.publish(self.root, read, self.path)
                log.info("limits read again from %s", self.path)
        in_force = limits.in_force(self.root)
        if in_force is not None and in_force.has(*limits.WINDOWS):
            limits.refresh_usage(self.root, self.ledger, time.time() if now is None else now)

    def _run(self) -> None:
        while True:
            self._hup.wait(self.interval)
            if self._stop.is_set():
                return
            self._step()

    def _step(self) -> None:
        try:
            self.check()
        except Exception:  # the limits must never take the server down
            log.exception("refreshing the limits failed")
