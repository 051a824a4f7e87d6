"""The scheduling policies through the real decision code (rpycdl.scheduler.policies.decide), on a simulated
host: requests arrive, wait, are granted and end as the simulation's clock says, and every waiting request
asks `decide` whenever something changed, as the lock manager's waiters do when woken. Backfill never makes
a request start later than strict first come, first served would (when every job runs for its declared
time); fair share serves a light user before a heavy one's queue and starves nobody."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpycdl.scheduler import fairshare, planning, policies
from rpycdl.scheduler.fairshare import FairShare, Snapshot
from rpycdl.scheduler.policies import BACKFILL, FAIR, FCFS, Board, Hold, Rules, Want

GPU_MIB = 16
"""Each simulated GPU's size, in MiB of the lock files (shares are 1 to 16 of them)."""


@dataclass(frozen=True)
class Job:
    arrival: int
    want: Want
    runs: int  # how long it really runs: its declared timeout when it has one


def _uuids(count: int) -> tuple[str, ...]:
    return tuple(f"GPU-{index}" for index in range(count))


def simulate(jobs: list[Job], gpus: int, rules: Rules, usage_of=None) -> dict[int, int]:
    """When each job (by ticket) starts on a host of `gpus` GPUs under `rules`. `usage_of(now, ended,
    running)`, for fair share, gives the accounts' usage from what ran so far."""
    sizes = {uuid: GPU_MIB for uuid in _uuids(gpus)}
    arrivals = sorted(jobs, key=lambda job: (job.arrival, job.want.ticket))
    running: list[tuple[Job, int, tuple[str, ...]]] = []  # (job, start, its GPUs)
    ended: list[tuple[Job, int, int]] = []
    waiting: list[Job] = []
    starts: dict[int, int] = {}
    now = 0
    while arrivals or waiting or running:
        moments = [job.arrival for job in arrivals[:1]] + [start + job.runs for job, start, _ in running]
        now = min(moments) if moments else now
        for entry in [entry for entry in running if entry[1] + entry[0].runs <= now]:
            running.remove(entry)
            ended.append((entry[0], entry[1], now))
        while arrivals and arrivals[0].arrival <= now:
            waiting.append(arrivals.pop(0))
        usage = usage_of(now, ended, running) if usage_of else None
        granted = True
        while granted:  # every waiter asks again after each grant, as a wake-up makes them
            granted = False
            ordered = policies.order([job.want for job in waiting], rules.policy, usage)
            for want in ordered:
                holds = _holds(running)
                board = Board(sizes, tuple(Hold(uuid, mib, since + declared) for uuid, mib, since, declared in holds))
                rooms = policies.rooms_at(sizes, [Hold(uuid, mib, math.inf) for uuid, mib, _, _ in holds], now)
                decision = policies.decide(rooms, ordered, want, rules, board=board, now=now)
                if decision.uuids:
                    job = next(job for job in waiting if job.want is want)
                    waiting.remove(job)
                    running.append((job, now, decision.uuids))
                    starts[want.ticket] = now
                    granted = True
                    break
        if not moments and waiting:
            raise AssertionError(f"requests wait with nothing running nor coming: {[j.want for j in waiting]}")
    return starts


def _holds(running: list[tuple[Job, int, tuple[str, ...]]]) -> list[tuple[str, int, int, float]]:
    """(uuid, MiB, since, declared) of each running job's GPUs."""
    found = []
    for job, start, uuids in running:
        declared = math.inf if job.want.seconds is None else job.want.seconds
        found += [(uuid, job.want.share_mib, start, declared) for uuid in uuids]
    return found


@st.composite
def workloads(draw, *, shares: bool = True, later: bool = True, servers: bool = True, fair: bool = False):
    """A host of 1 to 5 GPUs and up to 14 requests: whole GPUs or (with `shares`) shares, arriving over time
    (with `later`) or all at once, on one server or (with `servers`) also on a second one that sees some of
    the GPUs; each with a declared timeout (always, under `fair`) or none, running for exactly that time."""
    gpus = draw(st.integers(1, 5))
    seen = [_uuids(gpus)]
    if servers and gpus > 2 and draw(st.booleans()):
        seen.append(_uuids(gpus)[draw(st.integers(1, gpus - 1)):])
    jobs, at = [], 0
    for ticket in range(draw(st.integers(1, 14))):
        at += draw(st.integers(0, 3)) if later else 0
        candidates = draw(st.sampled_from(seen))
        share = draw(st.sampled_from([0, 0, 0, 4, 8, 12, 16])) if shares else 0
        ngpus = 1 if share else draw(st.integers(1, len(candidates)))
        declared = draw(st.integers(1, 9)) if fair else draw(st.one_of(st.none(), st.integers(1, 9)))
        runs = declared if declared is not None else draw(st.integers(1, 9))
        account = draw(st.sampled_from("abc")) if fair else ""
        jobs.append(Job(at, Want(ticket, ngpus, share, candidates, declared, account), runs))
    return gpus, jobs


