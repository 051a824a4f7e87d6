"""A detached job's attempts (submit's `retries=` and `retry_on_failure=`, as Slurm's --requeue and Ray's
max_retries): which ends requeue it, and the ledger's side of a requeue. A requeued job keeps its id, its row (back to
PENDING with no owner, its `attempt` one more) and its files (payload, output and working directories, log); each
earlier attempt becomes a row of the `attempts` table, as the job's row told it when that attempt ended. A requeued
row waits with no place in line until a server's sweep gives it one (rpycdl.server.retries), once nothing of its
last attempt holds a GPU.

What requeues a job: its supervisor died while it ran (LOST), its job process (or its command) was killed by a
signal rpycdl did not send (the OOM killer of the host, a kill), or its GPUs were reclaimed idle (RECLAIMED); with
`retry_on_failure`, also an end of its own (it raised, its command exited with another code than 0). Never: a cancel,
its own timeout, rpycdl's limits (its GPU memory, its cgroup's memory, --max-output, --max-result), which a second
attempt would meet again."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from rpycdl.defaults import MAX_RETRIES
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.jobrecord import COLUMNS, JobRecord, from_row
from rpycdl.scheduler.schema import LIVE

KILLED = "killed"
"""An attempt's job process, or its command, was killed by a signal that rpycdl did not send."""
FAILED = "failed"
"""An attempt ended by itself without success: it raised, or its command exited with another code than 0."""
LOST = "lost"
"""An attempt's supervisor died while it ran (the sweep's LOST)."""
RECLAIMED = "reclaimed"
"""An attempt's GPUs were idle past the server's --idle-reclaim, and it was stopped (rpycdl.server.reclaim)."""
PREEMPTED = "preempted"
"""An attempt was preempted under --preempt requeue (rpycdl.server.preempting): requeued whatever its retries=."""

Retry = Callable[[JobRecord, "str | None"], bool]
"""Given a detached job's row as its attempt ended and why (cause): whether it requeued the job (its row waits
again; its files stay). A job's supervisor gives its flow one (rpycdl.server.jobflow.JobFlow)."""

NEVER = ("LimitError", "OutputLimitError", "ConnectionDroppedError", "GPUMemoryExceededError",
         "HostMemoryExceededError", "GPUNotGrantedError", "JobTimeoutError", "JobCancelledError")
"""The errors whose end never requeues a job, even raised inside it: rpycdl's limits, a timeout, a cancel."""

_RESET = ("state = 'PENDING', owner_pid = 0, owner_start = 0, pgid = 0, leader_start = 0, gpu_uuids = '[]', "
          "started = NULL, ended = NULL, error = '', error_type = '', exit_code = NULL, result_bytes = NULL, "
          "gpus = 0, peak_memory = NULL, cpu_seconds = NULL, max_procs = NULL, attempt = attempt + 1")
HISTORY = ("attempt", "state", "started", "ended", "error", "error_type", "exit_code", "gpu_uuids")
"""What the history of a job's attempts tells of each (Ledger.attempts)."""


def check(retries: Any, on_failure: Any) -> tuple[int, bool]:
    """A submit's `retries=` (None: 0) and `retry_on_failure=` (None: False), checked.

    Raises:
        InvalidRequestError: `retries` not a whole number from 0 to MAX_RETRIES, `retry_on_failure` not a bool,
            or True with no retries.
    """
    retries = 0 if retries is None else retries
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise InvalidRequestError(f"retries={retries!r}: must be a whole number from 0 to {MAX_RETRIES}, the times "
                                  "the job may be requeued")
    on_failure = False if on_failure is None else on_failure
    if not isinstance(on_failure, bool):
        raise InvalidRequestError(f"retry_on_failure={on_failure!r}: must be True or False")
    if on_failure and not retries:
        raise InvalidRequestError("retry_on_failure=True needs retries= of 1 or more: how many times to retry")
    return retries, on_failure


