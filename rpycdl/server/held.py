"""Detached jobs held by their dependencies (submit's `after=`, rpycdl.scheduler.dependencies): resolved and judged
at submit; then, while they wait for other jobs' ends, a row of the ledger (PENDING, no owner, its `after` in its
request) and the job's files, with no place in line yet. Every server's sweep (release, at its start and every
SWEEP_INTERVAL) looks at the held jobs of its state directory: one whose dependencies are met takes its place in
line then, as submit would have (the queue entry it was to have is kept in its spec: supervisor.hand_over); one
whose dependencies can never be met ends FAILED with DependencyError, never having run; a cancelled one ends
CANCELLED. An array's elements wait alike (release_elements), but their rows are marked once their dependencies are
met, and their places in line are then their array's to give (rpycdl.server.elements), as its max_running allows.
Nothing but rows and files, so a held job survives every server's death: the next sweep of any server sharing the
state directory carries on."""

from __future__ import annotations

import logging
from collections.abc import Callable

from rpycdl.errors import DependencyError, InvalidRequestError
from rpycdl.scheduler import arrays, dependencies
from rpycdl.scheduler.dependencies import After, Verdict
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.scheduler.queuedir import Need
from rpycdl.security import results
from rpycdl.server import elements
from rpycdl.server.context import ServerContext
from rpycdl.states import JobState

log = logging.getLogger("rpycdl.server")


def check_after(text: object, find: Callable[[str], JobRecord], user: tuple[str, bool],
                context: ServerContext, size: int | None = None) -> tuple[str, bool] | None:
    """Check a submit's `after=` (None: none), resolve each job it names to its id (`find`: by id, or by name among
    the caller's jobs, an array's element `NAME[INDEX]` too; `user`, the caller's name and whether it is verified;
    else an array of that id, or of the caller's of that name: its id, waiting for every element) and judge it now.
    An array's submit (`size`, its elements) may name one array element by element (`NAME[*]`: each element waits
    for its peer of the same index; the arrays must be as big), judged by the sweeps (release_elements). Returns the
    dependency as the job keeps it ("ok:ID,ID", "ok:ID[*]") and whether the job must wait (False: met already, it
    takes its place in line at once).

    Raises:
        InvalidRequestError: bad syntax, a job no one here knows (named), `[*]` but for an array of the same size.
        DependencyError: a dependency that has ended so that it can never be met: nothing is submitted.
    """
    if text is None:
        return None
    asked = dependencies.parse(text)
    rows: dict[str, JobRecord | list[JobRecord]] = {}
    peers = []
    for ref in asked.refs:
        if ref.endswith(dependencies.EACH):
            peers.append(_peer(text, ref[:-len(dependencies.EACH)], user, context, size))
            continue
        try:
            row = find(ref)
        except InvalidRequestError as exc:
            array = arrays.find(context.ledger, ref, *user)
            if array is None:
                raise InvalidRequestError(f"after={text!r}: {exc} (nor an array)") from None
            rows[array.array_id] = arrays.deciding(context.ledger, array.array_id)
            continue
        rows[row.job_id] = row
    if len(peers) > 1:
        raise InvalidRequestError(f"after={text!r}: an array waits element by element for one array at most")
    after = After(asked.kind, tuple(rows))
    verdict = dependencies.judge(after, rows)
    broken = verdict.broken
    if broken is not None:
        mine = [broken.job_id] if (broken.user, broken.user_verified) == user else []
        raise DependencyError(dependencies.reason("not submitted", after, verdict, mine))
    return str(After(asked.kind, (*after.refs, *peers))), not verdict.met or bool(peers)


def _peer(text: object, ref: str, user: tuple[str, bool], context: ServerContext, size: int | None) -> str:
    """`after=`'s `ref[*]` resolved: the array `ref` names (its id, or one of the caller's names) as kept, `ID[*]`.

    Raises:
        InvalidRequestError: not an array's submit, no such array, or not one of `size` elements.
    """
    if size is None:
        raise InvalidRequestError(f"after={text!r}: {ref}{dependencies.EACH} waits element by element, which only an "
                                  "array does (submit_array): name the whole array, or one element (NAME[INDEX])")
    array = arrays.find(context.ledger, ref, *user)
    if array is None:
        raise InvalidRequestError(f"after={text!r}: no array {ref!r} here")
    if array.size != size:
        raise InvalidRequestError(f"after={text!r}: array {array.array_id} has {array.size} elements and this one "
                                  f"{size}: element by element, they must be as many")
    return array.array_id + dependencies.EACH


def is_held(record: JobRecord) -> bool:
    """Whether a row may be a held job's: PENDING, no owner, with dependencies, never run (a requeued one's
    dependencies were met: rpycdl.server.retries; whether it is in line yet is the queue's to say)."""
    return record.state is JobState.PENDING and record.owner_pid == 0 and bool(record.request.get("after")) \
        and record.attempt == 1


