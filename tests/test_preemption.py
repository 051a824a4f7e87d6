"""Preemption with real servers (`rpycdl serve --preempt requeue|cancel --preempt-grace`): a job of priority 5 on a
full `fake:1` server starts within the grace plus a little (by the ledger), the detached job it preempted saves a
checkpoint on SIGTERM (rpycdl.on_preempt) and resumes from it on its second attempt, which its retries=0 allowed; an
attached job gets PreemptedError; a job never preempts one of its own priority; and kill -9 of the server and its
restart in the middle loses no job."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers import Background, gate_job, open_gate, scrape, server_process, wait_until

from rpycdl import JobState
from rpycdl.errors import PreemptedError
from rpycdl.scheduler.ledger import Ledger
from rpycdl.site.local import one_account, start

GRACE = 2.0
FLAGS = ("--preempt", "requeue", "--preempt-grace", f"{GRACE:g}s")


def _limits(tmp_path: Path) -> str:
    path = tmp_path / "limits.toml"
    path.write_text("[users.alice]\npriority = 5\n")
    return str(path)


def _alice(connect, port: int):
    conn = connect(port)
    conn.root.identify("alice")
    return conn


def _make_resumable():
    """A job (made in a function, so that dill sends it by value) that, on its first attempt, counts steps until
    preempted, saving the count to its output directory on SIGTERM, after marking `ready` (its handler is set); on a
    later attempt it returns what it resumes from and its attempt."""

    def resumable(ready: str):
        import os
        import time

        import rpycdl

        checkpoint = os.path.join(rpycdl.output_dir(), "checkpoint")
        if rpycdl.attempt() > 1:
            with open(checkpoint) as saved:
                return saved.read(), rpycdl.attempt()
        steps = [0]

        def save() -> None:
            with open(checkpoint, "w") as out:
                out.write(f"step {steps[0]}")

        rpycdl.on_preempt(save)
        open(ready, "w").close()
        while True:
            steps[0] += 1
            time.sleep(0.01)

    return resumable


RESUMABLE = _make_resumable()


def _ledger(lock_dir: str) -> Ledger:
    return Ledger(os.path.join(lock_dir, "state"))


def _running(job, timeout: float = 60) -> None:
    wait_until(lambda: job.status().state is JobState.RUNNING, timeout, f"job {job.id} to run")


def test_a_higher_priority_job_starts_within_the_grace_and_the_preempted_one_resumes_from_its_checkpoint(
        server, connect, monitor, tmp_path, lock_dir):
    port = server("pytorch", "fake:1", "--limits", _limits(tmp_path), *FLAGS)
    alice = _alice(connect, port)
    ready = str(tmp_path / "ready")
    victim = alice.root.submit(RESUMABLE, ready)  # retries=0: a preemption spends none
    _running(victim)
    wait_until(lambda: os.path.exists(ready), 60, "the job to set its handler")
    urgent = alice.root.submit(lambda x: x, "urgent", priority=5)
    assert urgent.result(120) == "urgent"
    saved, attempt = victim.result(120)
    assert saved.startswith("step ") and int(saved.split()[1]) > 0 and attempt == 2, (saved, attempt)
    ledger = _ledger(lock_dir)
    row, first = ledger.get(urgent.id), ledger.attempts(victim.id)[0]
    assert row.started - row.submitted <= GRACE + 1 + 3, row  # the grace plus a second, plus a loaded machine's 3 s
    assert first["state"] == "CANCELLED" and "preempted by job " + urgent.id in first["error"], first
    assert first["ended"] <= row.started  # its GPU went to the urgent job only once it had let go
    [preempted] = ledger.preemptions(victim.id)
    assert (preempted["by_job"], preempted["attempt"], preempted["priority"], preempted["outcome"]) == (
        urgent.id, 1, 5, "requeued")
    counted = {labels["outcome"]: count for labels, count in scrape(monitor).get("rpycdl_preemptions_total", [])}
    assert counted == {"requeued": 1, "ended": 0}, counted


def test_a_preempted_job_requeued_goes_back_to_its_place_before_the_jobs_that_came_after_it(server, connect,
                                                                                              tmp_path, lock_dir):
    port = server("pytorch", "fake:1", "--limits", _limits(tmp_path), *FLAGS)
    alice = _alice(connect, port)
    ready, gate = str(tmp_path / "ready"), str(tmp_path / "gate")
    victim = alice.root.submit(RESUMABLE, ready)
    _running(victim)
    wait_until(lambda: os.path.exists(ready), 60, "the job to set its handler")
    later = [alice.root.submit(lambda x: x, f"later {index}") for index in range(2)]
    urgent = alice.root.submit(gate_job(gate), "urgent", priority=5)  # holds the GPU until the victim is requeued
    _running(urgent)
    wait_until(lambda: victim.refresh()["attempt"] == 2 and victim.status().ahead is not None, 60,
               "the preempted job to be back in line")
    open_gate(gate)
    assert [job.result(120) for job in [urgent, *later]] == ["urgent", "later 0", "later 1"]
    assert victim.result(120)[1] == 2
    ledger = _ledger(lock_dir)
    starts = sorted([victim, *later], key=lambda job: ledger.get(job.id).started)
    assert starts == [victim, *later], [(job.id, ledger.get(job.id).started) for job in starts]


def test_an_attached_job_and_a_session_preempted_get_preempted_error(server, connect, tmp_path):
    port = server("pytorch", "fake:1", "--limits", _limits(tmp_path), *FLAGS)
    alice = _alice(connect, port)
    gate = str(tmp_path / "gate")
    attached = Background(_alice(connect, port), gate_job(gate), "attached")
    attached.wait_state("running", 60)
    urgent = alice.root.submit(lambda x: x, "urgent", priority=5)
    assert urgent.result(120) == "urgent"
    with pytest.raises(PreemptedError, match="preempted by job " + urgent.id):
        attached.result(60)
    ran = []
    with pytest.raises(PreemptedError) as raised, _alice(connect, port).root.session() as session:
        assert session.run(lambda x: x, 1) == 1  # then it holds its GPU between its calls
        ran.append(alice.root.submit(lambda x: x, "urgent again", priority=5))
        assert ran[0].result(120) == "urgent again"
        session.run(lambda x: x, 2)
    assert "preempted by job " + ran[0].id in str(raised.value)


def test_under_preempt_cancel_a_detached_job_preempted_ends_with_preempted_error(server, connect, tmp_path,
                                                                                   lock_dir):
    port = server("pytorch", "fake:1", "--limits", _limits(tmp_path), "--preempt", "cancel", "--preempt-grace", "2s")
    alice = _alice(connect, port)
    victim = alice.root.submit(gate_job(str(tmp_path / "gate")), "victim", retries=3)
    _running(victim)
    urgent = alice.root.submit(lambda x: x, "urgent", priority=5)
    assert urgent.result(120) == "urgent"
    with pytest.raises(PreemptedError, match="preempted by job " + urgent.id):
        victim.result(60)
    assert victim.status().state is JobState.CANCELLED and _ledger(lock_dir).get(victim.id).attempt == 1
    assert [row["outcome"] for row in _ledger(lock_dir).preemptions(victim.id)] == ["ended"]


def test_a_job_never_preempts_one_of_its_own_priority(server, connect, tmp_path, lock_dir):
    port = server("pytorch", "fake:1", "--limits", _limits(tmp_path), *FLAGS)
    alice = _alice(connect, port)
    gate = str(tmp_path / "gate")
    first = alice.root.submit(gate_job(gate), "first", priority=3)
    _running(first)
    second = alice.root.submit(gate_job(gate), "second", priority=3)
    wait_until(lambda: second.status().ahead is not None, 60, "the second job to wait in line")
    time.sleep(GRACE + 1.5)  # time enough for a preemption, which would have ended the first by now
    assert first.status().state is JobState.RUNNING and second.status().state is JobState.PENDING
    open_gate(gate)
    assert [first.result(60), second.result(60)] == ["first", "second"]
    ledger = _ledger(lock_dir)
    assert ledger.get(first.id).attempt == 1 and ledger.preemptions() == []
    assert ledger.get(second.id).started >= ledger.get(first.id).ended


def test_kill_9_of_the_server_and_its_restart_during_a_preemption_loses_no_job(cluster, server, connect, tmp_path,
                                                                              lock_dir):
    limits = _limits(tmp_path)
    port = server("pytorch", "fake:1", "--limits", limits, *FLAGS)
    alice = _alice(connect, port)
    ready = str(tmp_path / "ready")
    victim = alice.root.submit(RESUMABLE, ready)
    _running(victim)
    wait_until(lambda: os.path.exists(ready), 60, "the job to set its handler")
    urgent = alice.root.submit(lambda x: x, "urgent", priority=5)
    process = server_process(cluster, port)
    process.popen.kill()
    process.popen.wait(30)
    port = server("pytorch", "fake:1", "--limits", limits, *FLAGS)
    again = _alice(connect, port).root
    assert again.job(urgent.id).result(120) == "urgent"
    saved, attempt = again.job(victim.id).result(120)
    assert saved.startswith("step ") and attempt == 2
    assert [row["by_job"] for row in _ledger(lock_dir).preemptions(victim.id)] == [urgent.id]


def test_every_server_of_a_lock_directory_must_preempt_alike(server, lock_dir):
    server("pytorch", "fake:1", *FLAGS)
    other = start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--lock-dir", lock_dir, "--port", "0",
                   "--registry", "none", *one_account(), "--preempt", "cancel"])
    assert other.popen.wait(60) != 0
    assert any("--preempt requeue --preempt-grace 2s" in line and "--preempt cancel" in line
               for line in other.lines), other.lines
