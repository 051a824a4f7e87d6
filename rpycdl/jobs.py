"""Job records and their states, shared by every connection process through the lock directory."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from rpycdl.defaults import FINISHED_JOBS_KEPT
from rpycdl.lockdir import names, shared_dir, shared_file


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

    `owner_pid` is the connection process serving it and `pgid` the job's process group,
    both in the server's own PID namespace; `server_id` says which server started it; `user`
    who sent it, proven by a client certificate when `user_verified`, else declared."""

    job_id: str
    server_id: str
    client: str
    ngpus: int
    gpu_memory: int = 0  # MiB of its one GPU for a share; 0 for whole GPUs
    state: JobState = JobState.PENDING
    owner_pid: int = 0
    pgid: int = 0
    gpus: list[str] = field(default_factory=list)
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

    def sweep(self, server_id: str) -> list[JobRecord]:
        """Fail this server's live jobs whose connection process died, killing what is left of
        them, and prune old finished records. Returns the jobs it failed."""
        failed = []
        records = self.all()
        for record in records:
            if record.server_id != server_id or record.state.finished or process_alive(record.owner_pid):
                continue
            if record.pgid:
                kill_group(record.pgid)
            record.state = JobState.CANCELLED if self.cancel_requested(record.job_id) else JobState.FAILED
            record.error = record.error or "the connection process serving this job died"
            record.ended = time.time()
            self.save(record)
            failed.append(record)
        finished = [r for r in records if r.state.finished]
        for record in finished[: max(0, len(finished) - FINISHED_JOBS_KEPT)]:
            self._path(record.job_id).unlink(missing_ok=True)
            self._path(record.job_id).with_suffix(".cancel").unlink(missing_ok=True)
        return failed


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still exists."""
    return _exists(os.killpg, pgid)


def child_pids(pid: int) -> list[int]:
    """The child processes of `pid` (Linux's /proc), none if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listed:
            return [int(child) for child in listed.read().split()]
    except OSError:
        return []


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (perhaps as another user's)."""
    return pid > 0 and _exists(os.kill, pid)


def _exists(send: Callable[[int, int], None], target: int) -> bool:
    """Signal 0 to `target` with `send`: it exists unless there is no such process (or group)."""
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
