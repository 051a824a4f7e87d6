"""Scheduling policies on paper: whether a waiting request may be granted now, under first come, first served
(fcfs), backfill that never delays a request ahead of it (fcfs-backfill) or fair share (fair), and the plan
of when each waiting request would start if every job ran for its declared timeout. Nothing is locked or
read here: rpycdl.scheduler.locks gathers the queue and the grants, asks `decide`, and locks what it names.

Every policy grants in one order (`order`: by priority first, higher first; then tickets, or for fair share the
accounts' usage, then tickets: a request of a higher priority goes before those of lower ones that came first, the
documented exception to first come, first served, as `priority=` asks, within its owner's ceiling). A
request is granted when it can be at once after every request ahead of it that competes for the same GPUs
was served or has reserved the GPUs it waits for (a waiting request reserves all of its candidates), so no
request overtakes one ahead. Under fcfs-backfill a request that declared a timeout may also go first onto
GPUs that are free now, if the plan of the requests ahead of it says that none of them would start any
later with it running there for its whole timeout (conservative backfill: every request ahead keeps its
planned start, not only the first). A job of unknown length (no declared timeout, or past it) may end
at any moment and let whoever waits behind it start sooner than any plan says: nothing backfills onto
GPUs that such a job holds, nor in front of requests that wait behind one that waits for them.

Under every policy, a request over its owner's limits (rpycdl.scheduler.limits: GPUs held, GPU-hours) neither
goes nor holds the line: it is passed over, reserving nothing, until its owner is under them again (the documented
exception to first come, first served).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rpycdl.defaults import MAX_PREEMPT_GRACE, PREEMPT_GRACE
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import planning
from rpycdl.scheduler.fairshare import FairShare
from rpycdl.scheduler.limits import Tally
from rpycdl.scheduler.planning import Room

FCFS, BACKFILL, FAIR = "fcfs", "fcfs-backfill", "fair"
POLICIES = (FCFS, BACKFILL, FAIR)
OFF, REQUEUE, CANCEL = "off", "requeue", "cancel"
PREEMPTS = (OFF, REQUEUE, CANCEL)
"""--preempt: never; a preempted detached job requeued (an attached one, a session: PreemptedError); every one ended."""

PLAN_MAX = 32
"""Requests ahead a backfill plans at most: behind more of them (that share GPUs with it), nothing backfills."""


@dataclass(frozen=True)
class Scheduling:
    """A host's scheduling: its policy (POLICIES), where shares go (planning.PLACEMENTS), under fair share its
    settings, and its preemption (PREEMPTS: off, requeue or cancel, with the grace a preempted job has between its
    SIGTERM and its SIGKILL: rpycdl.scheduler.preemption). Every server and supervisor sharing a lock directory has
    the same (GPULockManager's claim refuses another)."""

    policy: str = FCFS
    placement: str = planning.PACK
    fair_share: FairShare = field(default_factory=FairShare)
    preempt: str = OFF
    preempt_grace: float = PREEMPT_GRACE

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"unknown policy {self.policy!r}: {', '.join(POLICIES)}")
        if self.placement not in planning.PLACEMENTS:
            raise InvalidRequestError(f"unknown placement {self.placement!r}: {', '.join(planning.PLACEMENTS)}")
        if self.preempt not in PREEMPTS or not 0 <= self.preempt_grace <= MAX_PREEMPT_GRACE:
            raise InvalidRequestError(f"--preempt {self.preempt} --preempt-grace {self.preempt_grace:g}: "
                                      f"{', '.join(PREEMPTS)}, and a grace of 0 to {MAX_PREEMPT_GRACE:g} s")

    def words(self) -> str:
        """As an operator gives it: '--policy fair --placement pack (half-life=86400s;weights=none)'."""
        fair = f" ({self.fair_share.fingerprint()})" if self.policy == FAIR else ""
        preempt = f" --preempt {self.preempt} --preempt-grace {self.preempt_grace:g}s" if self.preempt != OFF else ""
        return f"--policy {self.policy} --placement {self.placement}{fair}{preempt}"

    def key(self) -> str:
        """A file name that is the same for the same scheduling, and only for it."""
        fair = hashlib.sha256(self.fair_share.fingerprint().encode()).hexdigest()[:12] if self.policy == FAIR else ""
        preempt = f"preempt-{self.preempt}-{self.preempt_grace:g}" if self.preempt != OFF else ""
        return "+".join(part for part in (self.policy, self.placement, fair, preempt) if part)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "placement": self.placement, "half_life": self.fair_share.half_life,
                "weights": dict(self.fair_share.weights), "preempt": self.preempt, "preempt_grace": self.preempt_grace}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Scheduling:
        return cls(data["policy"], data["placement"], FairShare(data["half_life"], data["weights"]),
                   data.get("preempt", OFF), data.get("preempt_grace", PREEMPT_GRACE))


