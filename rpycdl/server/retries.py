"""Detached jobs requeued by their `retries=` (rpycdl.scheduler.attempts): the row of a job whose attempt was
requeued (by its supervisor, or by a sweep that found its supervisor dead) waits PENDING with no owner and no place
in line. Every server's sweep (release, at its start and every SWEEP_INTERVAL) gives it its place in line, behind
whatever waits there then, once nothing of its last attempt holds a GPU (no held/ record names the job: a grant
left by a dead supervisor is cleared only once nothing of the job runs, and the job's next attempt must never be
taken for what the last one left); a cancelled one ends CANCELLED. As held jobs (rpycdl.server.held), only rows
and files: a requeued job survives every server's death, and the next sweep of any server sharing the state
directory carries on."""

from __future__ import annotations

import logging

from rpycdl.scheduler import sweep
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.server import held
from rpycdl.server.context import ServerContext
from rpycdl.states import JobState

log = logging.getLogger("rpycdl.server")


def is_requeued(record: JobRecord) -> bool:
    """Whether a row may be a requeued job's waiting for no process (in line, or for its place in it)."""
    return record.state is JobState.PENDING and record.owner_pid == 0 and record.attempt > 1


def release(context: ServerContext) -> list[tuple[str, str]]:
    """One sweep over the requeued jobs of this server's state directory: give those with no place in line one,
    once no grant names them; end those cancelled. Returns (job id, what became of it)."""
    requeued = context.ledger.requeued()
    if not requeued:
        return []
    queued, holding = context.locks.queued_rows(), None
    done = []
    for record in requeued:
        if record.job_id in queued:
            continue
        if record.cancel_requested:
            if _end_cancelled(context, record):
                done.append((record.job_id, "cancelled"))
            continue
        holding = _holding(context) if holding is None else holding
        if record.job_id not in holding and _enqueue(context, record):
            done.append((record.job_id, "queued"))
    return done


def _holding(context: ServerContext) -> set[str]:
    """The jobs that a grant names: held, or left by a holder that died (cleared once nothing of it runs)."""
    records = [record for found in context.locks.held().values() for record in found]
    return {str(record.get("job_id")) for record in records + [record for _, record in context.locks.orphans()]}


def _enqueue(context: ServerContext, record: JobRecord) -> bool:
    """Give a requeued job its place in line again (held.take_place), its queue deadline counted from its requeue,
    unless it has one or no longer waits so: a preempted attempt's own place (its ticket), another's behind whatever
    waits then. Returns whether it did."""
    since = [attempt["ended"] for attempt in context.ledger.attempts(record.job_id)][-1:] or [record.submitted]
    place = next((row["ticket"] for row in context.ledger.preemptions(record.job_id)  # a preempted attempt's place
                  if row["attempt"] == record.attempt - 1 and row["outcome"] == "requeued"), None)
    if not held.take_place(context, record, lambda now: is_requeued(now) and now.attempt == record.attempt, since[0],
                           place):
        return False
    log.info("job %s takes its place in line again: attempt %d", record.job_id, record.attempt)
    return True


def cancel(context: ServerContext, record: JobRecord) -> bool:
    """Cancel a requeued job at once (its cancel was asked already: Ledger.request_cancel) if it waits for its
    place in line; one in line is the queue's to cancel (supervisor.cancel_queued). Returns whether it ended it."""
    if not is_requeued(record) or record.job_id in context.locks.queued_rows():
        return False  # a release that runs after this sees the cancel, and queues nothing
    return _end_cancelled(context, record)


def _end_cancelled(context: ServerContext, record: JobRecord) -> bool:
    """End a requeued job cancelled between its attempts: as a held job that never ran (held.end), but what its
    earlier attempts left in its output directory stays on the server, for `rpycdl artifacts JOB --retry`."""
    job_id = record.job_id
    if not held.end(context, job_id, JobState.CANCELLED, f"job {job_id} was cancelled while waiting for its attempt "
                    f"{record.attempt}", "JobCancelledError"):
        return False
    sweep.keep_outputs(context.ledger, context.files, job_id, "the job was cancelled between its attempts")
    return True
