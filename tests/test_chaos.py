"""Promises 1, 3 and 8 under chaos (issues 13, 15, 28, 35): kills at random while clients run whole-GPU and shared jobs,
attached and detached, and sessions; and with isolation (promise 9, issue 26), every job its owner's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import chaos
import pytest
from chaos import JOB_VAR, REQUESTS, TOKEN_VAR, ChaosSettings, dead_jobs_leftovers, read_stat, run_chaos
from helpers import write_user_map

from rpycdl.scheduler import procs
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.site.local import LocalCluster
from rpycdl.states import JobState

TIMED = tuple({**request, "timeout": timeout} for request in REQUESTS for timeout in (1, 5))
"""Requests that declare a timeout (longer than any chaos job runs), so that backfill has work to do."""

POLICIES = {
    "fcfs": ChaosSettings(),
    "fcfs-backfill": ChaosSettings(duration=18.0, server_args=("--policy", "fcfs-backfill"), requests=TIMED + REQUESTS),
    "fair": ChaosSettings(duration=18.0, server_args=("--policy", "fair"), users=3),
}
"""The chaos under each scheduling policy: promises 1 and 3 hold whoever goes first (the default policy runs
longest)."""


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_no_overcommit_and_no_leak_under_chaos(cluster, tmp_path, policy):
    """Two fake:4 servers on one lock directory, six clients, 25 s of kills (18 s under the other policies:
    connection processes right after a grant, job processes, their keepers, their children, server parents and
    right after them their orphaned forkservers or a job's keeper or job process, forkservers, spares, clients, and
    of sessions their processes, connection processes and clients), and on until the run has made enough jobs,
    sessions and every kind of kill it must: no GPU ever over-committed, no grant outliving its job by a second,
    nothing of a dead job a second after the last kill, everything clean a second after the detached jobs ended,
    and no job dead of a kill that was not its own."""
    _judge(run_chaos(cluster, tmp_path / "chaos", POLICIES[policy]))


PRIORITIZED = tuple({**request, "priority": priority} for request in REQUESTS for priority in (-1, 0, 0, 3))
"""Requests of three priorities, so that those of 3 preempt those below."""


@pytest.mark.slow
def test_no_overcommit_and_no_leak_under_chaos_with_preemption(cluster, tmp_path):
    """The chaos under fcfs, its requests of priorities -1, 0 and 3, with --preempt requeue and a grace of 1 s (the
    jobs' children that ignore SIGTERM are killed at its end): promises 1 and 3 hold, no detached job is lost or runs
    an attempt twice, and jobs were preempted (the ledger's preemptions)."""
    limits = tmp_path / "limits.toml"
    limits.write_text("[default]\npriority = 3\n")
    settings = ChaosSettings(duration=18.0, requests=PRIORITIZED, server_args=(
        "--preempt", "requeue", "--preempt-grace", "1s", "--limits", str(limits)))
    _judge(run_chaos(cluster, tmp_path / "chaos", settings))
    preempted = Ledger(os.path.join(cluster.lock_dir, "state")).preemptions()
    assert preempted, "no job was preempted: the run did not test preemption"
    print(f"{len(preempted)} preemption(s): {sum(row['outcome'] == 'requeued' for row in preempted)} requeued")


@pytest.mark.slow
def test_under_chaos_with_isolation_every_job_is_its_owners(team, accounts, passable_dir):
    """The same chaos, the servers started as root with a user map (jobs run as their owners' accounts, issue 26),
    the clients connecting as alice, bob and carol with their certificates: still no GPU over-committed, no grant
    outliving its job by a second, nothing left behind; and, checked from outside while it runs, every process of
    every job runs as its owner's uid, its working copy and output directory are its owner's, and its row in the
    ledger names the user its client connected as."""
    user_map = write_user_map(passable_dir / "users.toml")
    isolation = chaos.Isolation({user: account.pw_uid for user, account in accounts.items()},
                                {user: team.user(user) for user in [*accounts, "root"]},
                                (*team.server_args("localhost"), "--user-map", str(user_map)))
    with LocalCluster(str(passable_dir / "locks")) as cluster:
        _judge(run_chaos(cluster, passable_dir / "chaos", ChaosSettings(users=len(accounts), isolation=isolation)))


def _judge(result: chaos.ChaosResult) -> None:
    """Fail unless the run tested what it should and found no broken promise."""
    print(result.summary())
    missing = result.tested()
    assert not missing, (f"the chaos did not test what it should in {result.seconds:.0f} s (deadline "
                         f"{result.settings.deadline:g} s): " + "; ".join(missing) + "\n" + result.summary())
    problems = result.problems()
    assert not problems, "\n".join(problems) + "\n" + result.summary()


def _holding(path: Path) -> subprocess.Popen[str]:
    """A process that holds an fcntl lock on all of `path` until killed."""
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               "f = open(sys.argv[1], 'a')\nfcntl.lockf(f, fcntl.LOCK_EX)\nprint(flush=True)\n"
                               "time.sleep(60)", str(path)], stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    return holder


def _identity(process: subprocess.Popen[Any]) -> list[int]:
    return [process.pid, read_stat(process.pid).start]


def test_the_end_check_finds_what_dead_jobs_left_and_only_that(tmp_path):
    """dead_jobs_leftovers, against a lock directory and a ledger with one live job and one leftover of
    each kind: a held/ record of a job with no process, a lock held with no record, a queue entry whose
    waiter is gone, a RUNNING row whose owner died, a process of a job whose row has ended, the working
    directory of an ended job, a job directory with no row, the mark of files made by a dead process."""
    token = "chaos-test-token"
    for sub in ("gpus", "held", "queue", "reports"):
        (tmp_path / sub).mkdir()
    gpus = [tmp_path / "gpus" / f"GPU-{index:012d}.lock" for index in range(3)]
    for gpu in gpus:
        gpu.touch()
    dead = subprocess.Popen(["sleep", "30"])
    gone = _identity(dead)
    dead.kill()
    dead.wait()
    env = {**os.environ, TOKEN_VAR: token}
    started = [_holding(gpus[0]), _holding(gpus[2]), subprocess.Popen(["sleep", "30"]),
               subprocess.Popen(["sleep", "30"], env={**env, JOB_VAR: "ended"})]
    owner, stray, leader, _ = started
    fifo = tmp_path / "queue" / "0000000000000002.fifo"
    os.mkfifo(fifo)
    waiting = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a live waiter
    os.mkfifo(tmp_path / "queue" / "0000000000000001.fifo")  # a dead one's
    try:
        (tmp_path / "held" / "GPU-000000000000.1.json").write_text(json.dumps(
            {"job_id": "alive", "owner": _identity(owner), "leader": _identity(leader)}))
        (tmp_path / "held" / "GPU-000000000001.2.json").write_text(json.dumps(
            {"job_id": "gone", "owner": gone, "leader": gone}))
        for ticket, job in ((1, "waited"), (2, "waiting")):
            (tmp_path / "queue" / f"{ticket:016d}.json").write_text(json.dumps({"job_id": job}))
        ledger = Ledger(tmp_path / "state")
        for job, state, who in (("alive", JobState.RUNNING, procs.myself()), ("orphan", JobState.RUNNING, gone),
                                ("ended", JobState.SUCCEEDED, gone)):
            ledger.save(JobRecord(job, "server", "client", 1, state=state, owner_pid=who[0], owner_start=who[1]))
        ledger.close()
        jobs = tmp_path / "state" / "jobs"
        for kept in ("alive/work", "ended/result", "ended/work", "stray/spec.json", ".unrecorded/stray"):
            (jobs / kept).parent.mkdir(parents=True, exist_ok=True)
            (jobs / kept).write_text(f"{gone[0]} {gone[1]}")

        found = dead_jobs_leftovers(tmp_path, tmp_path / "reports", token.encode(), time.time())
        assert found.job_files == ["ended/work of a job SUCCEEDED", "stray/ without a row: ['spec.json']",
                                   f".unrecorded/stray of dead process {gone[0]}"]
        assert found.held_files == ["GPU-000000000001.2.json (job gone)"]
        assert found.locked == [f"GPU 2 locked by pid {stray.pid} (python) for no held/ record"]
        assert found.queue_files == ["0000000000000001.json (job waited)"]
        assert [row.split()[:2] for row in found.records] == [["orphan", "RUNNING"]]
        assert [process.split()[-1] for process in found.processes] == ["ended"]
        assert not found.holders and not found.queue
    finally:
        os.close(waiting)
        for process in started:
            process.kill()
            process.wait()


def test_the_owner_check_finds_a_process_and_a_file_that_are_not_the_jobs_owners(tmp_path):
    """OwnerWatch, against a job of a user whose uid is not this process's: its process (this test's child) and
    its working copy's file (this test's) are both named, each with the uid found; a process already gone, or
    not the one that started when the observer saw it, is not counted."""
    other = os.getuid() + 1
    owners = chaos.OwnerWatch({"alice": other}, tmp_path / "jobs")
    (tmp_path / "jobs" / "j1" / "work").mkdir(parents=True)
    (tmp_path / "jobs" / "j1" / "work" / "train.py").write_text("")
    process = subprocess.Popen(["sleep", "30"])
    try:
        report = chaos.Report("j1", process.pid, os.getpid(), process.pid, read_stat(process.pid).start, ("GPU-0",), 0,
                              time.time(), "alice")
        owners.process(process.pid, report.start, report)
        owners.process(process.pid, report.start - 1, report)  # a process that took its pid since: not it
        owners.job_files(report)
    finally:
        process.kill()
        process.wait()
    owners.process(process.pid, report.start, report)  # gone (reaped): nothing to check
    uid = os.getuid()
    assert owners.wrong == [f"process {process.pid} (sleep) of job j1 of alice runs as uids {(uid,) * 4}, not {other}",
                            f"{tmp_path}/jobs/j1/work of job j1 of alice belongs to uid {uid}, not {other}",
                            f"{tmp_path}/jobs/j1/work/train.py of job j1 of alice belongs to uid {uid}, not {other}"]
    assert (owners.processes, owners.files) == (1, 2)
