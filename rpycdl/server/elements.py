"""An array's elements (rpycdl.server.arrays) after their submit: their places in line as their array's
`max_running` allows (release), an element's payload made as it starts (payload), and what the array shares dropped
once no element of it is unfinished (ended).

An element waiting with no owner and no queue entry gets one while its array has room: all of them for an array
without `max_running`; else as many as keep the elements that are queued, claimed or running at `max_running`,
counted from the ledger and the queue under the queue lock, so that servers sharing the lock directory never start
more. An element ends its row before its supervisor lets go of it, so the next one's start comes after the last
one's end in the ledger too. Release runs at submit, at each element's end (ended) and at every sweep of every
server (release_all), which also carries on after a submitter that died half-way."""

from __future__ import annotations

import logging
import struct
from typing import Any

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import arrays
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.scheduler.queuedir import Need
from rpycdl.security import results
from rpycdl.server.context import ServerContext
from rpycdl.states import JobState
from rpycdl.wire import codec, elements

log = logging.getLogger("rpycdl.server")

ARGS, INDEX = "args", "args.index"
"""The array's files holding every element's argument, and where each begins (little-endian uint64, one more than
there are elements)."""

_OFFSET = struct.Struct("<QQ")

HOLD, FIRST_HOLD = 1000, 32
"""Elements given their places in line in one hold of the queue lock at most (each hold reads on from the last), and
in the first: the dispatchers start those while the rest are written, in holds twice as large each time."""


def release(context: ServerContext, array_id: str, queued: set[str] | None = None) -> int:
    """Give the array's waiting elements their places in line as its `max_running` allows (all of them, without
    one), in index order: FIRST_HOLD in the first hold of the queue lock (the dispatchers are woken then), twice as
    many in each next, up to HOLD; end those whose cancel was asked. `queued`, the rows in line read without the lock,
    lets an array with nothing to do cost no lock. Returns how many were queued."""
    array = arrays.get(context.ledger, array_id)
    if array is None:
        return 0
    try:
        entry = context.files.spec(array_id)["queue"]
    except (OSError, ValueError, KeyError) as exc:  # its files are gone: its waiting elements can never run
        waiting = [row[0] for row in arrays.live(context.ledger, array_id) if row[2] == 0]
        arrays.end_unowned(context.ledger, waiting, JobState.FAILED, f"its array's files are gone: {exc}",
                           type(exc).__name__)
        return 0
    need = Need.from_entry(entry["need"])
    cancelled: list[str] = []
    after, last, hold = [-1], [-1], [FIRST_HOLD]  # the last index this call gave a place: the next hold reads on

    def pick(rows_queued: set[str]) -> list[tuple[Need, dict[str, Any]]]:
        cancelled[:] = [job_id for job_id in arrays.cancelled_waiting(context.ledger, array_id)
                        if job_id not in rows_queued]
        room = hold[0] if array.max_running is None else min(
            hold[0], array.max_running - arrays.active(context.ledger, array_id, rows_queued))
        chosen = arrays.unqueued(context.ledger, array_id, after[0], room, rows_queued) if room > 0 else []
        last[0] = chosen[-1][1] if chosen else after[0]
        return [(need, {**entry["info"], "job_id": job_id, "array_index": index}) for job_id, index in chosen]

    if queued is not None and not pick(queued) and not cancelled:
        return 0
    total = first = 0
    while True:
        added = context.locks.enqueue_rows(pick)
        total += added
        if cancelled:
            arrays.end_unowned(context.ledger, cancelled, JobState.CANCELLED,
                               f"its array {array_id} was cancelled while it waited", "JobCancelledError")
        if added and not first:  # the dispatchers start these while the rest are written
            first = added
            context.locks.wake_listeners()
        if added < hold[0]:
            break
        after[0], hold[0] = last[0], min(HOLD, 2 * hold[0])
    if total > first:
        context.locks.wake_listeners()
    return total


def release_all(context: ServerContext) -> None:
    """Every sweep: release the arrays that have elements waiting with no owner."""
    waiting = arrays.waiting_arrays(context.ledger)
    if waiting:
        queued = context.locks.queued_rows()
        for array_id in waiting:
            release(context, array_id, queued)


def ended(context: ServerContext, record: JobRecord) -> None:
    """An element's supervisor, once its row has ended: the next elements of a limited array take their places in
    line now (not at the next sweep); the array's shared files go once no element of it is unfinished."""
    array_id = record.array_id
    if array_id is None:
        return
    array = arrays.get(context.ledger, array_id)
    if array is not None and array.max_running is not None:
        release(context, array_id)
    if not arrays.unfinished(context.ledger, array_id):
        drop_shared(context, array_id)


def drop_shared(context: ServerContext, array_id: str) -> None:
    """The array's payload, arguments, result key and working directory go (its spec stays, for what was asked)."""
    context.files.drop_payload(array_id)
    context.files.remove_working_dir(array_id)
    for name in (ARGS, INDEX):
        context.files.write(array_id, name, b"")
    results.drop_job_key(context.files.path(array_id))


def payload(context: ServerContext, record: JobRecord) -> bytes:
    """An element's payload body, made now: its array's function applied to its own argument (wire.elements).

    Raises:
        InvalidRequestError: the array's files are gone.
    """
    array_id, index = record.array_id, record.array_index
    assert array_id is not None and index is not None
    function = context.files.payload(array_id)
    bounds = context.files.read_at(array_id, INDEX, 8 * index, _OFFSET.size)
    if function is None or len(bounds) != _OFFSET.size:
        raise InvalidRequestError(f"job {record.job_id}: its array {array_id}'s payload is gone")
    start, end = _OFFSET.unpack(bounds)
    argument = context.files.read_at(array_id, ARGS, start, end - start)
    return codec.encode_payload(elements.run_element, (function, argument))[len(codec.MAGIC) + 2:]


