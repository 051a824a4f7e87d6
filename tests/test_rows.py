"""A pending detached job is a row (issue 35): it waits in line with no process of its own, its supervisor is
started by a server when its turn comes, whichever server of the lock directory is up; a cancel ends it at
once; a supervisor killed before its grant is started again, so nothing runs twice and nothing stays pending.
Real registry, servers, supervisors and clients on loopback; only the GPUs are simulated."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import comm, gate_job, open_gate, server_pid, wait_until

import rpycdl
from rpycdl import JobState
from rpycdl.defaults import DISPATCH_AHEAD
from rpycdl.scheduler import procs
from rpycdl.scheduler.ledger import Ledger


def _make_recorder() -> Any:
    """A job (made in a function, so that dill sends it by value) that appends its id to args["log"], one line
    a run, and returns it."""

    def recorder(args: dict[str, Any]) -> str:
        import os

        job_id = os.environ["RPYCDL_JOB_ID"]
        with open(args["log"], "a") as log:
            log.write(job_id + "\n")
        return job_id

    return recorder


_recorder = _make_recorder()


def _supervisors(parent: int) -> list[int]:
    """The detached jobs' supervisors a server started: children of its forkserver."""
    forkservers = [pid for pid in procs.children(parent) if comm(pid) == "rpycdl-forksrv"]
    return [pid for forkserver in forkservers for pid in procs.children(forkserver) if comm(pid) == "rpycdl-superv"]


def _queue_files(lock_dir: str) -> list[str]:
    """The files of the queue: the requests' entries and FIFOs, the rows."""
    return sorted(name for folder in ("queue", "rows") for name in os.listdir(Path(lock_dir) / folder))


def _finished(jobs: list[rpycdl.Job], timeout: float) -> list[rpycdl.JobStatus]:
    return wait_until(lambda: (found := [job.status() for job in jobs]) and all(s.state.finished for s in found)
                      and found, timeout, "every job to end")


def test_pending_jobs_are_rows_and_run_in_their_turn(cluster, connect, lock_dir, tmp_path):
    """Twenty jobs behind one running job: no process of theirs, an entry and a row each; released, they run
    one after another in the order they were submitted, each once."""
    port = cluster.add_server("pytorch", "fake:1")[1]
    conn = connect(port)
    gate, log = str(tmp_path / "gate"), str(tmp_path / "ran")
    holder = conn.root.submit(gate_job(gate), "held")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 20, "the first job to run")
    pending = [conn.root.submit(_recorder, {"log": log}, name=f"row-{index}") for index in range(20)]
    # The running job's supervisor, and those of the jobs at the head of the line (DISPATCH_AHEAD), waiting;
    # no other, however long they wait.
    parent = server_pid(cluster, port)
    wait_until(lambda: len(_supervisors(parent)) >= 1 + DISPATCH_AHEAD, 30, "the head of the line's supervisors")
    time.sleep(1.0)  # two passes of every dispatcher more
    assert len(_supervisors(parent)) == 1 + DISPATCH_AHEAD
    assert len(_queue_files(lock_dir)) == 20 + DISPATCH_AHEAD, "one entry a job, and no FIFO but the head's"
    rows = [job.refresh() for job in pending]
    assert all(row["state"] == "PENDING" and row["owner_pid"] == 0 for row in rows[DISPATCH_AHEAD:]), rows
    assert [job.status().ahead for job in pending[:3]] == [1, 2, 3]  # the running job, and the rows before
    open_gate(gate)
    assert holder.result(timeout=30) == "held"
    statuses = _finished(pending, 120)
    assert all(status.state is JobState.SUCCEEDED for status in statuses), statuses
    assert Path(log).read_text().split() == [job.id for job in pending]
    starts = [job.refresh()["started"] for job in pending]
    assert starts == sorted(starts)
    assert _queue_files(lock_dir) == []