def release(context: ServerContext) -> list[tuple[str, str]]:
    """One sweep over the held jobs of this server's state directory: queue those whose dependencies are met, end
    those that can never run (DependencyError) or were cancelled; arrays' held elements too (release_elements).
    Returns (job id, what became of it)."""
    done = release_elements(context)
    held = [record for record in context.ledger.unfinished(owned=False, after=True) if is_held(record)]
    if not held:
        return done
    queued = context.locks.queued_rows()
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


def release_elements(context: ServerContext, array_id: str | None = None) -> list[tuple[str, str]]:
    """One sweep over the arrays whose elements wait for their dependencies (every one, or `array_id`'s): those met
    are marked so (arrays.mark_met), and take their places in line as their array's max_running allows
    (rpycdl.server.elements); those that never can be end FAILED with DependencyError, never having run. The jobs
    all elements wait for are judged once per array; an element that waits for its peer (`ID[*]`), once that has
    ended. Returns (job id, what became of it)."""
    done: list[tuple[str, str]] = []
    for held_array, text in arrays.held(context.ledger):
        if array_id in (None, held_array):
            done += _judge_elements(context, held_array, dependencies.parse(text))
    return done


def _judge_elements(context: ServerContext, array_id: str, after: After) -> list[tuple[str, str]]:
    ledger, array = context.ledger, arrays.get(context.ledger, array_id)
    common, peer = dependencies.split(after)
    verdict = dependencies.judge(common, _rows(context, common))
    if array is None or verdict.waits:
        return []
    owner = (array.user, array.user_verified)
    failed: list[str] = []
    if verdict.met:
        met = []
        for job_id, index, peer_id in arrays.held_elements(ledger, array_id, peer):
            if peer is None:
                met.append(job_id)
                continue
            one = After(after.kind, (peer_id or f"{peer}[{index}]",))  # its peer's id, or where it was
            mine = dependencies.judge(one, {one.refs[0]: None if peer_id is None else ledger.get(peer_id)})
            if mine.met:
                met.append(job_id)
            elif not mine.waits:
                failed += _end_held(context, [job_id], f"job {job_id}", one, mine, owner)
        arrays.mark_met(ledger, met)
        done = [(job_id, "met") for job_id in met]
    else:
        waiting = [job_id for job_id, _, _ in arrays.held_elements(ledger, array_id, None)]
        failed += _end_held(context, waiting, f"array {array_id}'s element", common, verdict, owner)
        done = []
    if failed and not arrays.counts(ledger, array_id)["unfinished"]:
        elements.drop_shared(context, array_id)
    return done + [(job_id, "failed") for job_id in failed]


def _end_held(context: ServerContext, job_ids: list[str], who: str, after: After, verdict: Verdict,
              owner: tuple[str, bool]) -> list[str]:
    """End held elements that never can run (DependencyError), the error of the job that broke their dependency
    told if that job is their owner's too; the ids of those ended here."""
    broken = verdict.broken
    shown = [broken.job_id] if broken is not None and (broken.user, broken.user_verified) == owner else []
    return arrays.end_unowned(context.ledger, job_ids, JobState.FAILED,
                              dependencies.reason(who, after, verdict, shown), DependencyError.__name__)


def _reason(record: JobRecord, after: After, verdict: Verdict) -> str:
    """Why it never runs; the error of the job that broke it told if that job is its owner's too."""
    broken = verdict.broken
    same = broken is not None and (broken.user, broken.user_verified) == (record.user, record.user_verified)
    return dependencies.reason(f"job {record.job_id}", after, verdict, [broken.job_id] if same and broken else [])


def take_place(context: ServerContext, record: JobRecord, waits: Callable[[JobRecord], bool],
               deadline_from: float | None = None, place: int | None = None) -> bool:
    """Give a job that waits with no place in line (held, requeued) its place: the entry its submit made ready
    (supervisor.hand_over; an array's element: its array's, rpycdl.server.arrays), unless it has one, or its row,
    read again under the queue lock, no longer `waits` or was cancelled, or its array has no room (its
    max_running); with `deadline_from`, its queue deadline counts from then; with `place`, it goes in line where
    that ticket went (a preempted job's, requeued). A job whose entry cannot be read ends FAILED. Returns whether it
    took its place."""
    job_id, array_id = record.job_id, record.array_id
    try:
        entry = context.files.spec(array_id or job_id)["queue"]
    except (OSError, ValueError, KeyError) as exc:
        return end(context, job_id, JobState.FAILED, f"job {job_id} could not take its place in line: {exc}",
                   type(exc).__name__)
    info, timeout = {**entry["info"], "job_id": job_id}, record.request.get("queue_timeout")
    if array_id is not None:
        info["array_index"] = record.array_index
    if deadline_from is not None:
        info["deadline"] = None if timeout is None else deadline_from + timeout
    if place is not None:
        info["place"] = place

    def still_waits() -> bool:
        now = context.ledger.get(job_id)
        return now is not None and waits(now) and not now.cancel_requested and (
            array_id is None or arrays.has_room(context.ledger, array_id, context.locks.queued_rows()))

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
