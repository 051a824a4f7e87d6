"""What the monitor's dashboard shows, as plain JSON-able dicts: the host's GPUs with their holders, the
queue in order (with why a job waits), each user's use against the limits in force, the recent jobs, one job's
row, and a piece of a detached job's log.

It reads what HostCollector reads, and as it does: the lock directory's snapshot (probes that take
nothing), the ledger (WAL readers never block a writer), the GPUs' inventory, and the jobs' log files.
Times are seconds since the epoch; the answers carry the monitor's `now`, so that a browser with
another clock computes waits and run times right. Users are shown as `rpycdl jobs` shows them
(`alice (unverified)` for a declared name). Everything here is data, never markup: the pages put it
in the DOM as text. Who asks sees what the servers would show them (rpycdl.security.visibility): others'
jobs without their command, name, error or log.
"""

from __future__ import annotations

import shlex
import socket
import threading
import time
from typing import Any

from rpycdl.defaults import LOG_CHUNK, RECENT_JOBS
from rpycdl.errors import NotAllowedError
from rpycdl.gpu.inventory import Inventory
from rpycdl.scheduler import limits, lockdir
from rpycdl.scheduler.jobfiles import JobFiles
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.scheduler.policies import Scheduling
from rpycdl.scheduler.policyfiles import host_scheduling
from rpycdl.security import visibility
from rpycdl.security.auth import Identity
from rpycdl.states import UNFINISHED

RECENT_LIMIT = 1000
"""Jobs the dashboard lists at most: the newest of the ledger's default view (unfinished, and ended in
the last RECENT_JOBS seconds)."""

SHORT_TEXT = 300
"""Characters of a command or an error shown in a list (the job's page shows all of it)."""

SNAPSHOTS = threading.Lock()
"""Held around each snapshot of the lock directory in this process, by HostView and by the metrics' collection
(rpycdl.monitor.web): GPULockManager.snapshot() updates a module-level cache of the queue's entries, which one
thread at a time may do."""

MAX_JOB_ID = 64
"""Characters of a job id the monitor looks up at most (ids are 12 hex digits)."""


def valid_job_id(job_id: str) -> bool:
    """Whether `job_id` can be a job's id (letters and digits): anything else names no job."""
    return 0 < len(job_id) <= MAX_JOB_ID and job_id.isascii() and job_id.isalnum()


class HostView:
    """The dashboard's data about one host: its GPUs (`inventory`), grants and queue (`lock_dir`), and
    jobs (the ledger and job files of `state_dir`)."""

    def __init__(self, inventory: Inventory, lock_dir: str, state_dir: str) -> None:
        self.inventory = inventory
        self.locks = GPULockManager(lock_dir)
        self.ledger = Ledger(state_dir, read_only=not lockdir.writable())  # a monitor's: a reader
        self.files = JobFiles(state_dir)
        self.hostname = socket.gethostname()

    def _snapshot(self) -> dict[str, Any]:
        """The lock manager's snapshot, its queue in the order of the policy the host's servers use now."""
        self.locks.scheduling = host_scheduling(self.locks.root) or Scheduling()
        return self.locks.snapshot()

    def host(self) -> dict[str, Any]:
        """The host now: {"host", "now", "gpus": [...], "queue": [...], "jobs": [...], "jobs_limit"}.

        Each GPU has its index, uuid, model, memory total, used (None: unknown) and granted, its
        utilisation (0 to 1, None: unknown), and its holders in grant order (job id, name, user, whole
        or share and its bytes, since when, service, leftover: its holder died but its processes run).
        The queue is in order: job id, name, user, service, what it waits for (ngpus, share_bytes), on
        which GPUs (their indices), since when, and why its owner's limits hold it back (`reason`, "" if they do
        not). The jobs are the ledger's default view, newest first. "limits": each user's and group's use against
        the limits in force (rpycdl.scheduler.limits.standing; None while none are)."""
        now = time.time()
        with SNAPSHOTS:
            snapshot = self._snapshot()
        records = self.ledger.query(active_or_ended_since=now - RECENT_JOBS, limit=RECENT_LIMIT)
        names = {record.job_id: record.name for record in records}
        gpus, index = [], {}
        used, busy = self.inventory.memory_used(), self.inventory.utilization()
        for gpu in self.inventory.gpus():
            index[gpu.uuid] = gpu.index
            holders = [_holder(holder, names) for holder in snapshot["held"].get(gpu.uuid, [])]
            whole = any(holder["kind"] == "whole" for holder in holders)
            gpus.append({"index": gpu.index, "uuid": gpu.uuid, "model": gpu.name, "memory_total": gpu.memory_total,
                         "memory_used": used.get(gpu.uuid), "utilization": busy.get(gpu.uuid),
                         "memory_granted": gpu.memory_total if whole else sum(h["share_bytes"] for h in holders),
                         "holders": holders})
        queue = [_waiter(position, waiter, names, index) for position, waiter in enumerate(snapshot["queue"], 1)]
        return {"host": self.hostname, "now": now, "gpus": gpus, "queue": queue,
                "jobs": [_row(record, index) for record in records], "jobs_limit": RECENT_LIMIT,
                "recent_seconds": RECENT_JOBS, "limits": limits.standing(self.locks.root, snapshot, self.ledger, now)}

    def job(self, job_id: str, viewer: Identity | None) -> dict[str, Any] | None:
        """One job's row as `viewer` may see it (None: no such job); for its owner or an admin: the list's
        fields, its request, full error, the server that accepted it, its GPUs' uuids, its log's size now (a
        detached job's), what it used as measured at its end (peak_memory, cpu_seconds, max_procs; None: not
        measured) and, while it waits, its place in the queue (1: next) and why its owner's limits hold it back
        (`reason`, "" if they do not); "logs": whether the viewer may read its log here."""
        record = self.ledger.get(job_id) if valid_job_id(job_id) else None
        if record is None:
            return None
        owner = Identity(record.user, record.user_verified)
        index = {gpu.uuid: gpu.index for gpu in self.inventory.gpus()}
        row = _row(record, index, short=False)
        row.update(request=record.request, error_type=record.error_type, client=record.client, server=record.server,
                   gpu_uuids=record.gpu_uuids, result_bytes=record.result_bytes,
                   cancel_requested=record.cancel_requested, position=None, peak_memory=record.peak_memory,
                   cpu_seconds=record.cpu_seconds, max_procs=record.max_procs,
                   log_size=self.files.log_size(job_id) if record.detached else None)
        if record.state in UNFINISHED and not record.started:
            with SNAPSHOTS:
                queue = self._snapshot()["queue"]
            place, waiter = next(((place, waiter) for place, waiter in enumerate(queue, 1)
                                  if waiter.get("job_id") == job_id), (None, {}))
            row.update(position=place, reason=str(waiter.get("reason", "")))
        return {"now": time.time(), "job": visibility.shown(row, viewer, owner),
                "logs": record.detached and visibility.sees_all(viewer, owner)}

    def log(self, job_id: str, offset: int, size: int, viewer: Identity | None) -> dict[str, Any] | None:
        """Up to `size` bytes (at most LOG_CHUNK) of a detached job's log from `offset`: {"data", "next"
        (the offset to ask next), "size" (the log's size now), "state"}. An offset past the end gives
        nothing, and the end as the next offset. None: no such detached job.

        Raises:
            NotAllowedError: `viewer` is neither its owner nor an admin (security.visibility)."""
        record = self.ledger.get(job_id) if valid_job_id(job_id) else None
        if record is None or not record.detached:
            return None
        owner = Identity(record.user, record.user_verified)
        if not visibility.sees_all(viewer, owner):
            raise NotAllowedError(visibility.refusal(job_id, owner, viewer))
        total = self.files.log_size(job_id)
        offset = min(offset, total)
        data = self.files.read_log(job_id, offset, max(0, min(size, LOG_CHUNK))) if offset < total else b""
        return {"data": data, "next": offset + len(data), "size": max(total, offset + len(data)),
                "state": record.state.value}