def test_rows_wait_without_a_server_and_the_next_one_runs_them(cluster, connect, lock_dir, tmp_path):
    """Its server killed, the job at the head of the line runs in its turn (its supervisor waits as a process),
    the rows behind it wait (nothing starts them), and a server started later on the lock directory starts them."""
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    gate, log = str(tmp_path / "gate"), str(tmp_path / "ran")
    holder = conn.root.submit(gate_job(gate), "held")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 20, "the first job to run")
    queued = [conn.root.submit(_recorder, {"log": log}) for _ in range(DISPATCH_AHEAD + 3)]
    wait_until(lambda: all(job.refresh()["owner_pid"] for job in queued[:DISPATCH_AHEAD]), 20,
               "the head of the line to have its supervisor")
    process.popen.kill()
    process.popen.wait()
    open_gate(gate)
    ledger = Ledger(os.path.join(lock_dir, "state"), read_only=True)
    head, rows = queued[:DISPATCH_AHEAD], queued[DISPATCH_AHEAD:]
    wait_until(lambda: all(ledger.get(job.id).state is JobState.SUCCEEDED for job in [holder, *head]), 30,
               "the running job and the head of the line to end")
    time.sleep(1.0)
    assert [ledger.get(job.id).state for job in rows] == [JobState.PENDING] * len(rows)
    assert Path(log).read_text().split() == [job.id for job in head]
    again = connect(cluster.add_server("pytorch", "fake:1")[1])
    jobs = [again.root.job(job.id) for job in rows]
    assert all(status.state is JobState.SUCCEEDED for status in _finished(jobs, 60))
    assert Path(log).read_text().split() == [job.id for job in queued]


def test_a_queued_job_is_cancelled_at_once(cluster, connect, lock_dir, tmp_path):
    port = cluster.add_server("pytorch", "fake:1")[1]
    conn = connect(port)
    gate = str(tmp_path / "gate")
    holder = conn.root.submit(gate_job(gate), "held")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 20, "the first job to run")
    waiting = conn.root.submit(_recorder, {"log": str(tmp_path / "ran")})
    status = waiting.cancel()  # it ends here: no process of its own to tell
    assert status.state is JobState.CANCELLED and "cancelled while waiting" in status.error, status
    assert _queue_files(lock_dir) == []
    with pytest.raises(rpycdl.JobCancelledError):
        waiting.result(timeout=5)
    open_gate(gate)
    assert holder.result(timeout=30) == "held"
    assert not (tmp_path / "ran").exists()


def test_a_queued_jobs_queue_timeout_ends_it_with_no_server_asked(cluster, connect, tmp_path):
    port = cluster.add_server("pytorch", "fake:1")[1]
    conn = connect(port)
    gate = str(tmp_path / "gate")
    holder = conn.root.submit(gate_job(gate), "held")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 20, "the first job to run")
    waiting = conn.root.submit(_recorder, {"log": str(tmp_path / "ran")}, queue_timeout=1.0)
    with pytest.raises(rpycdl.QueueTimeoutError, match="waited 1 s"):
        waiting.result(timeout=20)
    open_gate(gate)
    assert holder.result(timeout=30) == "held"
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_two_servers_start_each_row_once(cluster, connect, tmp_path):
    """Forty short jobs submitted through two servers of one lock directory: each runs once."""
    conns = [connect(cluster.add_server("pytorch", "fake:2")[1]) for _ in range(2)]
    log = str(tmp_path / "ran")
    jobs = [conns[index % 2].root.submit(_recorder, {"log": log}) for index in range(40)]
    assert all(status.state is JobState.SUCCEEDED for status in _finished(jobs, 240))
    assert sorted(Path(log).read_text().split()) == sorted(job.id for job in jobs)


@pytest.mark.slow
def test_supervisors_killed_at_random_run_nothing_twice_and_leave_nothing_pending(cluster, connect, lock_dir,
                                                                                    tmp_path):
    """While thirty short jobs go through one GPU, kill -9 supervisors as they appear: one killed before its
    grant is started again (its job runs once), one killed after it is LOST; every job ends, none runs twice,
    and the queue is empty at the end."""
    port = cluster.add_server("pytorch", "fake:1")[1]
    conn = connect(port)
    log = str(tmp_path / "ran")
    jobs = [conn.root.submit(_recorder, {"log": log}) for _ in range(30)]
    rng, killed, deadline = random.Random(), set(), time.monotonic() + 20
    parent = server_pid(cluster, port)
    while time.monotonic() < deadline and not all(job.status().state.finished for job in jobs):
        for pid in [pid for pid in _supervisors(parent) if pid not in killed]:
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.3)
                procs.kill([pid], signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.01)
    statuses = _finished(jobs, 180)
    ran = Path(log).read_text().split() if Path(log).exists() else []
    assert len(ran) == len(set(ran)), f"a job ran twice: {sorted(ran)}"
    lost = [status for status in statuses if status.state is JobState.LOST]
    assert all(status.state in (JobState.SUCCEEDED, JobState.LOST) for status in statuses), statuses
    assert len(lost) <= len(killed) and killed, (len(lost), len(killed))
    succeeded = {job.id for job, status in zip(jobs, statuses, strict=True) if status.state is JobState.SUCCEEDED}
    assert succeeded <= set(ran)
    assert wait_until(lambda: _queue_files(lock_dir) == [], 5, "an empty queue")
