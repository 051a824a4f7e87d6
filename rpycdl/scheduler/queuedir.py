"""The lock directory's queue, as rpycdl.scheduler.locks keeps it: each waiting request's entry
(queue/<ticket>.json, written once, read once per process) and wake-up FIFO (queue/<ticket>.fifo, whose
reader is the request's process: none means it died), and the FIFOs of listeners (listeners/<name>.fifo: a
server's dispatcher), woken with the waiters.

A queued detached job's entry is a row: marked `row`, it has no FIFO, so it lives with no process until it is
granted or dropped. A dispatcher claims it by making its FIFO (open_fifo) and hands the descriptor to the
supervisor it starts; a FIFO nobody reads any more is a claim that lapsed (claimed). Methods that change the
queue are called under queue.lock, which the lock manager holds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import lockdir
from rpycdl.units import MiB, format_size

_ENTRIES: dict[str, dict[str, Any]] = {}  # queue entries already read, by path (never rewritten)

HELD_ONLY = ("leader", "owner", "server_process")
"""Keys of a request's info that only its grant's record needs (to find the job after a crash);
its queue entry, which every waiter and status reads, goes without them."""


@dataclass(frozen=True)
class Need:
    """What a request waits for: `ngpus` whole GPUs of `candidates`, or `share_bytes` of one of them.

    Attributes:
        ngpus: how many GPUs, 1 to len(candidates); 1 for a share.
        candidates: UUIDs of the GPUs the request may use (its server's inventory).
        share_bytes: bytes of one GPU for a share, a whole number of MiB (the lock files count
            MiB); 0 for whole GPUs.
        sizes: each candidate's memory in bytes; needed for a share.
        seconds: the job's declared timeout, the longest it holds what it is granted (backfill plans
            with it); None if it declared none.
    """

    ngpus: int
    candidates: tuple[str, ...]
    share_bytes: int = 0
    sizes: Mapping[str, int] = field(default_factory=dict)
    seconds: float | None = None

    def check(self) -> None:
        """Raise InvalidRequestError if it can never be granted."""
        if not 1 <= self.ngpus <= len(self.candidates):
            raise InvalidRequestError(f"cannot lock {self.ngpus} GPUs of {len(self.candidates)}")
        if self.share_bytes:
            if self.ngpus != 1 or any(self.sizes.get(uuid, 0) < MiB for uuid in self.candidates):
                raise InvalidRequestError("a share is of one GPU, with every candidate's size known")
            largest = max(self.sizes[uuid] for uuid in self.candidates)
            if self.share_bytes % MiB or not 0 < self.share_bytes <= largest:
                raise InvalidRequestError(f"cannot lock {self.share_bytes} bytes of a GPU: shares are whole MiB, "
                                          f"and the largest GPU has {format_size(largest)}")

    def entry(self) -> dict[str, Any]:
        """The request as its queue entry says it (the lock files' unit: MiB)."""
        return {"ngpus": self.ngpus, "share_mib": self.share_bytes // MiB, "candidates": list(self.candidates),
                "sizes_mib": {uuid: size // MiB for uuid, size in self.sizes.items()}, "seconds": self.seconds}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> Need:
        """What a queue entry waits for (entry() read back)."""
        return cls(entry["ngpus"], tuple(entry["candidates"]), entry["share_mib"] * MiB,
                   {uuid: mib * MiB for uuid, mib in entry.get("sizes_mib", {}).items()}, entry.get("seconds"))


@dataclass(frozen=True)
class Place:
    """A request's place in line: its ticket, and the descriptor of its wake-up FIFO, which keeps the
    place for as long as some process holds it open."""

    ticket: int
    fifo_fd: int


class QueueDir:
    """The queue/ and listeners/ directories of the lock directory `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._queue = root / "queue"
        self._listeners = root / "listeners"

    def waiters(self, before: int | None = None, prune: bool = True) -> list[dict[str, Any]]:
        """Live waiting requests in ticket order (only those before ticket `before`, if given): rows, and those
        whose process lives; with `prune` (under the queue lock only), removes the others."""
        waiters = []
        names = sorted(lockdir.names(self._queue, "", ".json"))
        listed = {str(self._queue / n) for n in names}
        for path in [p for p in _ENTRIES if p not in listed]:  # granted or gone since
            del _ENTRIES[path]
        for name in names:
            if before is not None and int(name[:-5]) >= before:
                break
            entry = self._queue / name
            info = _ENTRIES.get(str(entry)) or lockdir.read_json(entry)
            fifo = entry.with_suffix(".fifo")
            if info is None or (not info.get("row") and not lockdir.fifo_has_reader(fifo)):
                _ENTRIES.pop(str(entry), None)
                if prune:
                    entry.unlink(missing_ok=True)
                    fifo.unlink(missing_ok=True)
                continue
            _ENTRIES[str(entry)] = info
            waiters.append(info)
        return waiters

    def write(self, ticket: int, entry: dict[str, Any]) -> None:
        """Under the queue lock: the ticket's entry, less the HELD_ONLY keys, with its ticket and time."""
        shown = {key: value for key, value in entry.items() if key not in HELD_ONLY}
        lockdir.write_json(self._queue / f"{ticket:016d}.json", {**shown, "ticket": ticket, "since": time.time()})

    def open_fifo(self, ticket: int) -> int:
        """Under the queue lock: make the ticket's wake-up FIFO; returns a descriptor of it."""
        fifo = self._queue / f"{ticket:016d}.fifo"
        os.mkfifo(fifo)
        os.chmod(fifo, lockdir.fifo_mode())  # others must open it to wake us (and to see we live)
        # O_RDWR keeps the FIFO open for writing too, so it never reads as end-of-file,
        # and writers see a reader for exactly as long as a process holds it.
        return os.open(fifo, os.O_RDWR | os.O_NONBLOCK)

    def remove(self, ticket: int) -> None:
        """Under the queue lock: the ticket's entry and FIFO go."""
        entry = self._queue / f"{ticket:016d}.json"
        entry.unlink(missing_ok=True)
        entry.with_suffix(".fifo").unlink(missing_ok=True)

    def exists(self, ticket: int) -> bool:
        return (self._queue / f"{ticket:016d}.json").exists()

    def claimed(self, ticket: int) -> bool:
        """Under the queue lock: whether a process holds the row's FIFO; one nobody holds is removed."""
        fifo = self._queue / f"{ticket:016d}.fifo"
        if lockdir.fifo_has_reader(fifo):
            return True
        fifo.unlink(missing_ok=True)
        return False

    def drop_row(self, job_id: str) -> bool:
        """Under the queue lock: remove job `job_id`'s row unless a process holds it; whether it did."""
        for entry in self.waiters():
            if entry.get("row") and entry["job_id"] == job_id and not self.claimed(entry["ticket"]):
                self.remove(entry["ticket"])
                return True
        return False

    def rows(self) -> set[str]:
        """The ids of the jobs waiting as rows (claimed or not); no lock."""
        return {entry["job_id"] for entry in self.waiters(prune=False) if entry.get("row")}

    def listen(self, name: str) -> int:
        """A listener's wake-up FIFO, woken with every waiter; returns its descriptor. Those whose process is
        gone are removed here."""
        for stale in lockdir.names(self._listeners, "", ".fifo"):
            if not lockdir.fifo_has_reader(self._listeners / stale):
                (self._listeners / stale).unlink(missing_ok=True)
        fifo = self._listeners / f"{name}.fifo"
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo)
        os.chmod(fifo, lockdir.fifo_mode())
        return os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    def unlisten(self, name: str) -> None:
        """Remove the wake-up FIFO listen() made."""
        (self._listeners / f"{name}.fifo").unlink(missing_ok=True)

    def wake_all(self) -> None:
        """Wake every waiting request so it re-checks the queue, and every listener."""
        for folder in (self._queue, self._listeners):
            for name in lockdir.names(folder, "", ".fifo"):
                lockdir.poke(folder / name)
