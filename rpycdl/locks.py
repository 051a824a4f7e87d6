"""The GPU lock manager: first-come-first-served grants of whole GPUs with fasteners file locks.

Everything lives in one lock directory shared by every server of a host (and mounted into
every container):

    gpus/<uuid>.lock     held (fcntl lock, through fasteners) by the process that holds the GPU
    held/<uuid>.json     who holds it: job id, client, server, since (for status only)
    queue/<ticket>.json  a waiting request: what it asks for and who it is
    queue/<ticket>.fifo  its wake-up pipe; a request that has died has no reader on it
    queue.lock           serialises taking tickets, granting and probing
    counters             the last ticket and the last grant sequence number, one line each

Arrival order is the ticket order. A request is granted when the GPUs it may use are free
after every earlier request has been served or has reserved what it waits for (so a later
request never overtakes an earlier one that competes for the same GPUs, while servers with
disjoint GPUs do not block each other). An earlier competing request that could be granted
now goes first, the later one waiting for its wake-up, so competing requests are granted
(numbered by Grant.sequence) in arrival order. A release, a grant and a cancelled wait write
a byte to every waiter's FIFO, so the next request is granted at once, not at the next poll.

What the locks do not guarantee: they are fcntl locks, so they belong to a process (one
process must not open a held GPU's lock file twice; this module keeps a registry so it never
does), and they are freed by the kernel when the holder dies, without any wake-up: waiters
re-check at least every WAIT_FALLBACK_POLL seconds, and a server parent that sees one of
its connection processes die wakes them at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fasteners

from rpycdl.defaults import WAIT_FALLBACK_POLL
from rpycdl.errors import InvalidRequestError, QueueTimeoutError

# GPU locks held by this process, by uuid. fcntl locks are per process, so a second
# open-and-close of the same file here would silently drop the first lock.
_HELD: dict[str, fasteners.InterProcessLock] = {}

_ENTRIES: dict[str, dict[str, Any]] = {}  # queue entries already read, by path

TICKET, GRANT = 0, 1  # lines of the counters file
_COUNTER_WIDTH = 20


@dataclass(frozen=True)
class Grant:
    """GPUs granted to one job.

    Attributes:
        uuids: the granted GPUs' UUIDs, in the order of `candidates` given to acquire.
        ticket: the request's place in arrival order.
        sequence: the grant's place in grant order (for checking first come, first served).
    """

    uuids: tuple[str, ...]
    ticket: int
    sequence: int


SHARED_DIR_MODE = 0o777
"""Servers of every user (host processes, containers of other uids) write in the lock directory.
No sticky bit: records are replaced by rename, which a sticky directory forbids across users."""
SHARED_FILE_MODE = 0o666


def shared_dir(path: Path) -> None:
    """Create a directory of the lock directory, writable by every user if we own it."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_uid == os.geteuid():
        with contextlib.suppress(PermissionError):
            os.chmod(path, SHARED_DIR_MODE)


