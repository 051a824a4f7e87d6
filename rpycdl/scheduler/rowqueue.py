"""The queue's rows, detached jobs waiting in line with no process (rpycdl.server.supervisor): the part of the GPU
lock manager (rpycdl.scheduler.locks.GPULockManager) that makes their entries (one, many, or one held by its
dependencies), drops them (a cancel), claims them for a dispatcher when their turn comes (dispatch), and grants
an array's next element to the supervisor of the last (hand_over)."""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import Any

from rpycdl.defaults import DISPATCH_LOOKAHEAD
from rpycdl.scheduler import policyfiles
from rpycdl.scheduler.holders import Grant
from rpycdl.scheduler.policies import FCFS
from rpycdl.scheduler.queuedir import TICKET, Need, Place, in_line


class RowQueue:
    """The rows' part of GPULockManager (its queue lock, queue directory, counters, policy and grants)."""

    def enqueue_row(self, need: Need, info: dict[str, Any]) -> int:
        """Take a place in line for `need` that no process keeps: a detached job waiting as its row alone. Its
        entry, marked `row`, stays until a server claims it when its turn comes (dispatch) and the supervisor
        it starts for it is granted or gives up, or until it is dropped (drop_row). Returns its ticket.

        Raises:
            InvalidRequestError: an impossible request.
        """
        need.check()
        with self._locked():
            return self._add_row(need, info)

    def enqueue_released(self, need: Need, info: dict[str, Any], still_held: Callable[[], bool]) -> int | None:
        """enqueue_row for a job held by its dependencies (rpycdl.server.held), once: unless its row is in the queue
        already, or `still_held()`, asked under the queue lock, says it no longer waits (an entry leaves the queue
        only once its job has an owner or has ended, so two servers releasing it at once queue it once). Returns
        its ticket, or None."""
        need.check()
        with self._locked():
            if info["job_id"] in self._queue.rows() or not still_held():
                return None
            return self._add_row(need, info)

    def _add_row(self, need: Need, info: dict[str, Any]) -> int:
        """Under the queue lock: the next ticket, its entry a row's; the ticket."""
        ticket = self._next(TICKET)
        self._queue.write(ticket, {**info, **need.entry(), "row": True})
        return ticket

    def dispatch(self, mine: Callable[[dict[str, Any]], bool] = lambda entry: True, ahead: int | None = None,
                 lookahead: int = DISPATCH_LOOKAHEAD) -> list[tuple[dict[str, Any], Place]]:
        """Claim the rows the caller may start (`mine`) that are among the first `ahead` in line for their GPUs
        (unless told, as many as could run at once on them: Need.at_once; their supervisors wait as any request
        does, so that a release hands over every GPU it frees at once; none for an array's elements, which the
        supervisors of those that run take in turn: hand_over), whose turn has come (the policy would grant them
        now; an array's elements, as many as the GPUs free now can run, in order: policies.decide's `eager`), or
        whose `deadline` passed. Each gets its wake-up FIFO, the claim (one dispatcher wins it), whose
        descriptor the caller hands to the supervisor it starts for the row, or closes; a row whose FIFO nobody
        holds open is claimable again. In the policy's order, it decides for at most `lookahead` rows per set of
        candidate GPUs that cannot go (those behind them wait too). Returns each claimed row's entry and place."""
        claimed: list[tuple[dict[str, Any], Place]] = []
        placed: dict[tuple[str, ...], int] = {}  # rows met so far, by their candidates
        blocked: dict[tuple[str, ...], int] = {}
        # The queue as it is read now, without the lock (a grant waits on it): what is decided from it is only a
        # start; the supervisor, a request as any, is granted in its turn or waits.
        waiters = self._queue.waiters(prune=False)
        ordered = policyfiles.in_order(self.root, self.scheduling, waiters, self._holders.records())
        places = {waiter["ticket"]: index for index, waiter in enumerate(waiters)}  # waiters: in ticket order
        now = time.time()
        for entry in ordered:
            if not entry.get("row"):
                continue
            key, ticket = tuple(entry["candidates"]), entry["ticket"]
            placed[key] = placed.get(key, 0) + 1
            if not mine(entry) or blocked.get(key, 0) >= lookahead:
                continue
            with self._locked():  # the claim: one dispatcher makes its FIFO
                if not self._queue.exists(ticket) or self._queue.claimed(ticket):
                    continue
                need = Need.from_entry(entry)
                if placed[key] > (ahead if ahead is not None else 0 if entry.get("array_id") else need.at_once()) and (
                        entry.get("deadline") is None or entry["deadline"] > now):
                    index = places[ticket]
                    others = waiters[:index] + [other for other in waiters[index + 1:] if self.scheduling.policy
                                                != FCFS or in_line(other) < in_line(entry)]
                    decision = self._decide(ticket, need, entry, others, eager=bool(entry.get("array_id")))[0]
                    if not decision.uuids:  # a row over its owner's limits holds nobody back: not counted
                        blocked[key] = blocked.get(key, 0) + (not decision.reason)
                        continue
                claimed.append((entry, Place(ticket, self._queue.open_fifo(ticket))))
        return claimed

    def drop_row(self, job_id: str) -> bool:
        """Remove job `job_id`'s row from the queue unless a supervisor holds it (a cancel): False if it has
        none, or its supervisor was started (which then sees the cancel as any waiting job does)."""
        return bool(self.drop_rows({job_id}))

    def drop_rows(self, job_ids: Container[str]) -> set[str]:
        """drop_row for many jobs (an array's elements), in one hold of the queue lock; the ids of those dropped."""
        with self._locked():
            return self._queue.drop_rows(job_ids)

    def enqueue_rows(self, pick: Callable[[set[str]], list[tuple[Need, dict[str, Any]]]]) -> int:
        """enqueue_row for the rows `pick` chooses, told the ids of the rows in line now, in one hold of the queue
        lock (an array's elements: rpycdl.server.arrays counts its limit and queues them there). How many."""
        with self._locked():
            chosen = pick(self._queue.rows())
            for ticket, (need, info) in enumerate(chosen, self._next(TICKET, len(chosen)) if chosen else 0):
                self._queue.write(ticket, {**info, **need.entry(), "row": True})
        return len(chosen)

    def lined_up(self, array_id: str) -> bool:
        """Whether a row of the array `array_id` is in line (claimed or not); no lock."""
        return self._queue.has_row(array_id)

    def queued_rows(self) -> set[str]:
        """The ids of the jobs waiting as rows (claimed or not); no lock."""
        return self._queue.rows()

    def hand_over(self, grant: Grant, array_id: str, info: dict[str, Any],
                  claim: Callable[[str], bool]) -> tuple[Grant, dict[str, Any]] | None:
        """Release `grant` and, in the same hold of the queue lock, grant to this process the first row of the array
        `array_id` in line that no supervisor holds, if the policy lets it go now (as any request: only when it
        heads its line) and `claim(job_id)` makes its job this process's: the supervisor of an array's element runs
        the next one without a new process (rpycdl.server.handover). `info`: its grant's owner, leader and
        server_process. Returns the grant and the row's entry; None (nobody woken meanwhile) if no row could go: its
        GPUs are free, and every waiter is woken."""
        with self._locked():
            self._holders.unlock(grant)
            entry, granted = self._queue.first_row(array_id), None
            if entry is not None:
                shown = {key: value for key, value in entry.items() if key not in (*Need.KEYS, "row", "since")}
                granted = self._try_grant(entry["ticket"], Need.from_entry(entry), {**shown, **info},
                                          lambda: claim(entry["job_id"]))[0]
        if granted is None:
            self.wake_all()
            return None
        return granted, entry
