"""Who holds which GPU: the locks this process holds (fcntl locks are per process, and the kernel
never reports a process its own), taking and dropping them, the held/ record of every grant, and
which records outlive the process that held their locks (orphans).

A GPU's lock file is its memory, one byte per MiB. A whole-GPU grant locks the whole file
(fasteners.InterProcessLock: byte 0 to infinity); a share of M MiB locks M bytes of it with
byte-range fcntl locks, so shares never overlap, never add up to more than the GPU, and never
coexist with a whole-GPU grant: the kernel refuses conflicting locks. Probes ask the kernel which
ranges others hold (F_GETLK), without taking anything.

A lock is not the whole grant: the kernel drops it when its holder dies, while what its job
started may still run. Each grant's record (held/<uuid>.<ticket>.json), written under queue.lock
before the job can start, names the job: its id, its job process (`leader`), its connection
process (`owner`) and its server parent (`server_process`), each as procs.Pid. A released grant
loses its record before its lock. A record whose lock nobody holds is an orphan: its GPUs stay
taken while its server lives (which adopted what the job left, and removes the record once all
of that is dead) or while any process of the job runs on the host (rpycdl.scheduler.procs).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fasteners

from rpycdl.scheduler import lockdir, planning, procs
from rpycdl.scheduler.planning import Range

log = logging.getLogger(__name__)

_REPLACED: set[str] = set()
"""The records whose holder lives though their lock file shows no lock, said once each in the log."""

# What this process holds, keyed by the lock file's path (the same UUID may live in several lock
# directories). Closing any descriptor of a lock file drops all of this process's locks in it, so
# lockdir keeps one descriptor per file for the process's life (fasteners' own, for a whole GPU, is
# closed as that GPU is released, when the process holds no share of it).
_WHOLE: dict[str, fasteners.InterProcessLock] = {}  # the GPUs it holds whole
_SHARES: dict[str, dict[int, tuple[Range, ...]]] = {}  # ticket -> ranges locked
_RECORDS: dict[str, dict[str, Any]] = {}  # held/ records already read, by path (never rewritten)


def _forget_held() -> None:
    """In a forked child: fcntl locks are not inherited, so neither is the record of them."""
    _WHOLE.clear()
    _SHARES.clear()


os.register_at_fork(after_in_child=_forget_held)

Records = dict[str, list[tuple[Path, dict[str, Any]]]]
"""held/ records by GPU UUID: (path, record) of each grant of the GPU."""


@dataclass(frozen=True)
class Grant:
    """GPUs, or a share of one GPU, granted to one job.

    Attributes:
        uuids: the granted GPUs' UUIDs, in the order of the request's candidates.
        ticket: the request's place in arrival order.
        sequence: the grant's place in grant order (for checking first come, first served).
        share_bytes: bytes of uuids[0] for a share; 0 for whole GPUs.
        ranges: the ranges of the GPU's lock file (MiB) that the share holds.
        gpus: how many GPUs it is, fair share's measure: len(uuids), or the share's fraction of its GPU.
    """

    uuids: tuple[str, ...]
    ticket: int
    sequence: int
    share_bytes: int = 0
    ranges: tuple[Range, ...] = ()
    gpus: float = 0.0


def job_left(record: dict[str, Any]) -> list[int]:
    """The processes of a grant's job that still run, found from anywhere on the host."""
    leader = record.get("leader")
    return procs.job_processes(str(record.get("job_id", "")), tuple(leader) if leader else None)


