"""The ledger's upkeep, by every server's sweep: jobs whose owning process died are ended (what is
left of them killed first), and finished jobs past their retention are removed with their files."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

from rpycdl.defaults import KILL_WAIT
from rpycdl.scheduler import arrays, attempts, procs
from rpycdl.scheduler.jobfiles import JobFiles
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.states import JobState


def end_orphaned(ledger: Ledger, files: JobFiles, queued: Callable[[], set[str]]) -> list[JobRecord]:
    """End the unfinished jobs, of any server, whose owner died: an attached job's connection process
    (FAILED, or CANCELLED if a cancel was asked), a detached job's supervisor (LOST; or, with retries left, requeued:
    rpycdl.scheduler.attempts, its files kept). What is left of each job is killed first (rpycdl.scheduler.procs),
    and its working directory removed (its outputs stay on the server). A detached job still `queued` as a row (the
    ids of those) is no orphan: its supervisor died before its grant, and a dispatcher starts another. Returns the
    jobs ended or requeued here, as their rows now say (a requeued one PENDING)."""
    ended = []
    rows = None
    for record in ledger.unfinished(owned=True):
        if procs.alive(record.owner_pid, record.owner_start):
            continue
        if record.detached and record.state is JobState.PENDING:
            rows = queued() if rows is None else rows
            if record.job_id in rows:
                continue
        leader = (record.pgid, record.leader_start) if record.pgid else None
        procs.kill_until_gone(functools.partial(procs.job_processes, record.job_id, leader), KILL_WAIT)
        if record.detached:
            state, error_type = JobState.LOST, "JobLostError"
            why = f"its supervisor (pid {record.owner_pid}) died before the job ended: its outcome is unknown"
            lost = dataclasses.replace(record, state=state, error=record.error or why, error_type=error_type,
                                       ended=time.time())
            spent = len(ledger.preemptions(record.job_id))  # those a preemption requeued spend none of its retries=
            if attempts.retryable(record, attempts.LOST, spent) and ledger.requeue(lost):
                ended.append(dataclasses.replace(record, state=JobState.PENDING, error=lost.error))
                continue
        else:
            state = JobState.CANCELLED if record.cancel_requested else JobState.FAILED
            error_type, why = "JobCrashedError", "the connection process serving this job died"
        files.remove_working_dir(record.job_id)  # before its end: a sweep killed after it leaves the next one nothing
        if ledger.end(record.job_id, state, record.error or why, error_type):
            ended.append(record)
            keep_outputs(ledger, files, record.job_id, "the job's owner died before uploading its outputs")
    return ended


def keep_outputs(ledger: Ledger, files: JobFiles, job_id: str, why: str) -> None:
    """Say in the ledger that what an ended job left in its output directory stays on the server (`why` it was not
    uploaded), for `rpycdl artifacts JOB --retry`; nothing if it left nothing."""
    if any(files.output_dir(job_id).glob("*")):
        ledger.set_artifacts(job_id, "failed", [], f"{why}: they stay on the server: rpycdl artifacts {job_id} --retry")


def end_unqueued(ledger: Ledger, files: JobFiles, queued: Callable[[], set[str]]) -> list[str]:
    """End as LOST the rows that wait for no process and are not `queued` any more (a cancel that died between
    taking the row from the queue and ending it). The queue is read after the ledger (a row's entry is made
    before its row), and a row a dispatcher started meanwhile has an owner: it is left alone, as is a row with
    dependencies (`after`), which waits with no entry until they are met (rpycdl.server.held), a requeued one
    (rpycdl.server.retries gives it its entry), or an array's element (its place in line is rpycdl.server.elements's
    to give). Returns their ids."""
    ended = []
    unowned = [record.job_id for record in ledger.unfinished(owned=False)
               if not record.request.get("after") and record.attempt == 1 and record.array_id is None]
    rows = queued() if unowned else set()
    for job_id in unowned:
        if job_id not in rows and ledger.end(job_id, JobState.LOST, "its place in line was lost before it ran",
                                               "JobLostError", unowned=True):
            files.remove_working_dir(job_id)
            ended.append(job_id)
    return ended


def remove_unrecorded(ledger: Ledger, files: JobFiles, drop_row: Callable[[str], bool]) -> list[str]:
    """Remove the files of jobs whose maker died before their row was in the ledger (JobFiles.begin), and their
    place in line (`drop_row`): no row, so end_orphaned would never see them. Returns their ids."""
    removed = []
    for job_id, (pid, start) in files.unrecorded().items():
        if procs.alive(pid, start):
            continue
        if ledger.get(job_id) is None and arrays.get(ledger, job_id) is None:  # read after the maker's death
            removed.append(job_id)
            drop_row(job_id)
            files.remove(job_id)
        else:  # end_orphaned's to end, if it has not ended
            files.recorded(job_id)
    return removed


def prune(ledger: Ledger, files: JobFiles, keep: float) -> list[str]:
    """Remove the jobs that ended more than `keep` seconds ago, their files with them; returns their ids."""
    removed = ledger.prune(time.time() - keep)
    for job_id in removed:
        files.remove(job_id)
    return removed