def cause(record: JobRecord, crashed: bool, signaled: bool) -> str | None:
    """Why an attempt that ran to an end of its own or died (`crashed`: its job process ended without an outcome;
    `signaled`: by a signal) ended, as retries see it: KILLED, FAILED, or None (SUCCEEDED, or an error of NEVER).
    A command that a signal killed (its exit code -N) was KILLED; a job stopped with its GPUs idle, RECLAIMED."""
    if record.error_type == "IdleReclaimedError":
        return RECLAIMED
    if record.state.value != "FAILED" or record.error_type in NEVER:
        return None
    if crashed:
        return KILLED if signaled else FAILED
    return KILLED if (record.exit_code or 0) < 0 else FAILED


def retryable(record: JobRecord, cause: str | None, preempted: int = 0) -> bool:
    """Whether an attempt of the job of `record` that ended for `cause` (KILLED, FAILED, LOST, PREEMPTED; None: any
    other end) requeues it: no cancel asked, and a preemption, or retries left (the `preempted` attempts before, which
    a preemption requeued, not counted)."""
    asked = record.request.get("retries") or 0
    if cause is None or record.cancel_requested:
        return False
    if cause == PREEMPTED:
        return True
    if record.attempt - preempted > asked:
        return False
    return cause != FAILED or bool(record.request.get("retry_on_failure"))


def said(record: JobRecord) -> str:
    """Which attempt a row is, where it is not the first: "attempt 2 of 4" (retries=3); "" for a first."""
    asked = record.request.get("retries") or 0
    return f"attempt {record.attempt} of {asked + 1}" if record.attempt > 1 or asked else ""


class AttemptsLedger:
    """The job ledger's part about attempts, mixed into rpycdl.scheduler.ledger.Ledger, whose transactions
    (`_write`, `_db`) it uses."""

    _write: Callable[[], contextlib.AbstractContextManager[Any]]
    _db: Callable[[], contextlib.AbstractContextManager[Any]]

    def requeue(self, ended: JobRecord) -> bool:
        """Requeue the job of `ended` (its row as its attempt ended: state, error, times), whose owner is still the
        row's (the supervisor that ran it, alive or dead): the attempt goes to the attempts table, and the row back to
        PENDING with no owner, its attempt one more, its run's columns cleared, all in one transaction; only if the
        row is unfinished, of that attempt and owner, and no cancel was asked. Returns whether it did (not if the
        job ended, was cancelled, or another server's sweep requeued it first)."""
        with self._write() as db:
            changed = db.execute(f"UPDATE jobs SET {_RESET} WHERE job_id = ? AND {LIVE} AND owner_pid = ? AND "
                                 "owner_start = ? AND attempt = ? AND cancel_requested = 0",
                                 (ended.job_id, ended.owner_pid, ended.owner_start, ended.attempt)).rowcount
            if changed:
                db.execute(f"INSERT INTO attempts (job_id, {', '.join(HISTORY)}) VALUES ({', '.join('?' * 9)})",
                           (ended.job_id, ended.attempt, ended.state.value, ended.started, ended.ended or time.time(),
                            ended.error, ended.error_type, ended.exit_code, json.dumps(ended.gpu_uuids)))
            return bool(changed)

    def requeued(self) -> list[JobRecord]:
        """The requeued jobs that wait with no owner (in line, or for their place in it), oldest first."""
        with self._db() as db:
            return [from_row(row) for row in db.execute(
                f"SELECT state, {', '.join(COLUMNS)} FROM jobs WHERE {LIVE} AND owner_pid = 0 AND attempt > 1 "
                "ORDER BY submitted")]

    def ended_with(self, error_type: str) -> int:
        """How many jobs and earlier attempts of jobs ended with `error_type` (a requeued attempt counts)."""
        with self._db() as db:
            return sum(db.execute(f"SELECT count(*) FROM {table} WHERE error_type = ?", (error_type,)).fetchone()[0]
                       for table in ("jobs", "attempts"))

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        """The earlier attempts of a job, first first: each its attempt number, state, started, ended, error,
        error_type, exit_code and gpu_uuids, as its row told them when it ended ([] for a job never requeued)."""
        with self._db() as db:
            rows = db.execute(f"SELECT {', '.join(HISTORY)} FROM attempts WHERE job_id = ? ORDER BY attempt",
                              (job_id,)).fetchall()
        return [{**dict(zip(HISTORY, row, strict=True)), "gpu_uuids": json.loads(row[-1])} for row in rows]
