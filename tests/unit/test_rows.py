"""Queued rows in the lock directory (rpycdl.scheduler.locks) and the sweep's rules for them
(rpycdl.scheduler.sweep): a row is claimed by one dispatcher at a time, a claim whose holder is gone lapses, a
cancel takes only an unclaimed row, and a row whose supervisor died before its grant is no orphan."""

from __future__ import annotations

import os
import subprocess
import sys

from rpycdl.defaults import DISPATCH_AHEAD, DISPATCH_AHEAD_MAX
from rpycdl.scheduler import sweep
from rpycdl.scheduler.jobfiles import JobFiles
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.scheduler.queuedir import Need
from rpycdl.states import JobState

GPUS = ("GPU-a", "GPU-b")


def _row(locks: GPULockManager, job_id: str, ngpus: int = 1, deadline: float | None = None,
         state_dir: str = "/mine") -> int:
    return locks.enqueue_row(Need(ngpus, GPUS), {"job_id": job_id, "user": "alice", "server_id": "s",
                                                 "state_dir": state_dir, "deadline": deadline})


def test_a_row_is_claimed_once_and_again_once_its_claim_lapses(tmp_path):
    locks = GPULockManager(tmp_path)
    ticket = _row(locks, "job1")
    [(entry, place)] = locks.dispatch()
    assert entry["job_id"] == "job1" and place.ticket == ticket
    assert locks.dispatch() == []  # claimed: no second dispatcher gets it
    assert not locks.drop_row("job1")  # a cancel leaves it to the supervisor holding it
    os.close(place.fifo_fd)  # the supervisor died before its grant
    [(again, place)] = locks.dispatch()
    assert again["job_id"] == "job1"
    os.close(place.fifo_fd)
    assert locks.drop_row("job1") and locks.queued_rows() == set() and locks.dispatch() == []


def test_a_claim_held_by_another_process_lasts_while_it_lives(tmp_path):
    """The claim is the FIFO's reader: a process that inherited the descriptor keeps it."""
    locks = GPULockManager(tmp_path)
    _row(locks, "job1")
    [(_, place)] = locks.dispatch()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              pass_fds=[place.fifo_fd])
    os.close(place.fifo_fd)
    try:
        assert locks.dispatch() == [] and not locks.drop_row("job1")
    finally:
        holder.kill()
        holder.wait()
    assert [entry["job_id"] for entry, place in locks.dispatch()] == ["job1"]


def test_rows_go_in_turn_first_come_first_served(tmp_path):
    """Two GPUs: the first one-GPU row is claimed (the head of the line is, to wait as a process; the next waits
    for its grant, as any later request does); then the second; the two-GPU row behind them is claimed once it
    heads the line, to wait, and the later one-GPU row does not overtake it; a row whose deadline passed is
    claimed to be ended whatever its turn."""
    locks = GPULockManager(tmp_path)
    for job_id, ngpus in (("one", 1), ("two", 1), ("both", 2), ("later", 1)):
        _row(locks, job_id, ngpus)
    _row(locks, "expired", 2, deadline=1.0)
    claimed = locks.dispatch(ahead=1)
    assert [entry["job_id"] for entry, _ in claimed] == ["one", "expired"]
    grants = [locks.acquire(Need(1, GPUS), {"job_id": "one"}, place=claimed[0][1])]
    os.close(claimed[1][1].fifo_fd)
    (entry, place), (expired, again) = locks.dispatch(ahead=1)
    assert (entry["job_id"], expired["job_id"]) == ("two", "expired")
    os.close(again.fifo_fd)
    grants.append(locks.acquire(Need(1, GPUS), {"job_id": "two"}, place=place))
    assert sorted(uuid for grant in grants for uuid in grant.uuids) == list(GPUS)
    assert [each[0]["job_id"] for each in locks.dispatch(ahead=1)] == ["both", "expired"]


