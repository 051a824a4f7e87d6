"""A job as the ledger keeps it: `JobRecord`, its id, and its row of the `jobs` table."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rpycdl.states import JobState


def new_job_id() -> str:
    """A short, unique job id."""
    return uuid.uuid4().hex[:12]


@dataclass
class JobRecord:
    """One job, a row of the ledger.

    `owner_pid` is the process that owns the job now (the connection process of an attached job, the
    supervisor of a detached one) and `pgid` the job process, which leads its own session, each with
    its start time (rpycdl.scheduler.procs.Pid). `user` sent it, proven by a client certificate when
    `user_verified`. `cancel_requested` is read from the row: only Ledger.request_cancel writes it.
    `peak_memory`, `cpu_seconds` and `max_procs` are what the server measured of the job's cgroup at its end
    (None: not measured, by a server that cannot fence its jobs, or before the end). `attempt` counts the times
    it was started, a detached job's earlier attempts being rows of their own (rpycdl.scheduler.attempts)."""

    job_id: str
    server_id: str
    client: str  # host:port
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
    error: str = ""  # why it failed, was cancelled or lost
    error_type: str = ""  # the exception type's name for a failure
    exit_code: int | None = None  # a command's or container's
    user: str = "unknown"
    user_verified: bool = False
    name: str | None = None  # unique among one user's unfinished jobs
    detached: bool = False
    kind: str = "call"  # "call", "command" or "container"
    service: str = ""
    server: str = ""  # host:port of the server that accepted it
    request: dict[str, Any] = field(default_factory=dict)
    log_bytes: int = 0
    result_bytes: int | None = None
    cancel_requested: bool = False
    gpus: float = 0.0  # GPUs it was granted: ngpus, or its share's fraction of its GPU (0 before its grant)
    result_nonce: str | None = None  # a detached job's seal (rpycdl.security.results), as its client gave it:
    result_key_id: str | None = None  # the nonce its result key is derived from, and which client key (hex)
    peak_memory: int | None = None  # bytes of host memory at most
    cpu_seconds: float | None = None  # CPU time, user and system, of all its processes
    max_procs: int | None = None  # the most processes (tasks) it had at once
    attempt: int = 1  # which attempt of it this row is: 1, then one more each time retries= requeued it
    array_id: str | None = None  # the array it is an element of (rpycdl.scheduler.arrays), or None
    array_index: int | None = None  # its index in that array
    priority: int = 0  # its priority among the waiting (rpycdl.scheduler.priorities): higher goes first

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-able values, its state as its string (lists and dicts shared, not copied)."""
        return {**{name: getattr(self, name) for name in _FIELDS}, "state": self.state.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobRecord:
        """The record `to_dict` made (keys this version does not know are ignored)."""
        return cls(**{key: data[key] for key in COLUMNS if key in data}, state=JobState(data["state"]))


_FIELDS = tuple(column.name for column in dataclasses.fields(JobRecord))
COLUMNS = tuple(name for name in _FIELDS if name != "state")
_JSON = ("gpu_uuids", "request")
_BOOLS = ("user_verified", "detached", "cancel_requested")


def to_row(record: JobRecord) -> dict[str, Any]:
    """The record as the jobs table's columns: JSON text for lists and dicts, 0/1 for booleans."""
    row = record.to_dict()
    return {**row, **{name: json.dumps(row[name]) for name in _JSON}, **{name: int(row[name]) for name in _BOOLS}}


def from_row(row: Sequence[Any]) -> JobRecord:
    """The record of a row of `SELECT state, *COLUMNS`."""
    data = dict(zip(("state", *COLUMNS), row, strict=True))
    data.update({name: json.loads(data[name]) for name in _JSON} | {name: bool(data[name]) for name in _BOOLS})
    return JobRecord.from_dict(data)