class Holders:
    """The GPU lock files and held/ records of one lock directory, as this process sees them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._gpus_dir = str(root / "gpus")
        self.killing = False  # a probe killed what a crashed job left: look again soon

    def lock_path(self, uuid: str) -> str:
        return f"{self._gpus_dir}/{uuid}.lock"

    def fd(self, uuid: str) -> int:
        """This process's descriptor of the GPU's lock file, for probes and shares; never closed."""
        return lockdir.open_once(self.lock_path(uuid))

    # -- records ---------------------------------------------------------------------

    def records(self) -> Records:
        """The held/ records by GPU UUID (each read once per process: records are never rewritten)."""
        found: Records = {}
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

    def write(self, grant: Grant, info: dict[str, Any], since: float) -> None:
        """Under the queue lock, once the grant's locks are taken: its record on each of its GPUs."""
        for uuid in grant.uuids:
            lockdir.write_json(self.root / "held" / f"{uuid}.{grant.ticket}.json",
                               {**info, "ticket": grant.ticket, "sequence": grant.sequence,
                                "share_bytes": grant.share_bytes, "ranges": [list(r) for r in grant.ranges],
                                "since": since})

    def forget(self, path: Path) -> None:
        """Under the queue lock: remove a grant's record."""
        path.unlink(missing_ok=True)
        _RECORDS.pop(str(path), None)

    def holds(self, uuid: str, record: dict[str, Any]) -> bool:
        """Whether the holder a held/ record names still holds its locks."""
        ranges = [tuple(r) for r in record.get("ranges") or ()]
        if not ranges:
            return self.lock_path(uuid) in _WHOLE or bool(lockdir.others(self.fd(uuid), 0, 0, []))
        if record["ticket"] in _SHARES.get(self.lock_path(uuid), {}):
            return True
        start, length = ranges[0]
        return bool(lockdir.others(self.fd(uuid), start, start + length, []))

    def orphan_holds(self, record: dict[str, Any], kill: bool) -> bool:
        """Whether the GPUs of an orphaned grant (a record whose locks nobody holds: its connection
        process died) are still taken: while the server that granted it runs (it adopted what the
        job left, and its sweep removes the record once all of that is gone), or while any process
        of the job runs anywhere on the host (which `kill` kills)."""
        server = record.get("server_process")
        if server and procs.alive(*server):
            return True
        left = job_left(record)
        if kill and left:
            procs.kill(left)
            self.killing = True
        return bool(left)

    def held(self, records: Records) -> dict[str, list[dict[str, Any]]]:
        """Who holds which GPU, in grant order, as GPULockManager.snapshot() says it (a holder that died while its
        job lingers: `leftover`), from the held/ `records`; no lock."""
        held: dict[str, list[dict[str, Any]]] = {}
        for uuid, entries in records.items():
            for _, record in entries:
                if self.holds(uuid, record):
                    held.setdefault(uuid, []).append(record)
                elif self.orphan_holds(record, kill=False):
                    held.setdefault(uuid, []).append({**record, "leftover": True})
        for found in held.values():
            found.sort(key=lambda holder: holder["sequence"])
        return held

    def orphans(self) -> list[tuple[Path, dict[str, Any]]]:
        """The records of grants whose locks nobody holds any more (their holder died). One whose holder (its
        `owner`) lives is none, whatever the lock file says: its lock file was replaced (only root can, in a tree
        of root's), and the probe, through a descriptor of the file that was there, sees nobody; clearing it
        would kill a running job (said in the log instead)."""
        found = []
        for uuid, records in self.records().items():
            for path, record in records:
                if self.holds(uuid, record):
                    continue
                owner = record.get("owner")
                if owner and procs.alive(*owner):
                    if str(path) not in _REPLACED:
                        _REPLACED.add(str(path))
                        log.error("the grant of job %s on GPU %s looks unlocked though its holder (pid %s) lives: its "
                                  "lock file was replaced; it stays granted", record.get("job_id"), uuid, owner[0])
                    continue
                found.append((path, record))
        return found

    # -- locks -------------------------------------------------------------------------

    def taken(self, uuid: str, end: int, records: list[tuple[Path, dict[str, Any]]]) -> list[Range]:
        """Under the queue lock: ranges below MiB `end` (0: all of the file) that others hold,
        plus this process's own; one covering [0, end) if the GPU is held whole. The ranges of
        orphaned `records` of the GPU count as held while their job lingers; the others are removed."""
        if self.lock_path(uuid) in _WHOLE:
            return [(0, end)]
        taken = [r for ranges in _SHARES.get(self.lock_path(uuid), {}).values() for r in ranges]
        lockdir.others(self.fd(uuid), 0, end, taken)
        for path, record in records:
            if self.holds(uuid, record):
                continue
            if self.orphan_holds(record, kill=True):
                taken.extend(tuple(r) for r in record.get("ranges") or [(0, end)])
            else:
                self.forget(path)
        return taken

    def lock(self, uuids: Sequence[str], share_mib: int, sizes_mib: Mapping[str, int],
             taken: Mapping[str, list[Range]], ticket: int) -> tuple[tuple[Range, ...], bool]:
        """Under the queue lock: take the locks of a planned grant (`share_mib` of uuids[0], or the
        whole of each GPU), given what is `taken` of each; returns the share's ranges and whether
        every lock was taken (if not, nothing is held)."""
        if share_mib:
            uuid = uuids[0]
            fd = self.fd(uuid)
            ranges = planning.fit(taken[uuid], sizes_mib[uuid], share_mib)
            done: list[Range] = []
            for start, length in ranges:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
                except OSError:
                    for first, count in done:
                        fcntl.lockf(fd, fcntl.LOCK_UN, count, first)
                    return (), False
                done.append((start, length))
            _SHARES.setdefault(self.lock_path(uuid), {})[ticket] = tuple(ranges)
            return tuple(ranges), True
        locks: list[fasteners.InterProcessLock] = []
        for uuid in uuids:  # the whole file: fasteners locks byte 0 to infinity
            lock = fasteners.InterProcessLock(self.lock_path(uuid))
            if not lock.acquire(blocking=False):
                for held in locks:
                    held.release()
                return (), False
            locks.append(lock)
        _WHOLE.update(zip(map(self.lock_path, uuids), locks, strict=True))
        return (), True

    def unlock(self, grant: Grant) -> None:
        """Remove the grant's records, then drop its locks. Twice is harmless."""
        for uuid in grant.uuids:
            (self.root / "held" / f"{uuid}.{grant.ticket}.json").unlink(missing_ok=True)
            path = self.lock_path(uuid)
            if grant.share_bytes:
                for start, length in _SHARES.get(path, {}).pop(grant.ticket, ()):
                    fcntl.lockf(lockdir.open_once(path), fcntl.LOCK_UN, length, start)
                if not _SHARES.get(path):
                    _SHARES.pop(path, None)
            elif path in _WHOLE:
                _WHOLE.pop(path).release()  # closes fasteners' descriptor: no share of it is held here