def for_viewer(host: dict[str, Any], viewer: Identity | None) -> dict[str, Any]:
    """HostView.host()'s answer as `viewer` may see it: others' holders, waiters and jobs reduced."""
    gpus = [{**gpu, "holders": [visibility.shown(holder, viewer) for holder in gpu["holders"]]} for gpu in host["gpus"]]
    return {**host, "gpus": gpus, "queue": [visibility.shown(waiter, viewer) for waiter in host["queue"]],
            "jobs": [visibility.shown(row, viewer) for row in host["jobs"]]}


def _holder(holder: dict[str, Any], names: dict[str, str | None]) -> dict[str, Any]:
    """A GPU's holder (a record of the lock directory's snapshot) as the dashboard shows it."""
    share = int(holder.get("share_bytes") or 0)
    return {"job_id": str(holder.get("job_id", "")), "name": names.get(holder.get("job_id", "")),
            "user": str(holder.get("user", "")), "service": str(holder.get("server", "")),
            "kind": "share" if share else "whole", "share_bytes": share, "since": holder.get("since"),
            "leftover": bool(holder.get("leftover"))}


def _waiter(position: int, waiter: dict[str, Any], names: dict[str, str | None], index: dict[str, int]
            ) -> dict[str, Any]:
    """A waiting request (an entry of the snapshot's queue) as the dashboard shows it; `position` 1 is next."""
    return {"position": position, "job_id": str(waiter.get("job_id", "")), "name": names.get(waiter.get("job_id", "")),
            "user": str(waiter.get("user", "")), "service": str(waiter.get("server", "")),
            "ngpus": int(waiter.get("ngpus", 0)), "share_bytes": int(waiter.get("share_mib", 0)) * 1024**2,
            "gpus": sorted(index.get(uuid, -1) for uuid in waiter.get("candidates", [])), "since": waiter.get("since"),
            "reason": str(waiter.get("reason", ""))}


def _row(record: JobRecord, index: dict[str, int], short: bool = True) -> dict[str, Any]:
    """A job as the dashboard lists it (`short`: its command and error cut to SHORT_TEXT characters)."""
    what = _what(record)
    return {"job_id": record.job_id, "name": record.name, "user": Identity(record.user, record.user_verified).label,
            "state": record.state.value, "service": record.service, "kind": record.kind,
            "detached": record.detached, "ngpus": record.ngpus, "share_bytes": record.share_bytes,
            "gpus": [index.get(uuid, -1) for uuid in record.gpu_uuids], "submitted": record.submitted,
            "started": record.started, "ended": record.ended, "exit_code": record.exit_code,
            "error": _cut(record.error) if short else record.error, "what": _cut(what) if short else what}


def _what(record: JobRecord) -> str:
    """What a job runs, in words: its command, its container's image and command, or a function."""
    command = record.request.get("command")
    text = shlex.join(command) if isinstance(command, list) and all(isinstance(a, str) for a in command) else ""
    if record.request.get("image"):
        return f"{record.request['image']}: {text}" if text else str(record.request["image"])
    return text or ("a function" if record.kind == "call" else record.kind)


def _cut(text: str) -> str:
    return text if len(text) <= SHORT_TEXT else text[:SHORT_TEXT - 1] + "…"
