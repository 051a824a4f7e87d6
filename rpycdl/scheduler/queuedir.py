"""The lock directory's queue, as rpycdl.scheduler.locks keeps it: each waiting request's entry
(queue/<ticket>.json, written once, read once per process) and wake-up FIFO (queue/<ticket>.fifo, whose
reader is the request's process: none means it died), and the FIFOs of listeners (listeners/<name>.fifo: a
server's dispatcher), woken with the waiters.

A queued detached job's entry is a row (rows/<ticket>.json, marked `row`): it has no FIFO, so it lives with no
process until it is granted or dropped. A dispatcher claims it by making its FIFO (queue/<ticket>.fifo:
open_fifo) and hands the descriptor to the supervisor it starts; a FIFO nobody reads any more is a claim that
lapsed (claimed). Rows have a directory of their own so that waking the waiters, at each grant and release,
lists only the processes' entries, however many rows wait. An entry that may go before earlier tickets (a priority
above 0, or the `place` of a preempted job requeued: the ticket it had) has a mark beside (ranked/<ticket>, empty), so
that a request under first come, first served, which reads only the entries before its own ticket, also finds the
later ones that go first (ranked) without listing the queue. Methods that change the
queue are called under queue.lock, which the lock manager holds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpycdl.defaults import DISPATCH_AHEAD, DISPATCH_AHEAD_MAX
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import lockdir
from rpycdl.units import MiB, format_size

_ENTRIES: dict[str, dict[str, Any]] = {}  # queue entries already read, by path (never rewritten)

AHEAD_KNOWN = 256
"""A waiter with more entries than this before it lists the directories again rather than look at each."""

AHEAD_PROBE = 64
"""Tickets after the last look's that a look at the entries before a later ticket checks one by one, rather than list
the directories (QueueDir._before)."""

HELD_ONLY = ("leader", "owner", "server_process")
"""Keys of a request's info that only its grant's record needs (to find the job after a crash);
its queue entry, which every waiter and status reads, goes without them."""


TICKET, GRANT = 0, 1
"""Lines of the lock directory's counters file: the last ticket (a place in line) and the last grant's sequence."""


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

    def at_once(self) -> int:
        """How many requests like this one its candidates could run at once (DISPATCH_AHEAD at least,
        DISPATCH_AHEAD_MAX at most): the heads of its line whose supervisors a dispatcher starts before their turn."""
        return max(DISPATCH_AHEAD, min(DISPATCH_AHEAD_MAX, len(self.candidates) // max(1, self.ngpus)))

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

    KEYS = ("ngpus", "share_mib", "candidates", "sizes_mib", "seconds")
    """The keys of its queue entry (entry)."""

    def entry(self) -> dict[str, Any]:
        """The request as its queue entry says it (the lock files' unit: MiB)."""
        return {"ngpus": self.ngpus, "share_mib": self.share_bytes // MiB, "candidates": list(self.candidates),
                "sizes_mib": {uuid: size // MiB for uuid, size in self.sizes.items()}, "seconds": self.seconds}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> Need:
        """What a queue entry waits for (entry() read back)."""
        return cls(entry["ngpus"], tuple(entry["candidates"]), entry["share_mib"] * MiB,
                   {uuid: mib * MiB for uuid, mib in entry.get("sizes_mib", {}).items()}, entry.get("seconds"))


def in_line(entry: Mapping[str, Any]) -> tuple[int, int]:
    """Where a waiting request's entry (or a request's info with its ticket) stands in line, less first: by priority,
    higher first, then by its place (a requeued preempted job's earlier ticket), else its ticket."""
    return -(entry.get("priority") or 0), entry.get("place") or entry["ticket"]


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
        self._rows = root / "rows"
        self._listeners = root / "listeners"
        self._ranked = root / "ranked"
        # The entries found before a ticket, by the ticket: none can appear later, since a ticket is taken and its
        # entry written under one hold of queue.lock, so a waiter looks again only at those (a request at the head
        # of a long queue never lists it again).
        self._ahead: dict[int, list[tuple[str, str]]] = {}
        self._found: dict[str, int] = {}  # the ticket of the last row first_row found, by array

    def waiters(self, before: int | None = None, prune: bool = True) -> list[dict[str, Any]]:
        """Live waiting requests in ticket order (only those before ticket `before`, if given): rows, and those
        whose process lives; with `prune` (under the queue lock only), removes the others. Plain strings, not
        Paths: with thousands of rows every dispatch and status reads them all."""
        known = self._before(before) if before is not None else None
        if known is not None:
            listed = known
        else:
            listed = [(name, f"{folder}/") for folder in (self._queue, self._rows)
                      for name in lockdir.names(folder, "", ".json")]
            if len(_ENTRIES) > 2 * len(listed) + 100:  # forget those granted or gone (names are never reused)
                current = {base + name for name, base in listed}
                for path in [path for path in _ENTRIES if path.startswith(str(self.root)) and path not in current]:
                    del _ENTRIES[path]
            if before is not None:  # the tickets' names sort as their numbers
                bound = f"{before:016d}.json"
                listed = [(name, base) for name, base in listed if name < bound]
        if before is not None:
            self._ahead = {before: listed}
        return self._live(sorted(listed), prune)

    def _before(self, before: int) -> list[tuple[str, str]] | None:
        """The entries (name, folder/) still there before ticket `before`, from those found before the ticket of the
        last look (_ahead: none can appear later) and, for a later ticket (the next row an array's supervisor is
        handed), each ticket between looked at in turn; None if that is no cheaper than listing the directories."""
        for bound, known in self._ahead.items():
            if len(known) <= AHEAD_KNOWN and bound <= before <= bound + AHEAD_PROBE:
                between = [(f"{ticket:016d}.json", f"{folder}/") for ticket in range(bound, before)
                           for folder in (self._queue, self._rows)]
                return [(name, base) for name, base in known + between if os.path.lexists(base + name)]
        return None

    def competing(self, ticket: int, mine: tuple[int, int], everyone: bool) -> list[dict[str, Any]]:
        """The live waiting requests a request of `ticket` whose place is `mine` (in_line) is ordered among (under the
        queue lock): `everyone` (a policy that orders by more than tickets), else those before it and those after it
        that go first (all, for a priority below 0: those of 0 after it go first)."""
        before = None if everyone or mine[0] > 0 else ticket
        found = [waiter for waiter in self.waiters(before=before) if waiter["ticket"] != ticket]
        return found if before is None else found + self.ranked(ticket, mine)

    def placed(self, ticket: int, info: dict[str, Any]) -> dict[str, Any]:
        """A request's `info` with the `place` its entry (a requeued row's: its ticket before) gives it, if any."""
        if "place" in info:
            return info
        for folder in (self._rows, self._queue):
            path = f"{folder}/{ticket:016d}.json"
            entry = _ENTRIES.get(path) or (lockdir.read_json(Path(path)) if os.path.lexists(path) else None)
            if entry is not None and entry.get("place"):
                return {**info, "place": entry["place"]}
        return info

    def ranked(self, after: int, mine: tuple[int, int], prune: bool = True) -> list[dict[str, Any]]:
        """The live waiting requests after ticket `after` that go before a place `mine` (in_line; those marked in
        ranked/), in ticket order; with `prune`, as waiters."""
        listed = []
        for mark in sorted(name for name in lockdir.names(self._ranked, "", "") if name > f"{after:016d}"):
            found = [(f"{mark}.json", f"{folder}/") for folder in (self._queue, self._rows)
                     if os.path.lexists(f"{folder}/{mark}.json")]
            if not found and prune:  # its entry's maker died between the two
                (self._ranked / mark).unlink(missing_ok=True)
            listed += found
        return [info for info in self._live(listed, prune) if in_line(info) < mine]

    def _live(self, listed: list[tuple[str, str]], prune: bool) -> list[dict[str, Any]]:
        """The entries of `listed` (name, folder/) that live: rows, and those whose process lives; with `prune`,
        removes the others."""
        waiters = []
        for name, base in listed:
            entry = base + name
            info = self._entry(entry)
            if info is None or (not info.get("row") and not lockdir.fifo_has_reader(Path(entry[:-5] + ".fifo"))):
                _ENTRIES.pop(entry, None)
                if prune:
                    self.remove(int(name[:-5]))
                continue
            waiters.append(info)
        return waiters

    def write(self, ticket: int, entry: dict[str, Any]) -> None:
        """Under the queue lock: the ticket's entry (a row's in rows/, so that waking the requests' FIFOs never
        lists the rows, made in one write: a reader meanwhile sees none), less the HELD_ONLY keys, with its ticket
        and time."""
        shown = {key: value for key, value in entry.items() if key not in HELD_ONLY}
        path = (self._rows if entry.get("row") else self._queue) / f"{ticket:016d}.json"
        text = json.dumps({**shown, "ticket": ticket, "since": time.time()})
        if (entry.get("priority") or 0) > 0 or entry.get("place"):  # marked first: a reader finds the mark, then the
            # entry, or neither
            lockdir.shared_file(self._ranked / f"{ticket:016d}", b"")
        if entry.get("row"):  # made once under the queue lock, which waiters' pruning holds: lockdir.new_file
            lockdir.new_file(path, text.encode())
        else:
            lockdir.shared_file(path, text.encode())
        _ENTRIES[str(path)] = json.loads(text)  # as a reader reads it (an entry is never rewritten)

    def open_fifo(self, ticket: int) -> int:
        """Under the queue lock: make the ticket's wake-up FIFO; returns a descriptor of it."""
        return _make_fifo(self._queue / f"{ticket:016d}.fifo")

    def remove(self, ticket: int) -> None:
        """Under the queue lock: the ticket's entry and FIFO go."""
        for path in (self._queue / f"{ticket:016d}.json", self._rows / f"{ticket:016d}.json",
                     self._queue / f"{ticket:016d}.fifo", self._ranked / f"{ticket:016d}"):
            path.unlink(missing_ok=True)

    def exists(self, ticket: int) -> bool:
        return any((folder / f"{ticket:016d}.json").exists() for folder in (self._queue, self._rows))

    def claimed(self, ticket: int) -> bool:
        """Under the queue lock: whether a process holds the row's FIFO; one nobody holds is removed."""
        fifo = self._queue / f"{ticket:016d}.fifo"
        if lockdir.fifo_has_reader(fifo):
            return True
        fifo.unlink(missing_ok=True)
        return False

    def drop_rows(self, job_ids: Container[str]) -> set[str]:
        """Under the queue lock: remove the rows of the jobs `job_ids` that no process holds; their ids."""
        dropped = set()
        for entry in self.waiters():
            if entry.get("row") and entry["job_id"] in job_ids and not self.claimed(entry["ticket"]):
                self.remove(entry["ticket"])
                dropped.add(entry["job_id"])
        return dropped

    def first_row(self, array_id: str) -> dict[str, Any] | None:
        """Under the queue lock: the entry of the array's first row in line (in_line: a requeued element keeps its
        place) that no process holds, if any. Rows not marked in ranked/ go by their tickets (an array's elements
        share its priority): the first of them is looked for among the AHEAD_PROBE tickets after the one this
        process found last (an array's elements take consecutive tickets), else in the listing, in order. (One
        before those, whose claim lapsed, would be ahead of the one found: the grant refuses that one.)"""
        ranked = set(lockdir.names(self._ranked, "", ""))

        def free(info: dict[str, Any] | None) -> bool:
            return info is not None and info.get("array_id") == array_id and not self.claimed(info["ticket"])

        def unranked(names: Iterable[str]) -> Iterator[dict[str, Any] | None]:
            return (self._entry(f"{self._rows}/{name}") for name in names if name[:-5] not in ranked)

        found = [info for info in (self._entry(f"{self._rows}/{mark}.json") for mark in ranked
                                   if os.path.lexists(f"{self._rows}/{mark}.json")) if free(info)]
        last = self._found.get(array_id)
        after = (name for name in (f"{ticket:016d}.json" for ticket in range(last + 1, last + 1 + AHEAD_PROBE))
                 if os.path.lexists(f"{self._rows}/{name}")) if last is not None else iter(())  # up to the first
        first = next((info for info in unranked(after) if free(info)), None) or next(
            (info for info in unranked(sorted(lockdir.names(self._rows, "", ".json"))) if free(info)), None)
        chosen = min([*found, first] if first is not None else found, key=in_line, default=None)
        if chosen is not None:
            self._found[array_id] = chosen["ticket"]
        return chosen

    def has_row(self, array_id: str) -> bool:
        """Whether a row of the array `array_id` is in line (claimed or not); no lock. The listing is read only up to
        the first (an array's rows are most of a long queue's)."""
        with os.scandir(self._rows) as listing:
            return any(info is not None and info.get("array_id") == array_id for info in (
                self._entry(entry.path) for entry in listing if entry.name.endswith(".json")))

    def rows(self) -> set[str]:
        """The ids of the jobs waiting as rows (claimed or not); no lock. Each entry is read once per process: an
        array's submit asks again at every hold of the lock."""
        return {info["job_id"] for info in self.row_entries()}

    def row_entries(self) -> Iterator[dict[str, Any]]:
        """The entries of the rows in line (claimed or not), as rows() reads them."""
        for name in lockdir.names(self._rows, "", ".json"):
            info = self._entry(f"{self._rows}/{name}")
            if info is not None:
                yield info

    @staticmethod
    def _entry(path: str) -> dict[str, Any] | None:
        """The entry at `path`, read once per process (an entry is never rewritten); None if it is gone or empty."""
        info = _ENTRIES.get(path) or lockdir.read_json(Path(path))
        if info is not None:
            _ENTRIES[path] = info
        return info

    def listen(self, name: str) -> int:
        """A listener's wake-up FIFO, woken with every waiter; returns its descriptor. Those whose process is
        gone are removed here."""
        for stale in lockdir.names(self._listeners, "", ".fifo"):
            if not lockdir.fifo_has_reader(self._listeners / stale):
                (self._listeners / stale).unlink(missing_ok=True)
        fifo = self._listeners / f"{name}.fifo"
        fifo.unlink(missing_ok=True)
        return _make_fifo(fifo)

    def unlisten(self, name: str) -> None:
        """Remove the wake-up FIFO listen() made."""
        (self._listeners / f"{name}.fifo").unlink(missing_ok=True)

    def wake_all(self, requests: bool = True) -> None:
        """Wake every listener, and every waiting request (unless not `requests`) so it re-checks the queue."""
        for folder in (self._queue, self._listeners) if requests else (self._listeners,):
            for name in lockdir.names(folder, "", ".fifo"):
                lockdir.poke(folder / name)


def _make_fifo(fifo: Path) -> int:
    """Make a wake-up FIFO that others may open (to wake its reader, and to see it lives); returns a descriptor of
    it. O_RDWR keeps it open for writing too, so it never reads as end-of-file, and writers see a reader for
    exactly as long as a process holds it."""
    os.mkfifo(fifo)
    os.chmod(fifo, lockdir.fifo_mode())
    return os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