SETTINGS = settings(max_examples=3 * settings.default.max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _later_under_backfill(gpus: int, jobs: list[Job]) -> dict[int, tuple[int, int]]:
    strict = simulate(jobs, gpus, Rules(FCFS))
    backfilled = simulate(jobs, gpus, Rules(BACKFILL))
    return {ticket: (strict[ticket], backfilled[ticket]) for ticket in strict if backfilled[ticket] > strict[ticket]}


@SETTINGS
@given(workloads(later=False))
def test_backfill_never_starts_a_waiting_request_later_than_strict_order(workload):
    """Shares, servers that see different GPUs, jobs of unknown length: no request that waits when a job
    backfills starts later than strict order would start it."""
    late = _later_under_backfill(*workload)
    assert not late, f"later under backfill (ticket: strict start, backfill start): {late}"


@SETTINGS
@given(workloads(shares=False, servers=False))
def test_backfill_never_starts_a_whole_gpu_request_later_than_strict_order(workload):
    """Whole GPUs of one server (any of them as good as another), requests arriving all the time: no
    request, waiting or still to come, starts later than strict order would start it."""
    late = _later_under_backfill(*workload)
    assert not late, f"later under backfill (ticket: strict start, backfill start): {late}"


def test_a_share_that_backfilled_may_leave_a_later_request_a_different_place():
    """The limit of the promise (docs/scheduling.md): a share that ran early is not where strict
    order would have put it later, and a request that arrives afterwards may find the GPUs packed otherwise.
    Here ticket 8, arriving at 1, starts at 3 instead of 2."""
    three = _uuids(3)
    jobs = [Job(0, Want(0, 1, 4, three, 1), 1), Job(0, Want(1, 3, 0, three, 1), 1), Job(0, Want(2, 1, 4, three, 1), 1),
            Job(0, Want(3, 1, 0, three, 2), 2)]
    jobs += [Job(1, Want(ticket, 1, share, three[1:] if ticket == 7 else three, None), 1)
             for ticket, share in ((4, 4), (5, 4), (6, 0), (7, 0), (8, 4))]
    assert _later_under_backfill(3, jobs) == {8: (2, 3)}


def test_backfill_fills_a_gap_that_strict_order_leaves_idle():
    """Four GPUs, one busy for 10 s; a 4-GPU request waits for it. A 1-GPU job of 5 s behind it runs at once
    on a free GPU under backfill (it ends before the head could start), not under strict order; one of 20 s
    would delay the head, so it waits under both."""
    everything = _uuids(4)
    jobs = [Job(0, Want(0, 1, 0, everything, 10), 10), Job(1, Want(1, 4, 0, everything, 10), 10),
            Job(2, Want(2, 1, 0, everything, 5), 5), Job(3, Want(3, 1, 0, everything, 20), 20),
            Job(4, Want(4, 1, 0, everything, None), 3)]
    assert simulate(jobs, 4, Rules(FCFS)) == {0: 0, 1: 10, 2: 20, 3: 20, 4: 20}
    assert simulate(jobs, 4, Rules(BACKFILL)) == {0: 0, 1: 10, 2: 2, 3: 20, 4: 20}


def test_nothing_backfills_in_front_of_an_unknown_start():
    """The head waits for a job that declared no timeout: when it will start is unknown, so a short job
    behind it may not take a free GPU it might need."""
    everything = _uuids(2)
    jobs = [Job(0, Want(0, 1, 0, everything, None), 10), Job(1, Want(1, 2, 0, everything, 5), 5),
            Job(2, Want(2, 1, 0, everything, 1), 1)]
    assert simulate(jobs, 2, Rules(BACKFILL)) == {0: 0, 1: 10, 2: 15}


def test_placements_of_a_share():
    rooms = {"a": planning.Room(False, 10), "b": planning.Room(False, 4), "c": planning.Room(True, 16)}
    candidates = ("a", "b", "c")
    assert planning.pick(dict(rooms), 1, 4, candidates, planning.PACK) == ["b"]  # the fullest with room
    assert planning.pick(dict(rooms), 1, 4, candidates, planning.SPREAD) == ["c"]  # the emptiest
    busy = {"a": 0.1, "b": 0.9, "c": 0.5}
    assert planning.pick(dict(rooms), 1, 4, candidates, planning.LEAST_BUSY, busy) == ["a"]
    assert planning.pick(dict(rooms), 1, 4, candidates, planning.LEAST_BUSY, {"a": 0.1}) == ["b"]  # unknown: pack
    assert planning.pick(dict(rooms), 1, 12, candidates, planning.LEAST_BUSY, busy) == ["c"]  # only c has room


def _gpus(want: Want) -> float:
    return want.share_mib / GPU_MIB if want.share_mib else want.ngpus


def fair_usage(settings: FairShare, prior: dict[str, float] | None = None):
    """simulate()'s usage_of for fair share, through rpycdl.scheduler.fairshare: the accounts' `prior` usage
    at time 0, what ended jobs used (a snapshot made now), and what running ones use."""
    def usage_of(now, ended, running):
        snapshot = fairshare.step(Snapshot(0.0, prior or {}), [(job.want.account, start, end, _gpus(job.want))
                                                               for job, start, end in ended], now, settings.half_life)
        return fairshare.usage(snapshot, [(job.want.account, start, _gpus(job.want)) for job, start, _ in running],
                               settings, now)
    return usage_of


@SETTINGS
@given(workloads(fair=True), st.sampled_from([5.0, 60.0, 3600.0]))
def test_fair_share_serves_every_request_and_each_accounts_in_its_order(workload, half_life):
    gpus, jobs = workload
    starts = simulate(jobs, gpus, Rules(FAIR), fair_usage(FairShare(half_life)))  # raises if any is stuck
    assert set(starts) == {job.want.ticket for job in jobs}
    for first in jobs:
        for later in jobs:
            if (first.want.account == later.want.account and first.want.ticket < later.want.ticket
                    and set(later.want.candidates) <= set(first.want.candidates)):  # else it may use other GPUs
                assert starts[first.want.ticket] <= starts[later.want.ticket], (first.want, later.want)


def test_a_light_users_request_goes_before_a_heavy_users_queue():
    """One user queues 100 jobs; another's single request, arriving later, runs as soon as a GPU is free."""
    everything = _uuids(2)
    jobs = [Job(0, Want(ticket, 1, 0, everything, 10, "alice"), 10) for ticket in range(100)]
    jobs.append(Job(5, Want(100, 1, 0, everything, 10, "bob"), 10))
    starts = simulate(jobs, 2, Rules(FAIR), fair_usage(FairShare(3600.0)))
    assert starts[100] == 10  # the first end; under FCFS: behind all of alice's
    assert simulate(jobs, 2, Rules(FCFS))[100] == 500


@settings(max_examples=settings.default.max_examples // 4, deadline=None)
@given(st.integers(0, 40), st.sampled_from([600.0, 3600.0, 86400.0]), st.floats(0.5, 4.0))
def test_a_heavy_user_waits_only_until_the_others_have_used_as_much(prior, half_life, weight):
    """carol used `prior` GPU-seconds before (decaying since); alice and bob keep 50 requests each queued on
    2 GPUs (1 s each). carol's one request, of weight `weight`, starts at the first second when her weighted
    usage is below theirs (or their queues are empty), not before and not after."""
    everything = _uuids(2)
    jobs = [Job(0, Want(ticket, 1, 0, everything, 1, "alice" if ticket % 2 else "bob"), 1) for ticket in range(100)]
    jobs.append(Job(1, Want(100, 1, 0, everything, 1, "carol"), 1))
    settings_ = FairShare(half_life, {"carol": weight})
    starts = simulate(jobs, 2, Rules(FAIR), fair_usage(settings_, {"carol": float(prior)}))

    def ahead_of_them(at: int) -> bool:  # carol's weighted usage below theirs (each has had a GPU since 0)
        return fairshare.decayed(prior, 0, at, half_life) / weight < fairshare.used(0, None, 1, at, half_life)

    expected = next((at for at in range(1, 50) if ahead_of_them(at)), 50)  # at 50 their queues are empty
    assert starts[100] == expected
