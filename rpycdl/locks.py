"""The GPU lock manager: first-come-first-served grants of whole GPUs, or of a share of one
GPU's memory, with file locks.

Everything lives in one lock directory shared by every server of a host (and mounted into
every container):

    gpus/<uuid>.lock             the GPU's lock file (fcntl locks; see below)
    held/<uuid>.<ticket>.json    who holds (part of) it: job id, client, server, share, since
    queue/<ticket>.json          a waiting request: what it asks for and who it is
    queue/<ticket>.fifo          its wake-up pipe; a request that has died has no reader on it
    queue.lock                   serialises taking tickets, granting and probing (a blocking fcntl
                                 lock: a process waiting for it is woken the moment it is free)
    counters                     the last ticket and the last grant sequence number, one line each

A GPU's lock file is its memory, one byte per MiB. A whole-GPU grant locks the whole file
(fasteners.InterProcessLock: byte 0 to infinity). A fractional grant of M MiB locks M bytes of
it with byte-range fcntl locks, so shares of one GPU never overlap, never add up to more than
the GPU, and never coexist with a whole-GPU grant: the kernel refuses conflicting locks.
Probes ask the kernel which ranges others hold (F_GETLK), without taking anything.

Arrival order is the ticket order. A request is granted when the GPUs it may use are free
after every earlier request has been served or has reserved what it waits for (so a later
request never overtakes an earlier one that competes for the same GPUs, while servers with
disjoint GPUs do not block each other). An earlier competing request that could be granted
now goes first, the later one waiting for its wake-up, so competing requests are granted
(numbered by Grant.sequence) in arrival order. A release, a grant and a cancelled wait write
a byte to every waiter's FIFO, so the next request is granted at once, not at the next poll.

A fractional request goes to the fullest GPU that has room for it (best fit among GPUs that
already hold shares) and only breaks into an idle GPU when none has room, so whole GPUs stay
available for whole-GPU requests.

What the locks do not guarantee: they are fcntl locks, so they belong to a process (one
process must not close a descriptor of a lock file it holds a lock in; rpycdl.lockdir keeps
one descriptor per file for the process's life, and the only other one, fasteners' for a whole
GPU, is closed as that GPU is released, when the process holds no share of it), and they are
freed by the kernel when the holder dies, without any wake-up, while what its job started may
still run. So a lock is not the whole grant: its held/ record, written under queue.lock before
the job can start, names the job (its id, its job process, the server that granted it), and is
removed only once the job is over. A released grant loses its record before its lock. A record
whose lock nobody holds is an orphan (its holder died): its GPUs stay taken while the job's
server, which adopts what the job left, still runs (its sweep kills that and then removes the
record: clear_orphans), or while any process of the job runs (rpycdl.procs), which every
granter then kills. Waiters re-check at least every WAIT_FALLBACK_POLL seconds, and every
LINGER_POLL while they wait for the processes of a crashed job to die.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import select
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fasteners

from rpycdl import lockdir, planning, procs
from rpycdl.defaults import KILL_WAIT, LINGER_POLL, WAIT_FALLBACK_POLL
from rpycdl.errors import InvalidRequestError, QueueTimeoutError
from rpycdl.planning import Range

# What this process holds. fcntl locks are per process: the kernel never reports a process its
# own locks, and closing any descriptor of a file drops all of them, so they are tracked here.
# All are keyed by the lock file's path (the same UUID may live in several lock directories).
_WHOLE: dict[str, fasteners.InterProcessLock] = {}  # the GPUs it holds whole
_SHARES: dict[str, dict[int, tuple[Range, ...]]] = {}  # ticket -> ranges locked


def _forget_held() -> None:
    """In a forked child: fcntl locks are not inherited, so neither is the record of them."""
    _WHOLE.clear()
    _SHARES.clear()


os.register_at_fork(after_in_child=_forget_held)

_ENTRIES: dict[str, dict[str, Any]] = {}  # queue entries already read, by path
_RECORDS: dict[str, dict[str, Any]] = {}  # held/ records already read, by path (never rewritten)

TICKET, GRANT = 0, 1  # lines of the counters file
_COUNTER_WIDTH = 20


@dataclass(frozen=True)
class Grant:
    """GPUs, or a share of one GPU, granted to one job.

    Attributes:
        uuids: the granted GPUs' UUIDs, in the order of `candidates` given to acquire.
        ticket: the request's place in arrival order.
        sequence: the grant's place in grant order (for checking first come, first served).
        memory: MiB of uuids[0] for a fractional grant; 0 for whole GPUs.
        ranges: the byte ranges of the GPU's lock file that the fractional grant holds.
    """

    uuids: tuple[str, ...]
    ticket: int
    sequence: int
    memory: int = 0
    ranges: tuple[Range, ...] = ()


def _job_left(record: dict[str, Any]) -> list[int]:
    """The processes of a grant's job that still run, found from anywhere on the host."""
    leader = record.get("leader")
    return procs.job_processes(str(record.get("job_id", "")), tuple(leader) if leader else None)