def test_as_many_rows_as_could_run_at_once_are_claimed_ahead_of_their_turn(tmp_path):
    """On four GPUs, the first four one-GPU rows are claimed (a release of every GPU at once finds a supervisor
    waiting for each), the fifth is not; of two-GPU rows, the first DISPATCH_AHEAD (2) only; on twenty GPUs, no more
    than DISPATCH_AHEAD_MAX."""
    four, twenty = tuple(f"GPU-{i}" for i in range(4)), tuple(f"GPU-{i}" for i in range(20))
    for candidates, ngpus, rows, claimed in ((four, 1, 5, 4), (four, 2, 4, DISPATCH_AHEAD),
                                             (twenty, 1, 12, DISPATCH_AHEAD_MAX)):
        locks = GPULockManager(tmp_path / f"{len(candidates)}-{ngpus}")
        holder = locks.acquire(Need(len(candidates), candidates), {"job_id": "holder"})  # none can go now
        for index in range(rows):
            locks.enqueue_row(Need(ngpus, candidates), {"job_id": f"r{index}", "user": "alice", "server_id": "s",
                                                        "state_dir": "/mine", "deadline": None})
        found = locks.dispatch()
        locks.release(holder)
        assert [entry["job_id"] for entry, _ in found] == [f"r{index}" for index in range(claimed)]
        for _, place in found:
            os.close(place.fifo_fd)


def test_a_dispatcher_starts_only_its_own_rows_and_they_wait_behind_the_others(tmp_path):
    """A server starts supervisors only for the jobs of its own state directory (it runs them as its account);
    another's row ahead still comes first."""
    locks = GPULockManager(tmp_path)
    _row(locks, "theirs", 2, state_dir="/theirs")
    _row(locks, "mine", 1)
    assert locks.dispatch(lambda entry: entry["state_dir"] == "/mine", ahead=1) == []
    [(entry, place)] = locks.dispatch(lambda entry: entry["state_dir"] == "/theirs", ahead=1)
    assert entry["job_id"] == "theirs"
    [(second, ahead)] = locks.dispatch(lambda entry: entry["state_dir"] == "/mine", ahead=2)  # second in line
    assert second["job_id"] == "mine"
    for fd in (place.fifo_fd, ahead.fifo_fd):
        os.close(fd)


