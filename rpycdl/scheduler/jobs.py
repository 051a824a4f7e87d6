"""Job records and their states, shared by every connection process through the lock directory."""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from rpycdl.defaults import FINISHED_JOBS_KEPT, KILL_WAIT
from rpycdl.scheduler import procs
from rpycdl.scheduler.lockdir import names, shared_dir, shared_file

PRUNE_SLACK = 50
"""Finished records beyond FINISHED_JOBS_KEPT that may pile up before a sweep prunes them."""


class JobState(str, Enum):
    """Where a job is in its life. A stop the user asked for (cancelled) is not a failure."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def finished(self) -> bool:
        return self not in (JobState.PENDING, JobState.RUNNING)


@dataclass
class JobRecord:
    """One run_code call.

    `owner_pid` is the connection process serving it and `pgid` the job process (which leads its
    own session and process group), each with its start time (rpycdl.procs.Pid), in the PID
    namespace every server of the lock directory shares; `server_id` says which server started
    it; `user` who sent it, proven by a client certificate when `user_verified`, else declared."""

    job_id: str
    server_id: str
    client: str
    ngpus: int
    share_bytes: int = 0  # bytes of its one GPU for a share; 0 for whole GPUs
    state: JobState = JobState.PENDING
    owner_pid: int = 0
    owner_start: int = 0
    pgid: int = 0
    leader_start: int = 0
    gpu_uuids: list[str] = field(default_factory=list)
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    error: str = ""
    user: str = "unknown"
    user_verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        return cls(**{**data, "state": JobState(data["state"])})


def new_job_id() -> str:
    """A short, unique job id."""
    return uuid.uuid4().hex[:12]


class JobStore:
    """Job records as one JSON file each under `<lock_dir>/jobs/`, written only by the connection
    process serving the job (and by the sweep once it is gone); a cancel request is an empty
    `<id>.cancel` file beside it, so nobody overwrites anyone's record."""

    def __init__(self, lock_dir: str | os.PathLike[str]) -> None:
        self.root = Path(lock_dir) / "jobs"
        shared_dir(self.root)
        self._finished: set[str] = set()  # ids of records seen finished (a finished record never changes)

    def _path(self, job_id: str) -> Path:
        if not job_id.isalnum():
            raise ValueError(f"bad job id {job_id!r}")
        return self.root / f"{job_id}.json"

    def save(self, record: JobRecord) -> None:
        """Write a record (its owner's view; a cancel request lives in a file of its own)."""
        shared_file(self._path(record.job_id), json.dumps(record.to_dict()).encode())

    def load(self, job_id: str) -> JobRecord | None:
        try:
            return JobRecord.from_dict(json.loads(self._path(job_id).read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def cancel_requested(self, job_id: str) -> bool:
        """Whether someone asked to cancel the job (one stat, cheap to poll)."""
        return self._path(job_id).with_suffix(".cancel").exists()

    def all(self) -> list[JobRecord]:
        records = []
        for name in names(self.root, "", ".json"):
            record = self.load(name.removesuffix(".json"))
            if record is not None:
                records.append(record)
        return sorted(records, key=lambda r: r.submitted)

    def request_cancel(self, record: JobRecord) -> None:
        """Mark a live job for cancellation (a finished one is left alone); the connection process
        serving it stops it."""
        if not record.state.finished:
            shared_file(self._path(record.job_id).with_suffix(".cancel"))

    def sweep(self) -> list[JobRecord]:
        """End the live records, of any server, whose connection process died: kill what is left
        of each job (rpycdl.procs) and mark it failed (cancelled, if a cancel was asked); then prune
        old finished records. Any server (or reader) may sweep; a store remembers which records it
        saw finished, so that a sweep reads only the live ones. Returns the records it ended."""
        ended = []
        listed = [name.removesuffix(".json") for name in names(self.root, "", ".json")]
        self._finished &= set(listed)
        for job_id in listed:
            record = None if job_id in self._finished else self.load(job_id)
            if record is not None and record.state.finished:
                self._finished.add(job_id)
            if record is None or record.state.finished:
                continue
            if procs.alive(record.owner_pid, record.owner_start):
                continue
            leader = (record.pgid, record.leader_start) if record.pgid else None
            procs.kill_until_gone(functools.partial(procs.job_processes, record.job_id, leader), KILL_WAIT)
            record.state = JobState.CANCELLED if self.cancel_requested(record.job_id) else JobState.FAILED
            record.error = record.error or "the connection process serving this job died"
            record.ended = time.time()
            self.save(record)
            self._finished.add(job_id)
            ended.append(record)
        if len(self._finished) > FINISHED_JOBS_KEPT + PRUNE_SLACK:
            self._prune()
        return ended

    def _prune(self) -> None:
        """Remove the oldest finished records beyond FINISHED_JOBS_KEPT, oldest by their last write (a
        finished record is written for the last time when its job ends): a stat each, nothing read."""
        def written(job_id: str) -> float:
            try:
                return self._path(job_id).stat().st_mtime
            except OSError:
                return 0.0

        finished = sorted(self._finished, key=written)
        for job_id in finished[: max(0, len(finished) - FINISHED_JOBS_KEPT)]:
            self._path(job_id).unlink(missing_ok=True)
            self._path(job_id).with_suffix(".cancel").unlink(missing_ok=True)
            self._finished.discard(job_id)
