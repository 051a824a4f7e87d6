"""An array's elements run in turn by one supervisor (rpycdl.server.supervisor): when an element's job has ended, its
supervisor hands its GPUs to the array's next element in line, if the policy lets that one go now
(GPULockManager.hand_over: as any request, only once it heads its line, after every earlier request that competes
for them), and runs it in a job process it asked of its server's forkserver while the last one ran. No supervisor
starts, no release wakes the waiters, no grant is waited for between two elements; and the last element's end (its
result kept and flushed to disk, its row's end, its outputs) is written once the next one's job has started, off the
GPUs' path.

The handover keeps every promise of a release followed by a grant: the last job's processes are gone before its
GPUs go on (JobFlow._end), the next element's row is owned by this supervisor before its entry leaves the queue (in
one hold of the queue lock, so no dispatcher starts another supervisor for it and no sweep gives it a place again),
and a supervisor that dies between the two leaves a grant whose holder died (its GPUs come back once nothing of it
runs) and a row whose owner died (LOST, or requeued by its `retries=`), as any supervisor that dies after its grant.
When no element may go (another request heads the line, none is left, no job process could be had), the GPUs are
released as usual, and the dispatchers start a supervisor for the next element when its turn comes."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable

from rpycdl.errors import LimitError
from rpycdl.scheduler import procs
from rpycdl.scheduler.holders import Grant
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.server import runner
from rpycdl.server.context import ServerContext

Handed = tuple[Grant, JobRecord, runner.JobProcess]
"""An element the last one's GPUs went to: its grant, its row (owned by this process), its job process."""


class Handover:
    """How one supervisor frees the GPUs of the elements of `array_id` it runs (release), and when what is left of
    each element's end is done (after)."""

    def __init__(self, context: ServerContext, array_id: str) -> None:
        self._context, self._array_id = context, array_id
        self._spare: runner.JobProcess | None = None  # the next element's job process, asked for as this one starts
        self._handed: Handed | None = None
        self._pending: list[Callable[[], None]] = []

    def release(self, grant: Grant) -> None:
        """Hand the GPUs of `grant` (its job's processes gone) to the array's next element in line, if it may go now
        and a job process is ready for it (take() gives it); else release them, waking every waiter."""
        ctx, spare = self._context, self._spare
        try:
            leader = spare.identity if spare is not None else None
        except LimitError:  # the forkserver could not fork it
            leader = None
        if leader is None:
            if spare is not None:  # one that could not be forked: another is asked for as the next element starts
                spare.close()
                self._spare = None
            ctx.locks.release(grant)
            return
        me = procs.myself()
        info = {"owner": list(me), "leader": list(leader), "server_process": list(ctx.server_process)}
        handed = ctx.locks.hand_over(grant, self._array_id, info,
                                     lambda job_id: ctx.ledger.set_owner(job_id, me, (0, 0)))
        if handed is None:
            return
        record = ctx.ledger.get(handed[1]["job_id"])
        assert record is not None, "the ledger lost a row this process was just made the owner of"
        self._handed, self._spare = (handed[0], record, spare), None

    def take(self) -> Handed | None:
        """The element the last one's GPUs went to, once; None if they were released."""
        handed, self._handed = self._handed, None
        return handed

    def after(self, end: Callable[[], None]) -> None:
        """Call `end`, what is left of an element's end, now; or, if its GPUs went to the next element, once that
        one's job has started (started), or this supervisor is done (close), in the order they came."""
        if self._handed is None and not self._pending:
            end()
        else:
            self._pending.append(end)

    def started(self) -> None:
        """The element this supervisor runs now has its job started: the ends the last ones left are done now (the
        last one's keeper, whose word on its end is read, is free then), and a job process for the next element is
        asked for (kept by that keeper: forklink.ForkServerLink.launch), if a row of the array is in line (none for an
        array whose `max_running` queues its next element only once this one has ended)."""
        self._end_pending()
        if self._spare is None and self._context.locks.lined_up(self._array_id):
            with contextlib.suppress(LimitError):  # no process to spare (or no forkserver): its GPUs will be released
                self._spare = runner.JobProcess(self._context.launcher)

    def close(self) -> None:
        """This supervisor is done: what is left of the last ends is done, its spare job process goes."""
        self._end_pending()
        if self._spare is not None:
            self._spare.close()

    def _end_pending(self) -> None:
        pending, self._pending = self._pending, []
        for end in pending:
            try:
                end()
            except Exception:  # noqa: BLE001 - each is its own element's: the others are done still
                traceback.print_exc()
