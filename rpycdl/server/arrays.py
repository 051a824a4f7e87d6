"""Job arrays on the server (submit_array, `rpycdl submit --array`): one request hands over every element, each an
ordinary detached job with its own id, row and place in line, while what they share is stored once.

- *Accepting* (hand_over): the array's files in jobs/<array id>/ (its spec, its function's payload, every element's
  argument in one file `args` with their offsets in `args.index`, its result key, its working directory kept once:
  jobdirs.keep), then every element's row and the array's row in one transaction (rpycdl.scheduler.arrays.save), then
  their places in line (release), once their dependencies are met (`after=`, the same for every element or each
  after its peer: rpycdl.server.held.release_elements). A pending element is its row and its queue entry: no file
  of its own, so it costs a few KiB. Its retries (`retries=`) are its own (rpycdl.server.retries).
- *Its place in line* and *running*: rpycdl.server.elements (release, at submit, at each element's end and at every
  sweep of every server; payload, made as an element starts; RPYCDL_ARRAY_INDEX in its environment). Until it has
  a queue entry an element is no job of the queue: the policies see those in line.
- *Cancel* (cancel): every unfinished element's cancel is asked at once, those in line no supervisor holds leave it,
  those without an entry end CANCELLED, and running ones are stopped by their supervisors.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from typing import Any

from rpycdl.defaults import MAX_ARRAY
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import arrays, limits
from rpycdl.scheduler.arrays import Array
from rpycdl.scheduler.jobrecord import new_job_id
from rpycdl.security import results
from rpycdl.server import elements, held, jobdirs, request, supervisor
from rpycdl.server.context import ServerContext
from rpycdl.server.jobflow import JobFlow, need_of, queue_info
from rpycdl.states import JobState
from rpycdl.wire import codec


def check(arguments: Sequence[bytes], max_running: Any) -> int | None:
    """Check an array's arguments (each a pickle, read without running it) and its `max_running`; returns it.

    Raises:
        InvalidRequestError: no elements, more than MAX_ARRAY, an argument that is not a pickle, or a max_running
            that is not a positive whole number.
    """
    if not 0 < len(arguments) <= MAX_ARRAY:
        raise InvalidRequestError(f"an array has 1 to {MAX_ARRAY} elements, not {len(arguments)}")
    if max_running is not None and (type(max_running) is not int or max_running < 1):
        raise InvalidRequestError(f"max_running= is a whole number of elements, 1 or more, or None, "
                                  f"not {max_running!r}")
    for index, argument in enumerate(arguments):
        codec.check_pickle(argument, f"the argument of element {index}")
    return max_running


def hand_over(context: ServerContext, checked: request.JobRequest, arguments: Sequence[bytes],
              max_running: int | None, seal: results.Seal | None) -> Array:
    """Accept an array: its files, its rows, its elements' places in line (release). Returns the array.

    Raises:
        InvalidRequestError: a name the user has an unfinished job or array of.
        LimitError: the queue has no room for so many elements (--max-queued, --max-queued-per-user).
    """
    ledger, files, count = context.ledger, context.files, len(arguments)
    _check_room(context, checked, count)
    if checked.name is not None:
        existing = ledger.find(checked.name, checked.owner.user)
        if existing is not None and not existing.state.finished and existing.name == checked.name:
            raise supervisor._duplicate(checked.name, existing)
        other = arrays.unfinished_named(ledger, checked.name, checked.owner.user)
        if other is not None:
            raise InvalidRequestError(f"you already have an unfinished array named {checked.name!r} "
                                      f"({other.array_id}): choose another name=, or cancel it first")
    template = JobFlow.new_record(context, checked)
    array = Array(new_job_id(), template.user, template.user_verified, checked.name, count, max_running,
                  template.submitted, context.server_id, template.kind)
    template.owner_pid, template.owner_start = 0, 0
    if seal is not None:
        template.result_nonce, template.result_key_id = seal.nonce, seal.key_id
    job_ids = [new_job_id() for _ in range(count)]
    deadline = None if checked.queue_timeout is None else template.submitted + checked.queue_timeout
    entry = {"need": need_of(context, template).entry(), "info": {
        **queue_info(context, template, checked), "state_dir": context.state_dir, "deadline": deadline,
        "array_id": array.array_id}}
    offsets = [0]
    for argument in arguments:
        offsets.append(offsets[-1] + len(argument))
    files.begin(array.array_id)
    try:
        files.create(array.array_id, {**supervisor._spec(context, checked, None), "queue": entry,
                                      "array": array.to_dict()}, checked.body)
        files.write(array.array_id, elements.ARGS, b"".join(arguments))
        files.write(array.array_id, elements.INDEX, struct.pack(f"<{len(offsets)}Q", *offsets))
        if seal is not None:
            results.write_job_key(files.path(array.array_id), seal.key)
        if checked.working_dir is not None:  # once, for every element: each copies it as it starts (jobdirs)
            jobdirs.keep(context, array.array_id, checked.working_dir)
        arrays.save(ledger, array, template, job_ids)
        files.recorded(array.array_id)
    except BaseException:
        files.remove(array.array_id)
        raise
    if checked.after is not None:  # those met already take their places now
        held.release_elements(context, array.array_id)
    elements.release(context, array.array_id)
    return array


def _check_room(context: ServerContext, checked: request.JobRequest, count: int) -> None:
    """Raise LimitError unless this server's queue, the user's share of it, and the host's --limits file
    (`pending`, `gpus`) have room for `count` more."""
    asked = checked.gpu_request
    limits.check_request(context.lock_dir, checked.owner.user, 0 if asked.share_bytes else asked.ngpus,
                         context.locks.queue, count=count)
    waiting, mine = context.ledger.waiting(context.server_id, checked.owner.user, checked.owner.verified)
    server = context.limits
    if waiting + count > server.max_queued:
        raise LimitError(f"this server's queue has room for {max(0, server.max_queued - waiting)} more requests, "
                         f"and the array has {count} elements (--max-queued {server.max_queued}): nothing was "
                         "submitted")
    if mine + count > server.max_queued_per_user:
        raise LimitError(f"{checked.owner.label} has {mine} requests waiting on this server, and the array's {count} "
                         f"elements would pass the limit per user of {server.max_queued_per_user} "
                         "(--max-queued-per-user): nothing was submitted")


def cancel(context: ServerContext, array: Array) -> int:
    """Cancel every unfinished element of the array (its owner's or an admin's call); returns how many were asked."""
    ledger = context.ledger
    asked = arrays.cancel_all(ledger, array.array_id)
    waiting = [job_id for job_id, _, owner, state, _ in arrays.live(ledger, array.array_id)
               if owner == 0 and state == JobState.PENDING.value]
    context.locks.drop_rows(set(waiting))
    queued = context.locks.queued_rows()  # after the drop: those a supervisor holds stay, and see the cancel
    arrays.end_unowned(ledger, [job_id for job_id in waiting if job_id not in queued], JobState.CANCELLED,
                       f"its array {array.array_id} was cancelled while it waited", "JobCancelledError")
    if not arrays.counts(ledger, array.array_id)["unfinished"]:
        elements.drop_shared(context, array.array_id)
    context.locks.wake_all()  # the supervisors of running elements see the cancel
    return asked


def view(context: ServerContext, array: Array) -> dict[str, Any]:
    """What a client sees of an array: its row, its elements' counts by state, their ids in index order, its
    seal's nonce and key id (the same for every element), read at `read_at`, and why its owner's limits hold its
    waiting elements back (`reasons`: held_back)."""
    first = arrays.elements(context.ledger, array.array_id, 0, 1)
    ids = arrays.job_ids(context.ledger, array.array_id)
    counts = arrays.counts(context.ledger, array.array_id)
    return {**array.to_dict(), "counts": counts, "job_ids": ids,
            "result_nonce": first[0].result_nonce if first else None,
            "result_key_id": first[0].result_key_id if first else None, "read_at": time.time(),
            "reasons": held_back(context, set(ids)) if counts.get("PENDING") else []}


def held_back(context: ServerContext, job_ids: set[str]) -> list[str]:
    """Why the owner's limits hold back the waiting jobs of `job_ids` (rpycdl.scheduler.limits), each reason once,
    in the order of the queue (none while no limits are in force)."""
    if limits.in_force(context.locks.root) is None:
        return []
    found = [waiter["reason"] for waiter in context.locks.snapshot()["queue"]
             if waiter.get("job_id") in job_ids and waiter.get("reason")]
    return list(dict.fromkeys(found))
