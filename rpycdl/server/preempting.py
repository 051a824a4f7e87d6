"""A running job's side of preemption (`rpycdl serve --preempt`): its keeper (the connection process of an attached job
or a session, the supervisor of a detached one) reads the job's mark (rpycdl.scheduler.preemption) as it polls for a
cancel, sends SIGTERM to the job's process group (the handler the job gave rpycdl.on_preempt runs), stops it with
SIGKILL once --preempt-grace has passed (runner's stop), and ends it as a preemption: its row CANCELLED with
PreemptedError, or, a detached job under --preempt requeue, requeued at no cost to its retries= (its output
directory kept); the ledger's preemptions table says who preempted whom, when. A job that ends by itself with success
within its grace keeps its success."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from rpycdl.errors import PreemptedError
from rpycdl.scheduler import attempts, preemption
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.scheduler.policies import REQUEUE
from rpycdl.server.context import ServerContext
from rpycdl.server.runner import Ending, Result
from rpycdl.states import JobState


class Watch:
    """The preemption of one grant of a job: its mark (none yet: None), read at each `check`."""

    def __init__(self, lock_dir: str | Path, job_id: str, ticket: int) -> None:
        self._root, self._job_id, self.ticket = Path(lock_dir), job_id, ticket
        self.mark: dict[str, Any] | None = None
        self._deadline = 0.0

    def check(self, pid: int) -> tuple[Ending, str] | None:
        """A Stop's part (rpycdl.server.jobflow): at the mark of this grant, SIGTERM to the job's group (`pid` leads
        it); once the mark's grace has passed, the job must stop now (the runner kills it)."""
        if self.mark is None:
            mark = preemption.mark_of(self._root, self._job_id)
            if mark is None or mark.get("ticket") != self.ticket:
                return None
            self.mark, self._deadline = mark, time.monotonic() + float(mark.get("grace") or 0)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        return (Ending.CANCELLED, self.reason()) if time.monotonic() >= self._deadline else None

    def reason(self) -> str:
        """Why the job ended, in words."""
        mark = self.mark or {}
        return (f"the job was preempted by job {mark.get('by')} of {mark.get('by_user') or 'another user'} (priority "
                f"{mark.get('priority')}, over its {mark.get('victim_priority')}): a job of a higher priority needed "
                "its GPUs")


def settle(context: ServerContext, record: JobRecord, watch: Watch | None,
           result: Result | None) -> tuple[Result, str | None] | None:
    """At a job's end (JobFlow._end, its state judged): if `watch` saw it preempted and it did not succeed within its
    grace, its row ends as a preemption's (CANCELLED, PreemptedError), the ledger records it and its mark goes.
    Returns the result its client is told and the cause its flow's retry is given (attempts.PREEMPTED for a detached
    job under --preempt requeue, else None); None if it was not preempted."""
    if watch is None or watch.mark is None:
        return None
    preemption.unmark(context.lock_dir, record.job_id)
    if result is not None and result.ending is Ending.FINISHED and record.state is JobState.SUCCEEDED:
        return None  # it finished within its grace
    mark, requeue = watch.mark, watch.mark.get("mode") == REQUEUE and record.detached
    record.state, record.error, record.error_type = JobState.CANCELLED, watch.reason(), PreemptedError.__name__
    context.ledger.record_preemption({
        "job_id": record.job_id, "attempt": record.attempt, "by_job": mark.get("by", ""),
        "by_user": mark.get("by_user", ""), "priority": mark.get("priority", 0),
        "victim_priority": mark.get("victim_priority", 0), "at": mark.get("at", time.time()), "ended": time.time(),
        "outcome": "requeued" if requeue else "ended", "ticket": watch.ticket})
    return Result(Ending.CANCELLED, reason=record.error), attempts.PREEMPTED if requeue else None


def error(record: JobRecord, default: type[Exception]) -> type[Exception]:
    """The error a job's client gets for its end: PreemptedError for a preempted one, else `default`."""
    return PreemptedError if record.error_type == PreemptedError.__name__ else default
