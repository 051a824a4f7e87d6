"""Idle GPUs reclaimed (`rpycdl serve --idle-reclaim 30m`): a job or session whose GPUs show no utilization for that
long is warned on its output (its client's stderr, a detached job's log), then stopped so that others get the GPUs:
an attached job or a session ends with IdleReclaimedError, a detached job with retries left is requeued
(rpycdl.scheduler.attempts.RECLAIMED), one without ends with the error. The process running the job looks
(rpycdl.gpu.idle), in the job's Stop (rpycdl.server.jobflow) and a session's look between calls.

A request may keep its GPUs however idle with `idle_reclaim=False`, within its owner's allowance: `keep_idle` of the
limits file (rpycdl.scheduler.limits), how many of the user's unfinished jobs may ask so at once, 0 by default; one
more is refused (LimitError). Two such requests at the same instant may both pass the count."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import rpyc

from rpycdl.defaults import IDLE_RECLAIM_WARNING
from rpycdl.errors import IdleReclaimedError, InvalidRequestError, LimitError
from rpycdl.gpu.idle import IdleWatch
from rpycdl.scheduler import attempts, limits
from rpycdl.security.auth import Identity
from rpycdl.server.context import ServerContext
from rpycdl.server.runner import Ending
from rpycdl.states import JobState
from rpycdl.units import format_duration

KEEP = "keep_idle"
"""The limits file's key: how many of a user's jobs may ask idle_reclaim=False at once."""
HOW_TO_KEEP = ("to keep a GPU however idle, ask with idle_reclaim=False (run_code, submit, session), within your "
               "allowance (keep_idle in the server's limits file)")


class Reclaim:
    """A running job's idle watch: check() warns once its GPUs have been idle for --idle-reclaim less the warning's
    lead, and stops the job once they have been idle for all of it (a look that finds them used starts over)."""

    def __init__(self, context: ServerContext, record: Any, uuids: list[str]) -> None:
        self._record, self._after = record, context.limits.idle_reclaim
        self._lead = min(self._after / 2, IDLE_RECLAIM_WARNING)
        self._watch = IdleWatch(context.inventory, uuids)
        self._warned = False

    def check(self, say: Callable[[str], None]) -> tuple[Ending, str] | None:
        """Why the job must stop now (Ending.IDLE, and the reason in words), or None; warns through `say` first."""
        idle = self._watch.idle_for()
        if idle < self._after - self._lead:
            self._warned = False
            return None
        if not self._warned:
            self._warned = True
            at = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() + self._after - idle))
            with contextlib.suppress(Exception):  # a client that went: its job ends anyway
                say(f"rpycdl: {self._what()}'s GPUs have shown no utilization for {format_duration(idle)}; this "
                    f"server reclaims GPUs idle for {format_duration(self._after)} (--idle-reclaim): at {at} it "
                    f"will be {self._fate()} unless they are used; {HOW_TO_KEEP}\n")
            return None
        if idle < self._after:
            return None
        return Ending.IDLE, (f"{self._what()}'s GPUs showed no utilization for {format_duration(idle)}, past this "
                             f"server's --idle-reclaim of {format_duration(self._after)}, and it was "
                             f"{self._fate()} so that others get them; {HOW_TO_KEEP}")

    def _what(self) -> str:
        return f"{self._record.kind if self._record.kind == 'session' else 'job'} {self._record.job_id}"

    def _fate(self) -> str:
        if attempts.retryable(self._record, attempts.RECLAIMED) and self._record.detached:
            return f"stopped and requeued (its attempt {self._record.attempt + 1})"
        return "ended"


def watch(flow: Any) -> Reclaim | None:
    """The idle watch of a running job's `flow` (rpycdl.server.jobflow.JobFlow), or None where nothing is reclaimed:
    the server has no --idle-reclaim, or the job asked idle_reclaim=False."""
    if not flow.context.limits.idle_reclaim or flow.record.request.get("idle_reclaim") is False:
        return None
    return Reclaim(flow.context, flow.record, list(flow.grant.uuids))


def later(sink: Any) -> Callable[[str], None]:
    """A writer to a client's output `sink` that does not wait for the client (a session between calls: its client
    may be waiting on its user, not reading the connection, and sees the text when it next does)."""
    def write(text: str) -> None:
        if sink is None:
            return
        try:
            send = rpyc.async_(sink)
        except TypeError:  # not a client's: written as it is
            send = sink
        send(text)

    return write


def check_keep(context: ServerContext, owner: Identity, idle_reclaim: Any) -> bool:
    """A request's `idle_reclaim=` (None: True), checked; returns whether the job keeps its GPUs however idle.

    Raises:
        InvalidRequestError: not True or False.
        LimitError: False, on a server that reclaims idle GPUs, over its owner's allowance (KEEP).
    """
    if idle_reclaim is None:
        return False
    if not isinstance(idle_reclaim, bool):
        raise InvalidRequestError(f"idle_reclaim={idle_reclaim!r}: must be True or False")
    if idle_reclaim or not context.limits.idle_reclaim:
        return not idle_reclaim
    rules = limits.in_force(Path(context.lock_dir))
    bounds = rules.bounds(owner.user, KEEP) if rules is not None else []
    allowed = [(bound.value, bound.where, bound.members) for bound in bounds] or [(0, f"default.{KEEP}", (owner.user,))]
    live = context.ledger.query(users=sorted({member for *_, members in allowed for member in members}),
                                states=[JobState.PENDING, JobState.RUNNING])
    for value, where, members in allowed:
        keeping = sum(1 for row in live if row.user in members and row.request.get("idle_reclaim") is False)
        if keeping + 1 > value:
            raise LimitError(f"idle_reclaim=False: {owner.user} may keep {value:g} job(s) from --idle-reclaim at "
                             f"once ({where} = {value:g}, the server's limits file; 0 unless it says), and "
                             f"{keeping} do; let this one be reclaimed when idle, or end one of them")
    return True


def ended_error(record: Any) -> IdleReclaimedError | None:
    """The error of a session that was reclaimed (its next call's), or None."""
    if record.error_type == IdleReclaimedError.__name__:
        return IdleReclaimedError(f"session {record.job_id}: {record.error}")
    return None
