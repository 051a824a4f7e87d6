"""Detached jobs held by their dependencies (submit's `after=`, rpycdl.scheduler.dependencies): resolved and judged
at submit; then, while they wait for other jobs' ends, a row of the ledger (PENDING, no owner, its `after` in its
request) and the job's files, with no place in line yet. Every server's sweep (release, at its start and every
SWEEP_INTERVAL) looks at the held jobs of its state directory: one whose dependencies are met takes its place in
line then, as submit would have (the queue entry it was to have is kept in its spec: supervisor.hand_over); one
whose dependencies can never be met ends FAILED with DependencyError, never having run; a cancelled one ends
CANCELLED. Nothing but rows and files, so a held job survives every server's death: the next sweep of any server
sharing the state directory carries on."""

from __future__ import annotations

import logging
from collections.abc import Callable

from rpycdl.errors import DependencyError, InvalidRequestError
from rpycdl.scheduler import arrays, dependencies
from rpycdl.scheduler.dependencies import After, Verdict
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.scheduler.queuedir import Need
from rpycdl.security import results
from rpycdl.server.context import ServerContext
from rpycdl.states import JobState

log = logging.getLogger("rpycdl.server")


def check_after(text: object, find: Callable[[str], JobRecord], user: tuple[str, bool],
                context: ServerContext) -> tuple[str, bool] | None:
    """Check a submit's `after=` (None: none), resolve each job it names to its id (`find`: by id, or by name among
    the caller's jobs; `user`, the caller's name and whether it is verified; else an array of that id, or of the
    caller's of that name: its id, waiting for every element) and judge it now. Returns the
    dependency as the job keeps it ("ok:ID,ID") and whether the job must wait (False: met already, it takes its
    place in line at once).

    Raises:
        InvalidRequestError: bad syntax, or a job no one here knows (named).
        DependencyError: a dependency that has ended so that it can never be met: nothing is submitted.
    """
    if text is None:
        return None
    asked = dependencies.parse(text)
    rows = {}
    for ref in asked.refs:
        try:
            row = find(ref)
        except InvalidRequestError as exc:
            array = arrays.find(context.ledger, ref, *user)
            if array is None:
                raise InvalidRequestError(f"after={text!r}: {exc} (nor an array)") from None
            rows[array.array_id] = arrays.deciding(context.ledger, array.array_id)
            continue
        rows[row.job_id] = row
    after = After(asked.kind, tuple(rows))
    verdict = dependencies.judge(after, rows)
    broken = verdict.broken
    if broken is not None:
        mine = [broken.job_id] if (broken.user, broken.user_verified) == user else []
        raise DependencyError(dependencies.reason("not submitted", after, verdict, mine))
    return str(after), not verdict.met


def is_held(record: JobRecord) -> bool:
    """Whether a row may be a held job's: PENDING, no owner, with dependencies, never run (a requeued one's
    dependencies were met: rpycdl.server.retries; whether it is in line yet is the queue's to say)."""
    return record.state is JobState.PENDING and record.owner_pid == 0 and bool(record.request.get("after")) \
        and record.attempt == 1


def release(context: ServerContext) -> list[tuple[str, str]]:
    """One sweep over the held jobs of this server's state directory: queue those whose dependencies are met, end
    those that can never run (DependencyError) or were cancelled. Returns (job id, what became of it)."""
    held = [record for record in context.ledger.unfinished(owned=False, after=True) if is_held(record)]
    if not held:
        return []
    queued = context.locks.queued_rows()
    done = []
    for record in held:
        if record.job_id in queued:
            continue
        if record.cancel_requested:
            if end(context, record.job_id, JobState.CANCELLED, f"job {record.job_id} was cancelled while waiting",
                   "JobCancelledError"):
                done.append((record.job_id, "cancelled"))
            continue
        after = dependencies.parse(record.request["after"])
        verdict = dependencies.judge(after, _rows(context, after))
        if verdict.waits:
            continue
        if verdict.met:
            if take_place(context, record, is_held):
                done.append((record.job_id, "queued"))
        elif end(context, record.job_id, JobState.FAILED, _reason(record, after, verdict), DependencyError.__name__):
            done.append((record.job_id, "failed"))
    return done


def _rows(context: ServerContext, after: After) -> dict[str, JobRecord | list[JobRecord] | None]:
    """The rows `after` names, by id: a job's, or the elements of an array that decide (arrays.deciding)."""
    rows: dict[str, JobRecord | list[JobRecord] | None] = {}
    for job_id in after.refs:
        row = rows[job_id] = context.ledger.get(job_id)
        if row is None and arrays.get(context.ledger, job_id) is not None:
            rows[job_id] = arrays.deciding(context.ledger, job_id)
    return rows


def _reason(record: JobRecord, after: After, verdict: Verdict) -> str:
    """Why it never runs; the error of the job that broke it told if that job is its owner's too."""
    broken = verdict.broken
    same = broken is not None and (broken.user, broken.user_verified) == (record.user, record.user_verified)
    return dependencies.reason(f"job {record.job_id}", after, verdict, [broken.job_id] if same and broken else [])


def take_place(context: ServerContext, record: JobRecord, waits: Callable[[JobRecord], bool],
               deadline_from: float | None = None) -> bool:
    """Give a job that waits with no place in line (held, requeued) its place: the entry its submit made ready
    (supervisor.hand_over), unless it has one, or its row, read again under the queue lock, no longer `waits` or
    was cancelled; with `deadline_from`, its queue deadline counts from then. A job whose entry cannot be read ends
    FAILED. Returns whether it took its place."""
    job_id = record.job_id
    try:
        entry = context.files.spec(job_id)["queue"]
    except (OSError, ValueError, KeyError) as exc:
        return end(context, job_id, JobState.FAILED, f"job {job_id} could not take its place in line: {exc}",
                   type(exc).__name__)
    info, timeout = entry["info"], record.request.get("queue_timeout")
    if deadline_from is not None:
        info = {**info, "deadline": None if timeout is None else deadline_from + timeout}

    def still_waits() -> bool:
        now = context.ledger.get(job_id)
        return now is not None and waits(now) and not now.cancel_requested

    if context.locks.enqueue_released(Need.from_entry(entry["need"]), info, still_waits) is None:
        return False
    context.locks.wake_listeners()
    return True


def cancel(context: ServerContext, record: JobRecord) -> bool:
    """Cancel a held job at once (its cancel was asked already: Ledger.request_cancel): it ends CANCELLED here
    unless it has taken its place in line meanwhile (then the queue's cancel, or its supervisor, ends it). Returns
    whether it ended it."""
    if not is_held(record) or record.job_id in context.locks.queued_rows():
        return False  # a release that runs after this sees the cancel, and queues nothing
    return end(context, record.job_id, JobState.CANCELLED, f"job {record.job_id} was cancelled while waiting",
               "JobCancelledError")


def end(context: ServerContext, job_id: str, state: JobState, error: str, error_type: str) -> bool:
    """End a held job that never ran, if no process owns it yet; then its copies, payload and result key go (its
    outputs: none). Returns whether it ended it (not if another server or its supervisor did first)."""
    if not context.ledger.end(job_id, state, error, error_type, unowned=True):
        return False
    context.files.remove_working_dir(job_id)
    context.files.drop_payload(job_id)
    results.drop_job_key(context.files.path(job_id))
    log.info("job %s ended %s: %s", job_id, state.value, error)
    return True