def describe_need(count: int, memory: int) -> str:
    """'2 GPU(s)' or '6144 MiB of one GPU', for messages."""
    return f"{memory} MiB of one GPU" if memory else f"{count} GPU(s)"


class GPULockManager:
    """Grants whole GPUs, or MiB of one GPU, first come, first served, across every process
    sharing `lock_dir`.

    Args:
        lock_dir: the directory shared by every server on the host.
        sleep_poll: the longest a waiter sleeps between re-checks when not woken.
    """

    def __init__(self, lock_dir: str | os.PathLike[str], sleep_poll: float = WAIT_FALLBACK_POLL) -> None:
        self.root = Path(lock_dir)
        for sub in ("", "gpus", "held", "queue"):
            lockdir.shared_dir(self.root / sub)
        lockdir.shared_file(self.root / "counters")
        self._queue_fd = lockdir.open_once(str(self.root / "queue.lock"))
        self._gpus_dir = str(self.root / "gpus")
        self._sleep_poll = sleep_poll
        self._killing = False  # this process killed what a crashed job left: re-check soon

    # -- the queue lock and counters ---------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold queue.lock. It waits in the kernel, not in a retry loop that sleeps (fasteners sleeps
        10 to 100 ms between tries), so the next process in line gets it as soon as it is free."""
        fcntl.lockf(self._queue_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._queue_fd, fcntl.LOCK_UN)

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
        return f"{self._gpus_dir}/{uuid}.lock"

    def _fd(self, uuid: str) -> int:
        """This process's descriptor of the GPU's lock file, for probes and shares; never closed."""
        return lockdir.open_once(self._lock_path(uuid))

    def _taken(self, uuid: str, end: int, records: list[tuple[Path, dict[str, Any]]]) -> list[Range]:
        """Under the queue lock: ranges below MiB `end` (0: all of the file) that others hold,
        plus this process's own; one covering [0, end) if the GPU is held whole. The ranges of
        orphaned `records` of the GPU (see _orphan_holds) count as held while their job lingers;
        the others are removed."""
        if self._lock_path(uuid) in _WHOLE:
            return [(0, end)]
        taken = [r for ranges in _SHARES.get(self._lock_path(uuid), {}).values() for r in ranges]
        lockdir.others(self._fd(uuid), 0, end, taken)
        for path, record in records:
            if self._holds(uuid, record):
                continue
            if self._orphan_holds(record, kill=True):
                taken.extend(tuple(r) for r in record.get("ranges") or [(0, end)])
            else:
                self._forget(path)
        return taken

    def _records(self) -> dict[str, list[tuple[Path, dict[str, Any]]]]:
        """The held/ records by GPU UUID (each read once per process: records are never rewritten)."""
        found: dict[str, list[tuple[Path, dict[str, Any]]]] = {}
        listed = set()
        for name in lockdir.names(self.root / "held", "", ".json"):
            uuid, _, ticket = name.removesuffix(".json").rpartition(".")
            path = self.root / "held" / name
            listed.add(str(path))
            record = _RECORDS.get(str(path)) or lockdir.read_json(path)
            if uuid and ticket.isdigit() and record is not None:
                _RECORDS[str(path)] = record
                found.setdefault(uuid, []).append((path, record))
        for gone in [path for path in _RECORDS if path not in listed]:
            del _RECORDS[gone]
        return found

    def _forget(self, path: Path) -> None:
        """Under the queue lock: remove a grant's record."""
        path.unlink(missing_ok=True)
        _RECORDS.pop(str(path), None)

    def _orphan_holds(self, record: dict[str, Any], kill: bool) -> bool:
        """Whether the GPUs of an orphaned grant (a record whose locks nobody holds: its connection
        process died) are still taken: while the server that granted it runs (it adopted what the
        job left, and its sweep removes the record once all of that is gone), or while any process
        of the job runs anywhere on the host (which `kill` kills)."""
        server = record.get("server_process")
        if server and procs.alive(*server):
            return True
        left = _job_left(record)
        if kill and left:
            procs.kill(left)
            self._killing = True
        return bool(left)

    def orphans(self) -> list[tuple[Path, dict[str, Any]]]:
        """The records of grants whose locks nobody holds any more (their holder died)."""
        return [(path, record) for uuid, records in self._records().items() for path, record in records
                if not self._holds(uuid, record)]

    def clear_orphans(self, claim: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """Remove the orphaned records that `claim` accepts once nothing of their job runs (the
        sweep of the server that granted them, or of any server if that one is gone): kill every
        process of the job (rpycdl.procs), wait until none runs (KILL_WAIT at most: a record whose
        job still runs stays), then remove the record and wake every waiter.

        Returns:
            The records removed.
        """
        cleared = []
        for path, record in self.orphans():
            if claim(record) and procs.kill_until_gone(functools.partial(_job_left, record), KILL_WAIT):
                with self._locked():
                    self._forget(path)
                cleared.append(record)
        if cleared:
            self.wake_all()
        return cleared

    def _waiters(self, before: int | None = None, prune: bool = True) -> list[dict[str, Any]]:
        """Live waiting requests in ticket order (only those before ticket `before`, if given);
        with `prune` (under the queue lock only), removes those whose process died. Queue entries
        never change once written, so each is read once per process."""
        waiters = []
        names = sorted(n for n in os.listdir(self.root / "queue") if n.endswith(".json"))
        listed = {str(self.root / "queue" / n) for n in names}
        for path in [p for p in _ENTRIES if p not in listed]:  # granted or gone since
            del _ENTRIES[path]
        for name in names:
            if before is not None and int(name[:-5]) >= before:
                break
            entry = self.root / "queue" / name
            info = _ENTRIES.get(str(entry)) or lockdir.read_json(entry)
            fifo = entry.with_suffix(".fifo")
            if info is None or not lockdir.fifo_has_reader(fifo):
                _ENTRIES.pop(str(entry), None)
                if prune:
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
        memory: int = 0,
        sizes: Mapping[str, int] | None = None,
    ) -> Grant:
        """Wait in line for `count` whole GPUs of `candidates`, or for `memory` MiB of one, and lock them.

        Args:
            count: how many GPUs, 1 to len(candidates); 1 for a fractional request.
            candidates: UUIDs of the GPUs this request may use (the server's inventory).
            info: shown to others while waiting and holding (job_id, client, server, ...); for the
                grant to be found after a crash, it names the job: `job_id`, `leader` (the job
                process, [pid, start]: procs.Pid) and `server_process` (the server parent, which
                adopts what the job leaves when its connection process dies).
            queue_timeout: seconds to wait at most; None waits for as long as it takes.
            wake_fds: other file descriptors that end a sleep when readable.
            on_wake: called after each sleep; it may raise to give up waiting (cancel).
            on_position: called with the number of requests ahead whenever it changes.
            memory: MiB of one GPU for a fractional request; 0 (the default) for whole GPUs.
            sizes: each candidate's memory in MiB; needed for a fractional request.

        Raises:
            InvalidRequestError: an impossible request (count, memory or sizes).
            QueueTimeoutError: queue_timeout passed first; nothing is left locked.
        """
        sizes = dict(sizes or {})
        if not 1 <= count <= len(candidates):
            raise InvalidRequestError(f"cannot lock {count} GPUs of {len(candidates)}")
        if memory:
            if count != 1 or any(sizes.get(uuid, 0) < 1 for uuid in candidates):
                raise InvalidRequestError("a fractional request is for one GPU, with every candidate's size known")
            if not 0 < memory <= max(sizes[uuid] for uuid in candidates):
                raise InvalidRequestError(f"cannot lock {memory} MiB: the largest GPU has "
                                          f"{max(sizes[uuid] for uuid in candidates)} MiB")
        need = {"count": count, "memory": memory, "candidates": list(candidates), "sizes": sizes}
        deadline = None if queue_timeout is None else time.monotonic() + queue_timeout
        with self._locked():
            ticket = self._next(TICKET)
            grant, position = self._try_grant(ticket, need, info)
            if grant is not None:  # nobody to wait for: no queue entry at all
                return grant
            entry, fifo_fd = self._enqueue(ticket, need, info)
        last_position = -1
        try:
            while True:
                if on_position is not None and position != last_position:
                    last_position = position
                    on_position(position)
                # Requests behind others are woken by the grants ahead of them, so they re-check
                # less often (a request ahead that died silently is noticed within 2 s).
                timeout = self._sleep_poll if position == 0 else self._sleep_poll * 4
                if self._killing:
                    timeout = min(timeout, LINGER_POLL)
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueueTimeoutError(
                            f"waited {queue_timeout:g} s for {describe_need(count, memory)} and they did not "
                            f"come free ({position} request(s) were still ahead)")
                    timeout = min(timeout, remaining)
                readable, _, _ = select.select([fifo_fd, *wake_fds], [], [], timeout)
                if fifo_fd in readable:
                    lockdir.drain(fifo_fd)
                if on_wake is not None:
                    on_wake()
                with self._locked():
                    grant, position = self._try_grant(ticket, need, info)
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

    def _enqueue(self, ticket: int, need: dict[str, Any], info: dict[str, Any]) -> tuple[Path, int]:
        """Under the queue lock: join the queue with a wake-up FIFO."""
        entry = self.root / "queue" / f"{ticket:016d}.json"
        fifo = entry.with_suffix(".fifo")
        os.mkfifo(fifo)
        os.chmod(fifo, lockdir.SHARED_FILE_MODE)  # others must open it to wake us (and to see we live)
        # O_RDWR keeps the FIFO open for writing too, so it never reads as end-of-file,
        # and writers see a reader for exactly as long as this process lives.
        fifo_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        lockdir.write_json(entry, {**info, **need, "ticket": ticket, "since": time.time()})
        return entry, fifo_fd

    def _try_grant(self, ticket: int, need: dict[str, Any], info: dict[str, Any]) -> tuple[Grant | None, int]:
        """Under the queue lock: grant to `ticket` if every earlier request is served first."""
        earlier = self._waiters(before=ticket)
        candidates = need["candidates"]
        involved, sizes = set(candidates), {}
        for waiter in earlier:
            involved.update(waiter["candidates"])
            sizes.update(waiter.get("sizes", {}))
        sizes.update(need["sizes"])
        fractional = bool(need["memory"]) or any(waiter.get("memory") for waiter in earlier)
        records = self._records()
        self._killing = False
        taken = {uuid: self._taken(uuid, sizes.get(uuid, 0) if fractional else 0, records.get(uuid, []))
                 for uuid in involved}
        rooms = planning.rooms(taken, sizes, fractional)
        ahead = 0
        behind_a_grant = False
        for waiter in earlier:
            competes = bool(set(waiter["candidates"]) & set(candidates))
            ahead += competes
            memory = waiter.get("memory", 0)
            theirs = planning.pick(rooms, waiter["count"], memory, waiter["candidates"])
            if theirs:
                planning.take(rooms, theirs, memory)  # they will take these first
                behind_a_grant |= competes  # and be granted first: their grant wakes us
            else:
                planning.take(rooms, waiter["candidates"], 0)  # reserved while they wait
        mine = planning.pick(rooms, need["count"], need["memory"], candidates)
        if behind_a_grant or not mine:
            return None, ahead
        # No earlier request was planned on `mine` (it would compete, and we would be behind its
        # grant), so what is taken of them is still what was probed above.
        grant = self._lock(mine, need["memory"], sizes, taken, ticket)
        if grant is None:  # cannot happen under the queue lock, but never double-book
            return None, ahead
        since = time.time()
        for uuid in grant.uuids:
            lockdir.write_json(self.root / "held" / f"{uuid}.{ticket}.json",
                               {**info, "ticket": ticket, "sequence": grant.sequence, "memory": grant.memory,
                                "ranges": [list(r) for r in grant.ranges], "since": since})
        entry = self.root / "queue" / f"{ticket:016d}.json"
        entry.unlink(missing_ok=True)
        entry.with_suffix(".fifo").unlink(missing_ok=True)
        return grant, ahead

    def _lock(self, uuids: list[str], memory: int, sizes: Mapping[str, int], taken: Mapping[str, list[Range]],
              ticket: int) -> Grant | None:
        """Under the queue lock: take the locks of a planned grant, given what is `taken` of each GPU;
        None (nothing held) if one fails."""
        if memory:
            uuid = uuids[0]
            fd = self._fd(uuid)
            ranges = planning.fit(taken[uuid], sizes[uuid], memory)
            done: list[Range] = []
            for start, length in ranges:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
                except OSError:
                    for taken in done:
                        fcntl.lockf(fd, fcntl.LOCK_UN, taken[1], taken[0])
                    return None
                done.append((start, length))
            _SHARES.setdefault(self._lock_path(uuid), {})[ticket] = tuple(ranges)
            return Grant((uuid,), ticket, self._next(GRANT), memory, tuple(ranges))
        locks: list[fasteners.InterProcessLock] = []
        for uuid in uuids:  # the whole file: fasteners locks byte 0 to infinity
            lock = fasteners.InterProcessLock(self._lock_path(uuid))
            if not lock.acquire(blocking=False):
                for taken in locks:
                    taken.release()
                return None
            locks.append(lock)
        _WHOLE.update(zip(map(self._lock_path, uuids), locks, strict=True))
        return Grant(tuple(uuids), ticket, self._next(GRANT))

    def release(self, grant: Grant) -> None:
        """Free the grant's GPUs (or share) and wake every waiter. Releasing twice is harmless."""
        for uuid in grant.uuids:
            (self.root / "held" / f"{uuid}.{grant.ticket}.json").unlink(missing_ok=True)
            path = self._lock_path(uuid)
            if grant.memory:
                for start, length in _SHARES.get(path, {}).pop(grant.ticket, ()):
                    fcntl.lockf(lockdir.open_once(path), fcntl.LOCK_UN, length, start)
                if not _SHARES.get(path):
                    _SHARES.pop(path, None)
            elif path in _WHOLE:
                _WHOLE.pop(path).release()  # closes fasteners' descriptor: no share of it is held here
        self.wake_all()

    def wake_all(self) -> None:
        """Wake every waiting request so it re-checks the queue."""
        for name in lockdir.names(self.root / "queue", "", ".fifo"):
            lockdir.poke(self.root / "queue" / name)

    # -- status ----------------------------------------------------------------------

    def queue(self) -> list[dict[str, Any]]:
        """The live waiting requests, in ticket order."""
        with self._locked():
            return self._waiters()

    def snapshot(self) -> dict[str, Any]:
        """Who holds which GPU and who waits, in order: {"held": {uuid: [info]}, "queue": [info]}.

        Each GPU's holders are in grant order; `memory` is a holder's MiB (0: the whole GPU). A
        holder that died while its job's processes still run (or before its server has cleaned up
        after it) is reported with `leftover` true: its GPUs are not free yet. Waiters that died
        are not reported. It takes no lock, so requests waiting in numbers never slow it: probes
        (F_GETLK) take nothing, records appear by rename after their locks are taken, and nothing
        is removed or killed here (granters and sweeps do that)."""
        held: dict[str, list[dict[str, Any]]] = {}
        for uuid, records in self._records().items():
            for _, info in records:
                if self._holds(uuid, info):
                    held.setdefault(uuid, []).append(info)
                elif self._orphan_holds(info, kill=False):
                    held.setdefault(uuid, []).append({**info, "leftover": True})
        for holders in held.values():
            holders.sort(key=lambda holder: holder["sequence"])
        return {"held": held, "queue": self._waiters(prune=False)}

    def _holds(self, uuid: str, info: dict[str, Any]) -> bool:
        """Whether the holder a held/ record names still holds its locks."""
        ranges = [tuple(r) for r in info.get("ranges") or ()]
        if not ranges:
            return self._lock_path(uuid) in _WHOLE or bool(lockdir.others(self._fd(uuid), 0, 0, []))
        if info["ticket"] in _SHARES.get(self._lock_path(uuid), {}):
            return True
        start, length = ranges[0]
        return bool(lockdir.others(self._fd(uuid), start, start + length, []))