@dataclass(frozen=True)
class Want:
    """A request as the policies see it.

    Attributes:
        ticket: its place in arrival order.
        ngpus: whole GPUs; 1 for a share.
        share_mib: MiB of one GPU for a share; 0 for whole GPUs.
        candidates: the UUIDs of the GPUs it may use, in its server's order.
        seconds: its declared timeout, the longest it holds its GPUs once granted; None if it declared none.
        account: the user it counts against under fair share and limits.
        gpus: the GPUs it counts for against its owner's limits (a share's fraction); None: ngpus.
        priority: its priority (rpycdl.scheduler.priorities): a higher one goes first under every policy.
        place: the ticket whose place in line it has, if not its own: a preempted job's, requeued (None: `ticket`).
    """

    ticket: int
    ngpus: int
    share_mib: int
    candidates: tuple[str, ...]
    seconds: float | None = None
    account: str = ""
    gpus: float | None = None
    priority: int = 0
    place: int | None = None

    @property
    def counts(self) -> float:
        """The GPUs it counts for against its owner's limits."""
        return float(self.ngpus) if self.gpus is None else self.gpus


@dataclass(frozen=True)
class Hold:
    """What a grant holds of one GPU (`mib` of it, 0 for the whole GPU) until `end` at the latest (math.inf:
    unknown, the job declared no timeout or ran past it)."""

    uuid: str
    mib: int
    end: float


@dataclass(frozen=True)
class Board:
    """The GPUs a plan may use: each one's size in MiB, and what holds it now."""

    sizes: Mapping[str, int]
    holds: tuple[Hold, ...] = ()


@dataclass(frozen=True)
class Rules:
    """A host's policy and placement (planning.PLACEMENTS), and each GPU's measured load for least-busy."""

    policy: str = FCFS
    placement: str = planning.PACK
    load: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What a request does now: lock `uuids` (backfilled, if it goes before requests ahead), or wait (no
    uuids); `ahead` is how many requests ahead of it compete for its GPUs; `reason`, why it waits when its owner's
    limits hold it back."""

    uuids: tuple[str, ...] = ()
    ahead: int = 0
    backfilled: bool = False
    reason: str = ""


def order(wants: Sequence[Want], policy: str, usage: Mapping[str, float] | None = None) -> list[Want]:
    """The requests in the order the policy grants them: by priority, higher first, then by ticket (the `place` of a
    requeued preempted job: the ticket it had); under fair share
    by priority, then by their account's `usage` (weighted, decayed GPU-seconds: rpycdl.scheduler.fairshare; 0 for an
    account not in it), then by ticket, so one account's requests of one priority keep their arrival order."""
    if policy == FAIR:
        usage = usage or {}
        return sorted(wants, key=lambda want: (-want.priority, usage.get(want.account, 0.0), want.place or want.ticket))
    return sorted(wants, key=lambda want: (-want.priority, want.place or want.ticket))


def decide(rooms: Mapping[str, Room], waiting: Sequence[Want], me: Want, rules: Rules, *,
           board: Board | None = None, now: float = 0.0, limits: Tally | None = None, eager: bool = False) -> Decision:
    """Whether `me` may lock GPUs now, and which.

    Args:
        rooms: each GPU's room now (planning.rooms), for every candidate of the waiting requests.
        waiting: the waiting requests in the policy's order (`order`), `me` among them.
        me: the request deciding.
        rules: the policy, placement and load.
        board: what holds the GPUs until when, for a backfill's plan (None: no backfill).
        now: the time of `board`'s ends (seconds since the epoch).
        limits: what each account holds and used against its limits (None: no limits); updated in place.
        eager: whether `me` may go on what is left once those ahead that could go now have taken theirs (a
            dispatcher's claim of an array's rows, as many as the GPUs free now can run: a claim is no grant, its
            supervisor still waits its turn); else it waits for their grants, so that grants come in order.
    """
    ahead = waiting[:waiting.index(me)]
    planned = dict(rooms)
    count, behind_a_grant = 0, False
    for want in ahead:
        if limits is not None and limits.over(want.account, want.counts):
            continue  # over its owner's limits: it waits, and holds nobody back
        competes = not set(want.candidates).isdisjoint(me.candidates)
        count += competes
        theirs = _pick(planned, want, rules)
        if theirs:
            planning.take(planned, theirs, want.share_mib)  # they will take these first
            behind_a_grant |= competes  # and be granted first: their grant wakes us
            if limits is not None:
                limits.take(want.account, want.counts)
        else:
            planning.take(planned, want.candidates, 0)  # reserved while they wait
    reason = "" if limits is None else limits.over(me.account, me.counts)
    if (behind_a_grant and not eager) or reason:
        return Decision(ahead=count, reason=reason)
    mine = _pick(planned, me, rules)
    if mine:
        return Decision(tuple(mine), count)
    if rules.policy != BACKFILL or me.seconds is None or board is None:
        return Decision(ahead=count)
    mine = _pick(dict(rooms), me, rules)  # what is free now, reservations aside
    if mine and delays_nobody(board, now, waiting, me, mine, rules):
        return Decision(tuple(mine), count, backfilled=True)
    return Decision(ahead=count)


