"""Limits with real servers and clients (rpycdl serve --limits): a user's jobs over her GPU limit wait, never
overlapping, while another user's start on the free GPUs, and say why in job.status(), `rpycdl jobs` and
`rpycdl status`; GPU-hours from the ledger's rows; a reload on SIGHUP (a bad file keeps the old limits); a bad
file refused at start; the limits in force through kill -9 of the server and its restart."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import Background, gate_job, open_gate, server_process, wait_until

from rpycdl import JobState
from rpycdl.errors import LimitError
from rpycdl.scheduler import limits
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.site.local import start


def _cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "rpycdl", *args], capture_output=True, text=True,
                          timeout=60).stdout


def _limits(tmp_path: Path, text: str) -> str:
    path = tmp_path / "limits.toml"
    path.write_text(text)
    return str(path)


def _users(connect, port: int):
    alice, bob = connect(port), connect(port)
    alice.root.identify("alice")
    bob.root.identify("bob")
    return alice, bob


def _pending_with(job, words: str, timeout: float = 30) -> None:
    wait_until(lambda: job.status().state is JobState.PENDING and words in job.status().reason, timeout,
               f"job {job.id} to wait saying {words!r}")


def test_a_users_jobs_over_her_gpu_limit_wait_without_overlap_while_anothers_start(server, connect, tmp_path):
    port = server("pytorch", "fake:4", "--limits", _limits(tmp_path, "[users.alice]\ngpus = 1\n"))
    alice, bob = _users(connect, port)
    gate = str(tmp_path / "gate")
    hers = [alice.root.submit(gate_job(gate), n, ngpus=1) for n in range(3)]
    wait_until(lambda: hers[0].status().state is JobState.RUNNING, 30, "alice's first job to run")
    for job in hers[1:]:
        _pending_with(job, "alice holds 1 GPU, the limit of users.alice.gpus = 1")
    his = [bob.root.submit(gate_job(gate), n, ngpus=1) for n in range(3)]
    for job in his:  # behind alice's waiting jobs in line, on the three GPUs she may not take
        wait_until(lambda job=job: job.status().state is JobState.RUNNING, 30, "bob's jobs to run")
    assert "limit of users.alice.gpus" in str(hers[1].status())
    listing = _cli("jobs", "--host", "127.0.0.1", "--port", str(port), "--all")
    assert "WHY" in listing.splitlines()[0] and "users.alice.gpus" in listing, listing
    status = _cli("status", "--host", "127.0.0.1", "--port", str(port))
    assert "held back: alice holds 1 GPU" in status, status
    open_gate(gate)
    assert [job.result(60) for job in hers + his] == [0, 1, 2, 0, 1, 2]
    runs = sorted((job.refresh()["started"], job.refresh()["ended"]) for job in hers)
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(runs)), runs


def test_gpu_hours_in_the_ledger_hold_a_job_back_and_a_reload_on_sighup_lets_it_go(cluster, server, connect,
                                                                                    tmp_path, lock_dir):
    now = time.time()  # alice ran 4 GPUs for 3 hours, ending an hour ago: 12 GPU-hours in the last day
    Ledger(os.path.join(lock_dir, "state")).save(JobRecord(
        "past-job", "elsewhere", "127.0.0.1:1", 4, state=JobState.SUCCEEDED, submitted=now - 4 * 3600,
        started=now - 4 * 3600, ended=now - 3600, user="alice", gpus=4.0))
    path = _limits(tmp_path, "[default]\ngpu_hours_day = 10\n")
    port = server("pytorch", "fake:2", "--limits", path)
    alice, bob = _users(connect, port)
    held = alice.root.submit(lambda x: x, "alice's")
    _pending_with(held, "alice used 12.0 GPU-hours in the last day, the limit of default.gpu_hours_day = 10")
    assert bob.root.submit(lambda x: x, "bob's").result(60) == "bob's"
    process = server_process(cluster, port)
    Path(path).write_text("[default]\ngpu_hours_day = 'lots'\n")  # a bad file: the old limits stay
    wait_until(lambda: any("not read again" in line for line in process.lines), 30, "the bad file to be logged")
    assert held.status().state is JobState.PENDING
    stamp = os.stat(path)
    Path(path).write_text("[default]\ngpu_hours_day = 2000.0\n")  # the same size, inode and time: SIGHUP alone tells
    assert os.stat(path).st_size == stamp.st_size
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    os.kill(process.popen.pid, signal.SIGHUP)
    assert held.result(60) == "alice's"


def test_a_waiting_call_is_told_again_as_why_it_waits_changes(cluster, server, connect, tmp_path):
    """Item 5 with real servers: an attached call of alice's waits on her limit and is told so (its on_state, which
    the waiting line shows); the limit raised on SIGHUP while both GPUs stay held, it is told again, waiting with no
    reason now; then it runs."""
    path = _limits(tmp_path, "[users.alice]\ngpus = 1\n")
    port = server("pytorch", "fake:2", "--limits", path)
    alice, bob = _users(connect, port)
    gates = [str(tmp_path / "alice"), str(tmp_path / "bob")]
    first, theirs = alice.root.submit(gate_job(gates[0]), 0), bob.root.submit(gate_job(gates[1]), 1)
    wait_until(lambda: first.status().state is theirs.status().state is JobState.RUNNING, 30, "both GPUs held")
    hers = connect(port)
    hers.root.identify("alice")
    second = Background(hers, lambda x: x, 2)
    pending = lambda: [info for state, info in second.states if state == "pending"]  # noqa: E731
    wait_until(lambda: any("the limit of users.alice.gpus = 1" in (info.get("reason") or "") for info in pending()),
               30, "her call to be told it waits on her limit")
    Path(path).write_text("[users.alice]\ngpus = 2\n")
    os.kill(server_process(cluster, port).popen.pid, signal.SIGHUP)
    wait_until(lambda: not pending()[-1].get("reason"), 30, "her call to be told it waits for a GPU alone")
    for gate in gates:
        open_gate(gate)
    assert wait_until(lambda: second.done, 60, "her call to end") and second.value == 2
    assert [state for state, _ in second.states][-1] == "running"


def test_a_bad_limits_file_is_a_start_failure(tmp_path, lock_dir):
    bad = _limits(tmp_path, "[users.alice]\ngpus = -2\n")
    process = start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--lock-dir", lock_dir, "--port", "0",
                     "--registry", "none", "--limits", bad])
    assert process.popen.wait(60) == 1
    assert any("users.alice.gpus must be a number, 0 or more, not -2" in line and bad in line
               for line in process.lines), process.lines


def test_limits_stay_in_force_through_kill_9_of_the_server_and_its_restart(cluster, server, connect, tmp_path,
                                                                           lock_dir):
    path = _limits(tmp_path, "[users.alice]\ngpus = 1\n")
    port = server("pytorch", "fake:2", "--limits", path)
    alice, _ = _users(connect, port)
    gate = str(tmp_path / "gate")
    first = alice.root.submit(gate_job(gate), 1)
    wait_until(lambda: first.status().state is JobState.RUNNING, 30, "alice's first job to run")
    second = alice.root.submit(gate_job(gate), 2)
    _pending_with(second, "limit of users.alice.gpus")
    server_process(cluster, port).popen.kill()
    server_process(cluster, port).popen.wait(30)
    assert limits.in_force(Path(lock_dir)) is not None  # the supervisors grant by them meanwhile
    port = server("pytorch", "fake:2", "--limits", path)
    alice, bob = _users(connect, port)
    again = alice.root.job(second.id)
    _pending_with(again, "alice holds 1 GPU")
    assert bob.root.submit(lambda x: x, "bob's").result(60) == "bob's"
    open_gate(gate)
    assert again.result(60) == 2
    runs = sorted((alice.root.job(job.id).refresh()["started"], alice.root.job(job.id).refresh()["ended"])
                  for job in (first, second))
    assert runs[0][1] <= runs[1][0], runs


def test_a_submit_over_the_pending_limit_or_the_gpus_limit_is_refused_by_name(server, connect, tmp_path):
    port = server("pytorch", "fake:2", "--limits", _limits(tmp_path, "[default]\npending = 1\ngpus = 1\n"))
    alice, bob = _users(connect, port)
    gate = str(tmp_path / "gate")
    running = alice.root.submit(gate_job(gate), 0)
    wait_until(lambda: running.status().state is JobState.RUNNING, 30, "alice's first job to run")
    waiting = alice.root.submit(gate_job(gate), 1)
    with pytest.raises(LimitError, match=r"alice has 1 job\(s\) waiting, the limit of default.pending = 1"):
        alice.root.submit(lambda x: x, 2)
    with pytest.raises(LimitError, match="bob asks 2 GPUs, more than the limit of default.gpus = 1"):
        bob.root.submit(lambda x: x, 3, ngpus=2)
    with pytest.raises(LimitError, match=r"bob has 0 job\(s\) waiting, the limit of default.pending = 1 \(the --limits "
                                         r"file\), and an array of 2 would pass it \(nothing was submitted\)"):
        bob.root.submit_array(gate_job(gate), [4, 5], name="too-many")
    with pytest.raises(LimitError, match="bob asks 2 GPUs, more than the limit of default.gpus = 1"):
        bob.root.submit_array(gate_job(gate), [6], ngpus=2)
    assert not bob.root.jobs(all=True, users=["bob"])  # nothing of his was submitted
    open_gate(gate)
    assert [running.result(60), waiting.result(60)] == [0, 1]