def shared_file(path: Path, data: bytes | None = None) -> None:
    """Create `path` writable by every user: empty if absent (data None), else replaced atomically."""
    if data is None and path.exists():
        return  # never reopen a lock file: closing a second descriptor would drop our fcntl lock
    target = path if data is None else path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if data is None else os.O_TRUNC), SHARED_FILE_MODE)
    try:
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, SHARED_FILE_MODE)
        if data is not None:
            os.write(fd, data)
    finally:
        os.close(fd)
    if data is not None:
        os.replace(target, path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    shared_file(path, json.dumps(data).encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class GPULockManager:
    """Grants whole GPUs first come, first served, across every process sharing `lock_dir`.

    Args:
        lock_dir: the directory shared by every server on the host.
        sleep_poll: the longest a waiter sleeps between re-checks when not woken.
    """

    def __init__(self, lock_dir: str | os.PathLike[str], sleep_poll: float = WAIT_FALLBACK_POLL) -> None:
        self.root = Path(lock_dir)
        for sub in ("", "gpus", "held", "queue"):
            shared_dir(self.root / sub)
        shared_file(self.root / "queue.lock")
        shared_file(self.root / "counters")
        self._queue_lock = fasteners.InterProcessLock(str(self.root / "queue.lock"))
        self._sleep_poll = sleep_poll

    # -- the queue lock and counters ---------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._queue_lock.acquire()
        try:
            yield
        finally:
            self._queue_lock.release()

    def _next(self, counter: int) -> int:
        """Under the queue lock: the next value of a counter (TICKET or GRANT), written in place."""
        fd = os.open(self.root / "counters", os.O_RDWR)
        try:
            offset = counter * _COUNTER_WIDTH
            value = int(os.pread(fd, _COUNTER_WIDTH, offset).strip() or 0) + 1
            os.pwrite(fd, f"{value:0{_COUNTER_WIDTH - 1}d}\n".encode(), offset)
            return value
        finally:
            os.close(fd)

    # -- probing ---------------------------------------------------------------------

    def _lock_path(self, uuid: str) -> str:
        return str(self.root / "gpus" / f"{uuid}.lock")

    def _try_lock(self, uuid: str) -> fasteners.InterProcessLock | None:
        """Take the GPU's lock if nobody holds it; only under the queue lock."""
        if uuid in _HELD:
            return None
        shared_file(Path(self._lock_path(uuid)))
        lock = fasteners.InterProcessLock(self._lock_path(uuid))
        return lock if lock.acquire(blocking=False) else None

    def _free(self, uuids: set[str]) -> set[str]:
        free = set()
        for uuid in uuids:
            lock = self._try_lock(uuid)
            if lock is not None:
                lock.release()
                free.add(uuid)
        return free

    def _waiters(self, before: int | None = None) -> list[dict[str, Any]]:
        """Live waiting requests in ticket order (only those before ticket `before`, if given);
        removes those whose process died. Queue entries never change once written, so each is
        read once per process."""
        waiters = []
        names = sorted(n for n in os.listdir(self.root / "queue") if n.endswith(".json"))
        listed = {str(self.root / "queue" / n) for n in names}
        for path in [p for p in _ENTRIES if p not in listed]:  # granted or gone since
            del _ENTRIES[path]
        for name in names:
            if before is not None and int(name[:-5]) >= before:
                break
            entry = self.root / "queue" / name
            info = _ENTRIES.get(str(entry)) or _read_json(entry)
            fifo = entry.with_suffix(".fifo")
            if info is None or not _fifo_has_reader(fifo):
                _ENTRIES.pop(str(entry), None)
                entry.unlink(missing_ok=True)
                fifo.unlink(missing_ok=True)
                continue
            _ENTRIES[str(entry)] = info
            waiters.append(info)
        return waiters

    # -- granting --------------------------------------------------------------------

    def acquire(
        self,
        count: int,
        candidates: Sequence[str],
        info: dict[str, Any],
        queue_timeout: float | None = None,
        wake_fds: Sequence[int] = (),
        on_wake: Callable[[], None] | None = None,
        on_position: Callable[[int], None] | None = None,
    ) -> Grant:
        """Wait in line for `count` of the GPUs `candidates` and lock them.

        Args:
            count: how many GPUs, 1 to len(candidates).
            candidates: UUIDs of the GPUs this request may use (the server's inventory).
            info: shown to others while waiting and holding (job_id, client, server, ...).
            queue_timeout: seconds to wait at most; None waits for as long as it takes.
            wake_fds: other file descriptors that end a sleep when readable.
            on_wake: called after each sleep; it may raise to give up waiting (cancel).
            on_position: called with the number of requests ahead whenever it changes.

        Raises:
            InvalidRequestError: count is not between 1 and len(candidates).
            QueueTimeoutError: queue_timeout passed first; nothing is left locked.
        """
        if not 1 <= count <= len(candidates):
            raise InvalidRequestError(f"cannot lock {count} GPUs of {len(candidates)}")
        deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
        with self._locked():
            ticket = self._next(TICKET)
            grant, position = self._try_grant(ticket, count, candidates, info)
            if grant is not None:  # nobody to wait for: no queue entry at all
                return grant
            entry, fifo_fd = self._enqueue(ticket, count, candidates, info)
        last_position = -1
        try:
            while True:
                if on_position is not None and position != last_position:
                    last_position = position
                    on_position(position)
                # Requests behind others are woken by the grants ahead of them, so they re-check
                # less often (a request ahead that died silently is noticed within 2 s).
                timeout = self._sleep_poll if position == 0 else self._sleep_poll * 4
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueueTimeoutError(
                            f"waited {queue_timeout:g} s for {count} GPU(s) and they did not come free "
                            f"({position} request(s) were still ahead)")
                    timeout = min(timeout, remaining)
                readable, _, _ = select.select([fifo_fd, *wake_fds], [], [], timeout)
                if fifo_fd in readable:
                    _drain(fifo_fd)
                if on_wake is not None:
                    on_wake()
                with self._locked():
                    grant, position = self._try_grant(ticket, count, candidates, info)
                if grant is not None:
                    self.wake_all()  # the next request may be able to go now
                    return grant
        finally:
            if entry.exists():  # gave up: leave the queue, and let whoever was behind go
                with self._locked():
                    entry.unlink(missing_ok=True)
                    entry.with_suffix(".fifo").unlink(missing_ok=True)
                os.close(fifo_fd)
                self.wake_all()
            else:
                os.close(fifo_fd)

    def _enqueue(self, ticket: int, count: int, candidates: Sequence[str], info: dict[str, Any]) -> tuple[Path, int]:
        """Under the queue lock: join the queue with a wake-up FIFO."""
        entry = self.root / "queue" / f"{ticket:016d}.json"
        fifo = entry.with_suffix(".fifo")
        os.mkfifo(fifo)
        os.chmod(fifo, SHARED_FILE_MODE)  # others must open it to wake us (and to see we live)
        # O_RDWR keeps the FIFO open for writing too, so it never reads as end-of-file,
        # and writers see a reader for exactly as long as this process lives.
        fifo_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        _write_json(entry, {**info, "ticket": ticket, "count": count, "candidates": list(candidates),
                            "since": time.time()})
        return entry, fifo_fd

    def _try_grant(self, ticket: int, count: int, candidates: Sequence[str],
                   info: dict[str, Any]) -> tuple[Grant | None, int]:
        """Under the queue lock: grant to `ticket` if every earlier request is served first."""
        earlier = self._waiters(before=ticket)
        involved = set(candidates)
        for waiter in earlier:
            involved.update(waiter["candidates"])
        free = self._free(involved)
        ahead = 0
        behind_a_grant = False
        for waiter in earlier:
            theirs = [u for u in waiter["candidates"] if u in free]
            competes = bool(set(waiter["candidates"]) & set(candidates))
            if competes:
                ahead += 1
            if len(theirs) >= waiter["count"]:
                free.difference_update(theirs[: waiter["count"]])  # they will take these first
                behind_a_grant |= competes  # and be granted first: their grant wakes us
            else:
                free.difference_update(waiter["candidates"])  # reserved while they wait
        mine = [u for u in candidates if u in free][:count]
        if behind_a_grant or len(mine) < count:
            return None, ahead
        locks = []
        for uuid in mine:
            lock = self._try_lock(uuid)
            if lock is None:  # cannot happen under the queue lock, but never double-book
                for taken in locks:
                    taken.release()
                return None, ahead
            locks.append(lock)
        sequence = self._next(GRANT)
        since = time.time()
        for uuid, lock in zip(mine, locks, strict=True):
            _HELD[uuid] = lock
            _write_json(self.root / "held" / f"{uuid}.json",
                        {**info, "ticket": ticket, "sequence": sequence, "since": since})
        entry = self.root / "queue" / f"{ticket:016d}.json"
        entry.unlink(missing_ok=True)
        entry.with_suffix(".fifo").unlink(missing_ok=True)
        return Grant(tuple(mine), ticket, sequence), ahead

    def release(self, grant: Grant) -> None:
        """Free the grant's GPUs and wake every waiter. Releasing twice is harmless."""
        for uuid in grant.uuids:
            lock = _HELD.pop(uuid, None)
            if lock is None:
                continue
            (self.root / "held" / f"{uuid}.json").unlink(missing_ok=True)
            lock.release()
        self.wake_all()

    def wake_all(self) -> None:
        """Wake every waiting request so it re-checks the queue."""
        for fifo in (self.root / "queue").glob("*.fifo"):
            _poke(fifo)

    # -- status ----------------------------------------------------------------------

    def queue(self) -> list[dict[str, Any]]:
        """The live waiting requests, in ticket order."""
        with self._locked():
            return self._waiters()

    def snapshot(self) -> dict[str, Any]:
        """Who holds which GPU and who waits, in order: {"held": {uuid: info}, "queue": [info]}.

        GPUs held by a process that died are not reported, whatever their stale files say."""
        with self._locked():
            held = {}
            for path in (self.root / "held").glob("*.json"):
                uuid = path.stem
                info = _read_json(path)
                if info is not None and (uuid in _HELD or not self._free({uuid})):
                    held[uuid] = info
            return {"held": held, "queue": self._waiters()}


def _fifo_has_reader(fifo: Path) -> bool:
    try:
        if not stat.S_ISFIFO(os.stat(fifo).st_mode):
            return False
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody has it open for reading; ENOENT: gone
        return False
    os.close(fd)
    return True


def _poke(fifo: Path) -> None:
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, b"!")
    except OSError as exc:  # a full pipe already holds a wake-up
        if exc.errno != errno.EAGAIN:
            raise
    finally:
        os.close(fd)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass
