"""The GPU lock manager: first-come-first-served grants of whole GPUs, or of a share of one GPU's
memory, across every process sharing a lock directory.

Everything lives in one lock directory shared by every server of a host (and mounted into
every container):

    gpus/<uuid>.lock             the GPU's lock file (fcntl locks: rpycdl.scheduler.holders)
    held/<uuid>.<ticket>.json    who holds (part of) it: the job, its processes, its share, since
    queue/<ticket>.json          a waiting request: what it asks for and who it is
    queue/<ticket>.fifo          its wake-up pipe; a request that has died has no reader on it
    rows/<ticket>.json           a queued detached job: a waiting request no process keeps
    listeners/<name>.fifo        the wake-up pipe of a server's dispatcher, woken with the waiters
    queue.lock                   serialises taking tickets, granting and probing (a blocking fcntl
                                 lock: a process waiting for it is woken the moment it is free)
    counters                     the last ticket and the last grant sequence number, one line each

Arrival order is the ticket order. A request is granted when the GPUs it may use are free
after every earlier request has been served or has reserved what it waits for (so a later
request never overtakes an earlier one that competes for the same GPUs, while servers with
disjoint GPUs do not block each other). An earlier competing request that could be granted
now goes first, the later one waiting for its wake-up, so competing requests are granted
(numbered by Grant.sequence) in arrival order. A release, a grant and a cancelled wait write
a byte to every waiter's FIFO, so the next request is granted at once, not at the next poll.

A share goes to the fullest GPU that has room for it (best fit among GPUs that already hold
shares) and only breaks into an idle GPU when none has room, so whole GPUs stay available for
whole-GPU requests.

A detached job waits as a row: its entry is marked `row` and no process keeps it (it has no FIFO until
claimed), so it lives until it is granted or dropped. When the policy would grant it, a server's dispatcher
claims it by making its FIFO (dispatch) and hands the descriptor to the supervisor it starts, which then waits
and is granted as any request; a claim whose holder died lapses, and the row is claimed again.

Locks are freed by the kernel when their holder dies, without any wake-up: waiters re-check at
least every WAIT_FALLBACK_POLL seconds, and every LINGER_POLL while they wait for the processes
of a crashed job to die (a grant's record keeps its GPUs taken until then: holders).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import select
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rpycdl.defaults import KILL_WAIT, LINGER_POLL, WAIT_FALLBACK_POLL
from rpycdl.errors import QueueTimeoutError
from rpycdl.scheduler import limits, lockdir, planning, policies, policyfiles, preemption, procs
from rpycdl.scheduler.holders import Grant, Holders, Records, job_left
from rpycdl.scheduler.load import read_load
from rpycdl.scheduler.planning import Range
from rpycdl.scheduler.policies import BACKFILL, FAIR, FCFS, Rules, Scheduling
from rpycdl.scheduler.queuedir import GRANT, TICKET, Need, Place, QueueDir, in_line
from rpycdl.scheduler.rowqueue import RowQueue
from rpycdl.states import need_text

_COUNTER_WIDTH = 20


class GPULockManager(RowQueue):
    """Grants whole GPUs, or a share of one GPU, first come, first served, across every process
    sharing `lock_dir`.

    Args:
        lock_dir: the directory shared by every server on the host.
        scheduling: the host's policy and placement (rpycdl.scheduler.policies), the same in every process
            that grants from the directory (claim_scheduling).
        sleep_poll: the longest a waiter sleeps between re-checks when not woken.
    """

    def __init__(self, lock_dir: str | os.PathLike[str], scheduling: Scheduling | None = None,
                 sleep_poll: float = WAIT_FALLBACK_POLL) -> None:
        self.root = Path(lock_dir)
        self.scheduling = scheduling or Scheduling()
        for sub in ("", "gpus", "held", "queue", "rows", "listeners", "ranked", preemption.MARKS):
            lockdir.shared_dir(self.root / sub)
        lockdir.shared_file(self.root / "counters")
        if lockdir.writable():  # a reader (a monitor) takes no lock: it only probes
            self._queue_fd = lockdir.open_once(str(self.root / "queue.lock"))
        self._holders = Holders(self.root)
        self._queue = QueueDir(self.root)
        self._sleep_poll = sleep_poll

    # -- the queue lock and counters ---------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold queue.lock. It waits in the kernel, not in a retry loop that sleeps (fasteners sleeps
        10 to 100 ms between tries), so the next process in line gets it as soon as it is free."""
        fcntl.lockf(self._queue_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._queue_fd, fcntl.LOCK_UN)

    def _next(self, counter: int, count: int = 1) -> int:
        """Under the queue lock: the next value of a counter (TICKET or GRANT), or the first of `count`, in place."""
        fd = os.open(self.root / "counters", os.O_RDWR)
        try:
            offset = counter * _COUNTER_WIDTH
            value = int(os.pread(fd, _COUNTER_WIDTH, offset).strip() or 0) + 1
            os.pwrite(fd, f"{value + count - 1:0{_COUNTER_WIDTH - 1}d}\n".encode(), offset)
            return value
        finally:
            os.close(fd)

    # -- granting --------------------------------------------------------------------

    def acquire(self, need: Need, info: dict[str, Any], *, place: Place | None = None,
                queue_timeout: float | None = None, waited: float = 0.0, wake_fds: Sequence[int] = (),
                on_wake: Callable[[], None] | None = None, on_position: Callable[[int, str], None] | None = None,
                ) -> Grant:
        """Wait in line for what `need` asks for, and lock it.

        Args:
            need: the GPUs or the share.
            info: shown to others while waiting and holding (job_id, client, server, ...); for the
                grant to be found after a crash, it names the job: `job_id`, `leader` (the job
                process, [pid, start]: procs.Pid) and `server_process` (the server parent, which
                adopts what the job leaves when its connection process dies).
            place: the request's place in line, taken already (enqueue), which this process now keeps;
                None takes one now.
            queue_timeout: seconds to wait at most; None waits for as long as it takes.
            waited: seconds of queue_timeout the request spent waiting already (a detached job's, as a row).
            wake_fds: other file descriptors that end a sleep when readable.
            on_wake: called after each sleep; it may raise to give up waiting (cancel).
            on_position: called with how many are ahead, and why its owner's limits hold it back, as either changes.

        Raises:
            InvalidRequestError: an impossible request.
            QueueTimeoutError: queue_timeout passed first; nothing is left locked.
        """
        need.check()
        with self._locked():
            if place is None:
                ticket = self._next(TICKET)
            else:
                ticket, fifo_fd = place.ticket, place.fifo_fd
            grant, standing = self._try_grant(ticket, need, info)
            if grant is None and place is None:
                fifo_fd = self._enqueue(ticket, need, info)
        try:
            if grant is not None:  # nobody to wait for (a place's entry is gone with its grant)
                if place is not None:
                    self.wake_all()
                return grant
            return self._wait(ticket, need, info, standing, fifo_fd, queue_timeout=queue_timeout, waited=waited,
                              wake_fds=wake_fds, on_wake=on_wake, on_position=on_position)
        finally:
            if self._queue.exists(ticket):  # gave up
                self.leave(ticket)
            if grant is None or place is not None:
                os.close(fifo_fd)

    def enqueue(self, need: Need, info: dict[str, Any]) -> Place:
        """Take a place in line for `need` now, to be waited for later, by this process or by one it
        hands the place's descriptor to (a detached job's supervisor: acquire(place=...)). The place
        is kept for as long as a process holds that descriptor open.

        Raises:
            InvalidRequestError: an impossible request.
        """
        need.check()
        with self._locked():
            ticket = self._next(TICKET)
            return Place(ticket, self._enqueue(ticket, need, info))

    def leave(self, ticket: int) -> None:
        """Leave the queue (a request that gave up, a row that will not run), and let whoever was behind go."""
        with self._locked():
            self._queue.remove(ticket)
        self.wake_all()

    def _wait(self, ticket: int, need: Need, info: dict[str, Any], standing: policies.Decision, fifo_fd: int, *,
              queue_timeout: float | None, waited: float, wake_fds: Sequence[int],
              on_wake: Callable[[], None] | None, on_position: Callable[[int, str], None] | None) -> Grant:
        """Sleep until woken (or a re-check is due), try again, until granted (acquire's loop)."""
        deadline = None if queue_timeout is None else time.monotonic() + queue_timeout - waited
        told: tuple[int, str] | None = None
        while True:
            if on_position is not None and (standing.ahead, standing.reason) != told:
                told = standing.ahead, standing.reason
                on_position(*told)
            # Requests behind others are woken by the grants ahead of them, so they re-check
            # less often (a request ahead that died silently is noticed within 2 s).
            timeout = self._sleep_poll if standing.ahead == 0 else self._sleep_poll * 4
            if self._holders.killing:
                timeout = min(timeout, LINGER_POLL)
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueTimeoutError(
                        f"waited {queue_timeout:g} s for {need_text(need.ngpus, need.share_bytes)} and they did "
                        f"not come free ({standing.ahead} request(s) were still ahead)")
                timeout = min(timeout, remaining)
            readable, _, _ = select.select([fifo_fd, *wake_fds], [], [], timeout)
            if fifo_fd in readable:
                lockdir.drain(fifo_fd)
            if on_wake is not None:
                on_wake()
            with self._locked():
                grant, standing = self._try_grant(ticket, need, info)
            if grant is not None:
                self.wake_all()  # the next request may be able to go now
                return grant

    def _enqueue(self, ticket: int, need: Need, info: dict[str, Any]) -> int:
        """Under the queue lock: join the queue with a wake-up FIFO; returns its descriptor."""
        fifo_fd = self._queue.open_fifo(ticket)
        self._queue.write(ticket, {**info, **need.entry()})
        return fifo_fd

    def _try_grant(self, ticket: int, need: Need, info: dict[str, Any],
                   claim: Callable[[], bool] | None = None) -> tuple[Grant | None, policies.Decision]:
        """Under the queue lock: grant to `ticket` if the host's policy lets it go now (policies.decide: after
        every request ahead of it that competes for its GPUs, or by backfill) and `claim()`, if given, takes it (a
        handed-over row: hand_over). Returns the grant (None: wait) and the decision (how many competing requests are
        ahead, why its owner's limits hold it back)."""
        policy, info = self.scheduling.policy, self._queue.placed(ticket, info)  # a requeued row's place, if any
        waiters = self._queue.competing(ticket, in_line({**info, "ticket": ticket}), everyone=policy != FCFS)
        decision, taken, sizes = self._decide(ticket, need, info, waiters)
        if not decision.uuids:  # lower-priority jobs that hold what it needs may be preempted (--preempt)
            if claim is None:  # (a row preempts nobody: its supervisor does, once it waits at the head of its line)
                preemption.consider(self.root, self.scheduling, self._holders.records, info, need.entry(), decision)
            return None, decision
        if claim is not None and not claim():
            return None, decision
        # No request ahead was planned on these GPUs (it would compete, and we would be behind its grant), so
        # what is taken of them is still what was probed above.
        mine, now = need.entry(), time.time()
        uuids = list(decision.uuids)
        ranges, locked = self._holders.lock(uuids, mine["share_mib"], sizes, taken, ticket)
        if not locked:  # cannot happen under the queue lock, but never double-book
            return None, decision
        gpus = mine["share_mib"] / sizes[uuids[0]] if mine["share_mib"] else len(uuids)
        grant = Grant(tuple(uuids), ticket, self._next(GRANT), need.share_bytes, ranges, gpus)
        self._holders.write(grant, {**info, "seconds": need.seconds, "gpus": gpus / len(uuids),
                                    "backfilled": decision.backfilled}, now)
        self._queue.remove(ticket)
        return grant, decision

    def _decide(self, ticket: int, need: Need, info: dict[str, Any], waiters: list[dict[str, Any]],
                eager: bool = False) -> tuple[policies.Decision, dict[str, list[Range]], dict[str, int]]:
        """Under the queue lock: whether the policy lets `ticket` go now among the live `waiters` (without it),
        with what is taken of the GPUs involved and their sizes (MiB); `eager`: as policies.decide's."""
        policy, mine = self.scheduling.policy, need.entry()
        me = policyfiles.want(ticket, mine, info)
        involved, sizes = set(me.candidates), {}
        for waiter in waiters:
            involved.update(waiter["candidates"])
            sizes.update(waiter.get("sizes_mib", {}))
        sizes.update(mine["sizes_mib"])
        fractional = bool(mine["share_mib"]) or any(waiter.get("share_mib") for waiter in waiters)
        records = self._holders.records()
        self._holders.killing = False
        taken = {uuid: self._holders.taken(uuid, sizes.get(uuid, 0) if fractional else 0, records.get(uuid, []))
                 for uuid in involved}
        now = time.time()
        usage = policyfiles.usage(self.root, records, self.scheduling.fair_share, now) if policy == FAIR else None
        waiting = policies.order([*(policyfiles.want(w["ticket"], w, w) for w in waiters), me], policy, usage)
        placement = self.scheduling.placement
        rules = Rules(policy, placement, read_load(self.root, now) if placement == planning.LEAST_BUSY else {})
        board = policyfiles.board(self._holders.records(), sizes, now) if policy == BACKFILL else None  # after taken()
        decision = policies.decide(planning.rooms(taken, sizes, fractional), waiting, me, rules, board=board, now=now,
                                   limits=limits.tally(self.root, records, now), eager=eager)  # None without limits
        return decision, taken, sizes

    def claim_scheduling(self) -> None:
        """Mark the lock directory as granted from with this manager's scheduling, for as long as this process
        lives (a server parent, a detached job's supervisor); refuse if a live process grants with another.

        Raises:
            RpycdlError: servers or supervisors of the directory use another policy, placement or fair share.
        """
        policyfiles.claim(self.root, self.scheduling)

    def release(self, grant: Grant) -> None:
        """Free the grant's GPUs (or share) and wake every waiter. Releasing twice is harmless."""
        self._holders.unlock(grant)
        self.wake_all()

    def listen(self, name: str) -> int:
        """A wake-up FIFO, listeners/<name>.fifo, for a process that is no request (a server's dispatcher): woken
        with every waiter. Returns its descriptor; unlisten() removes it, and this removes those whose process
        is gone."""
        return self._queue.listen(name)

    def unlisten(self, name: str) -> None:
        """Remove the wake-up FIFO listen() made."""
        self._queue.unlisten(name)

    def wake_all(self) -> None:
        """Wake every waiting request so it re-checks the queue, and every listener."""
        self._queue.wake_all()

    def wake_listeners(self) -> None:
        """Wake the listeners alone (the dispatchers: a row joined the queue)."""
        self._queue.wake_all(requests=False)

    # -- after a crash ---------------------------------------------------------------

    def orphans(self) -> list[tuple[Path, dict[str, Any]]]:
        """The records of grants whose locks nobody holds any more (their holder died)."""
        return self._holders.orphans()

    def clear_orphans(self, claim: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """Remove the orphaned records that `claim` accepts once nothing of their job runs (the
        sweep of the server that granted them, or of any server if that one is gone): kill every
        process of the job (rpycdl.scheduler.procs), wait until none runs (KILL_WAIT at most: a
        record whose job still runs stays), then remove the record and wake every waiter.

        Returns:
            The records removed.
        """
        cleared = []
        for path, record in self.orphans():
            if claim(record) and procs.kill_until_gone(functools.partial(job_left, record), KILL_WAIT):
                with self._locked():
                    self._holders.forget(path)
                cleared.append(record)
        if cleared:
            self.wake_all()
        return cleared

    # -- status ----------------------------------------------------------------------

    def queue(self) -> list[dict[str, Any]]:
        """The live waiting requests, in ticket order."""
        with self._locked():
            return self._queue.waiters()

    def snapshot(self, plan: bool = False) -> dict[str, Any]:
        """Who holds which GPU and who waits, in the policy's order: {"held": {uuid: [record]}, "queue": [entry]};
        with `plan`, under backfill, the first waiters' planned starts too (policyfiles.in_order).

        Each GPU's holders are in grant order; `share_bytes` is a holder's share (0: the whole GPU).
        A holder that died while its job's processes still run (or before its server has cleaned
        up after it) is reported with `leftover` true: its GPUs are not free yet. Waiters that
        died are not reported. It takes no lock, so requests waiting in numbers never slow it:
        probes (F_GETLK) take nothing, records appear by rename after their locks are taken, and
        nothing is removed or killed here (granters and sweeps do that)."""
        records = self._holders.records()
        return {"held": self.held(records), "queue": policyfiles.in_order(
            self.root, self.scheduling, self._queue.waiters(prune=False), records, plan)}

    def held(self, records: Records | None = None) -> dict[str, list[dict[str, Any]]]:
        """Who holds which GPU, as snapshot()'s "held" (the held/ `records`, read now if not given); no lock."""
        return self._holders.held(self._holders.records() if records is None else records)