def delays_nobody(board: Board, now: float, waiting: Sequence[Want], me: Want, uuids: Sequence[str],
                  rules: Rules) -> bool:
    """Whether `me` on `uuids` from `now` for its whole timeout leaves every other waiting request that shares
    GPUs with it (directly or through others) its start by the plan of strict order: each plan is `plan`,
    with `me` in its place in line, and with it running now. A request behind `me` counts too: a share
    placed sooner lands elsewhere, and may take room that one would have had. Never where a job of unknown
    length holds those GPUs, or waits for them ahead of another request: it may end at any moment, and
    someone start sooner than planned."""
    assert me.seconds is not None
    gpus, involved = set(uuids) | set(me.candidates), [want is me for want in waiting]
    grew = True
    while grew:  # the requests whose GPUs meet ours, or meet those of one that does
        grew = False
        for index, want in enumerate(waiting):
            if not involved[index] and not gpus.isdisjoint(want.candidates):
                involved[index] = grew = True
                gpus.update(want.candidates)
    queue = [want for want, chosen in zip(waiting, involved, strict=True) if chosen]
    unknown = [index for index, want in enumerate(queue) if want.seconds is None]
    if len(queue) > PLAN_MAX or (unknown and unknown[0] < len(queue) - 1) or any(
            hold.end == math.inf for hold in board.holds if hold.uuid in gpus):
        return False  # starts are known up to the first request of unknown length, and only while every grant's is
    before = plan(board, now, queue, rules)
    others = [want for want in queue if want is not me]
    mine = tuple(Hold(uuid, me.share_mib, now + me.seconds) for uuid in uuids)
    after = plan(Board(board.sizes, board.holds + mine), now, others, rules)
    return all(then <= planned for then, planned in zip(after, [start for want, start in zip(queue, before, strict=True)
                                                                if want is not me], strict=True))


def plan(board: Board, now: float, waiting: Sequence[Want], rules: Rules) -> list[float]:
    """When each of `waiting` (in the policy's order) would start under strict order, if each grant on
    `board` and each of theirs held its GPUs for exactly its declared time; math.inf where that is unknown
    (it waits behind a job that declared no timeout, or never fits)."""
    holds = list(board.holds)
    starts = [math.inf] * len(waiting)
    pending = list(range(len(waiting)))
    at = now
    while pending:
        rooms = rooms_at(board.sizes, holds, at)
        for index in list(pending):
            want = waiting[index]
            uuids = _pick(rooms, want, rules)
            if uuids:
                planning.take(rooms, uuids, want.share_mib)
                starts[index] = at
                pending.remove(index)
                end = math.inf if want.seconds is None else at + want.seconds
                holds += [Hold(uuid, want.share_mib, end) for uuid in uuids]
            else:
                planning.take(rooms, want.candidates, 0)
        later = [hold.end for hold in holds if at < hold.end < math.inf]
        if not later:
            break
        at = min(later)
    return starts


def rooms_at(sizes: Mapping[str, int], holds: Sequence[Hold], at: float) -> dict[str, Room]:
    """Each GPU's room at time `at`, given what `holds` it until when."""
    found = {uuid: Room(True, size) for uuid, size in sizes.items()}
    for hold in holds:
        room = found.get(hold.uuid)
        if room is not None and hold.end > at:
            found[hold.uuid] = Room(False, room.free - (hold.mib or sizes[hold.uuid]))
    return found


def _pick(rooms: dict[str, Room], want: Want, rules: Rules) -> list[str]:
    return planning.pick(rooms, want.ngpus, want.share_mib, want.candidates, rules.placement, rules.load)