def test_the_sweep_leaves_a_queued_row_alone_and_ends_a_lost_one(tmp_path):
    """A PENDING detached row whose supervisor died is dispatched again while its entry is queued, ended LOST
    once it is not; a row no process owns is ended LOST only when it is not queued and still unowned."""
    ledger, files = Ledger(tmp_path), JobFiles(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for job_id, owner in (("queued", dead.pid), ("granted", dead.pid), ("waiting", 0), ("dropped", 0)):
        ledger.save(JobRecord(job_id=job_id, server_id="s", client="c", ngpus=1, share_bytes=0,
                              state=JobState.PENDING, owner_pid=owner, owner_start=1 if owner else 0, detached=True))
    queued = {"queued", "waiting"}
    assert [record.job_id for record in sweep.end_orphaned(ledger, files, lambda: queued)] == ["granted"]
    assert sweep.end_unqueued(ledger, files, lambda: queued) == ["dropped"]
    states = {job_id: ledger.get(job_id).state for job_id in ("queued", "granted", "waiting", "dropped")}
    assert states == {"queued": JobState.PENDING, "granted": JobState.LOST, "waiting": JobState.PENDING,
                      "dropped": JobState.LOST}
    assert ledger.set_owner("waiting", (dead.pid, 1), (0, 0))  # its dispatcher started it: no longer unowned
    assert not ledger.set_owner("waiting", (dead.pid, 2), (0, 0))  # nor can another take it from that owner
    assert sweep.end_unqueued(ledger, files, lambda: set()) == []


def test_rows_given_at_once_take_tickets_in_order_and_a_row_left_empty_is_no_row(tmp_path):
    """enqueue_rows takes its tickets in one go, in the order chosen; a row made but never written (its submitter
    killed between the two: lockdir.new_file) is no row to anyone, and the next pruning under the lock removes it."""
    locks = GPULockManager(tmp_path)
    first = _row(locks, "before")
    given = [(Need(1, GPUS), {"job_id": f"e{i}", "user": "alice", "server_id": "s", "state_dir": "/mine",
                              "deadline": None}) for i in range(3)]
    assert locks.enqueue_rows(lambda queued: given if queued == {"before"} else []) == 3
    entries = locks.queue()
    assert [(entry["ticket"], entry["job_id"]) for entry in entries] == [
        (first + i, job_id) for i, job_id in enumerate(("before", "e0", "e1", "e2"))]
    assert _row(locks, "after") == first + 4
    empty = tmp_path / "rows" / f"{first + 9:016d}.json"
    empty.touch()
    assert locks.queued_rows() == {"before", "e0", "e1", "e2", "after"}
    assert [entry["job_id"] for entry in locks.queue()][-1] == "after" and not empty.exists()


def test_a_grant_is_handed_to_the_arrays_first_row_in_line_and_only_when_it_heads_the_line(tmp_path):
    """hand_over (rpycdl.server.handover): the GPU goes to the array's first unclaimed row in line (a requeued
    element's place counts), once the claim takes it; a refused claim, another array's rows, or a request ahead
    leave the GPU free and the row in line."""
    locks = GPULockManager(tmp_path)
    one = Need(1, GPUS[:1])
    mine = {"owner": [1, 1], "leader": None, "server_process": [1, 1]}

    def held() -> list[str]:
        return [record["job_id"] for records in locks.snapshot()["held"].values() for record in records]

    def row(job_id: str, array_id: str, **extra: object) -> None:
        locks.enqueue_row(one, {"job_id": job_id, "user": "alice", "array_id": array_id, **extra})

    plain = locks.enqueue_row(one, {"job_id": "plain", "user": "bob"})  # a job submitted before the elements
    row("late", "A")
    row("requeued", "A", place=plain)  # before "late" in line (after "plain"), though its ticket is after
    row("other", "B")
    grant = locks.acquire(one, {"job_id": "first", "user": "alice", "priority": 10})  # before the rows
    assert locks.hand_over(grant, "A", mine, lambda job_id: True) is None  # "plain" heads the line
    assert held() == [] and locks.queued_rows() == {"plain", "other", "late", "requeued"}
    locks.drop_row("plain")
    asked = []
    grant = locks.acquire(one, {"job_id": "second", "user": "alice", "priority": 10})
    assert locks.hand_over(grant, "A", mine, lambda job_id: asked.append(job_id) or False) is None
    assert asked == ["requeued"] and held() == [] and "requeued" in locks.queued_rows()  # its claim refused it
    grant = locks.acquire(one, {"job_id": "third", "user": "alice", "priority": 10})
    handed, entry = locks.hand_over(grant, "A", mine, lambda job_id: True)
    assert entry["job_id"] == "requeued" and handed.uuids == GPUS[:1] and held() == ["requeued"]
    assert locks.queued_rows() == {"late", "other"}
    assert locks.hand_over(handed, "B", mine, lambda job_id: True) is None and held() == []  # "late" heads the line
    assert locks.queued_rows() == {"late", "other"}


def test_an_arrays_rows_are_claimed_as_many_as_the_free_gpus_run_and_none_ahead_of_their_turn(tmp_path):
    """An array's supervisors take its next elements in turn (hand_over): a dispatcher claims its rows only for the
    GPUs free now, all of those in one pass, none to wait ahead (a plain row of the same need would have
    Need.at_once of them)."""
    locks = GPULockManager(tmp_path)
    for index in range(5):
        _row(locks, f"e{index}")
    held = locks.acquire(Need(1, GPUS[:1]), {"job_id": "holder", "user": "bob", "priority": 10})
    for index in range(5, 10):
        locks.enqueue_row(Need(1, GPUS), {"job_id": f"a{index}", "user": "alice", "array_id": "A",
                                          "state_dir": "/mine"})
    claimed = locks.dispatch(lambda entry: bool(entry.get("array_id")))
    assert [entry["job_id"] for entry, _ in claimed] == [], claimed  # the plain rows ahead take the free GPU first
    for job_id in [f"e{index}" for index in range(5)]:
        locks.drop_row(job_id)
    claimed = locks.dispatch()
    assert [entry["job_id"] for entry, _ in claimed] == ["a5"]  # one GPU free: one row claimed
    locks.release(held)
    claimed += locks.dispatch()
    assert [entry["job_id"] for entry, _ in claimed] == ["a5", "a6"]  # the other: one more, and none ahead
    for _, place in claimed:
        os.close(place.fifo_fd)
