"""Promises 1 and 3 when the process holding a grant dies: its GPUs are granted again only once
nothing its job started still runs, whoever granted them, and its record does not stay running.

The jobs here start programs that make themselves hard to find (a process group or a session of
their own, SIGTERM ignored, zombies nobody reaps); the next job on the GPU looks, from inside, for
any of them still running when it starts. Real registry, servers and clients on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Background,
    connection_processes,
    granted_at,
    running,
    seen_at,
    server_pid,
    unavailable,
    wait_until,
)

import rpycdl
from rpycdl.scheduler import lockdir
from rpycdl.scheduler.ledger import Ledger
from rpycdl.site.local import one_account

GRACE = 1.0  # promise 3: free again within a second

# A program a job starts: reports its pid, then runs until killed, ignoring SIGTERM. MODE says how it
# hides: "plain" (in the job's process group), "group" (a group of its own, as shells with job control
# do), "session" (a session of its own, as daemons do), "zombie" (a group of its own, with a child that
# rejoins the job's group and exits, never reaped: a zombie of the job's group with a live parent).
PROGRAM = """
import os, signal, sys, time
mode, report = sys.argv[1], sys.argv[2]
if mode == "group":
    os.setpgid(0, 0)
elif mode == "session":
    os.setsid()
elif mode == "zombie":
    job_group = os.getpgrp()
    os.setpgid(0, 0)
    child = os.fork()
    if child == 0:
        os.setpgid(0, job_group)
        os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(report + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(report + ".tmp", report)
time.sleep(120)
"""


def _make_holder() -> Callable[[dict[str, Any]], Any]:
    """The first job: starts PROGRAM in args["mode"], writes its pids to args["dir"]/info.json, then
    sleeps (args["end"] "sleep") or returns at once ("return")."""

    def holder(args: dict[str, Any]) -> Any:
        import json
        import os
        import subprocess
        import sys
        import time

        report = os.path.join(args["dir"], "program.pid")
        subprocess.Popen([sys.executable, "-c", args["program"], args["mode"], report])
        while not os.path.exists(report):
            time.sleep(0.005)
        info = {"pid": os.getpid(), "ppid": os.getppid(), "program": int(open(report).read()),
                "job_id": os.environ["RPYCDL_JOB_ID"]}
        with open(os.path.join(args["dir"], ".info.json"), "w") as f:
            json.dump(info, f)
        os.replace(os.path.join(args["dir"], ".info.json"), os.path.join(args["dir"], "info.json"))
        if args["end"] == "sleep":
            time.sleep(120)
        return info

    return holder


def _make_next() -> Callable[[dict[str, Any]], Any]:
    """The next job on the GPU: which of the first job's processes still run as it starts."""

    def next_job(args: dict[str, Any]) -> Any:
        import json
        import os

        def running(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rpartition(")")[2].split()[0] not in "ZX"
            except OSError:
                return False

        info = json.load(open(os.path.join(args["dir"], "info.json")))
        return {"running": [pid for pid in (info["pid"], info["program"]) if running(pid)]}

    return next_job


HOLDER, NEXT = _make_holder(), _make_next()


def read_info(directory: Path) -> dict[str, Any]:
    wait_until((directory / "info.json").exists, 20, "the first job to start its program")
    return json.loads((directory / "info.json").read_text())


def hold(conn: rpycdl.Connection, directory: Path, mode: str, end: str = "sleep") -> tuple[Background, dict]:
    """The first job, once it runs; its info also names its connection process ("conn": its row's owner)."""
    job = Background(conn, HOLDER, {"dir": str(directory), "mode": mode, "program": PROGRAM, "end": end}, ngpus=1)
    info = read_info(directory)
    return job, {**info, "conn": Ledger(Path(conn.root.gpu_status()["server"]["state_dir"])).get(info["job_id"])
                 .owner_pid}


def queued(conn: rpycdl.Connection, directory: Path) -> Background:
    """The next job, once it waits for the GPU."""
    job = Background(conn, NEXT, {"dir": str(directory)}, ngpus=1)
    job.wait_state("pending")
    return job


def records(lock_dir: str) -> dict[str, str]:
    """Job id -> state of every job of the lock directory's ledger."""
    return {record.job_id: record.state.value for record in Ledger(Path(lock_dir, "state")).query()}


@pytest.fixture
def program_reaper():
    """Pids of PROGRAMs a test started; any still running at its end is killed (and fails it)."""
    started: list[int] = []
    yield started
    left = [pid for pid in started if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"programs of a job still ran when the test ended: {left}"


@pytest.mark.parametrize("mode", ["plain", "group", "session"])
def test_gpu_is_granted_again_only_once_the_dead_holders_programs_are_gone(
        server, connect, lock_dir, tmp_path, mode, program_reaper):
    port = server("pytorch", "fake:1")
    _, info = hold(connect(port), tmp_path, mode)
    program_reaper.append(info["program"])
    waiting = queued(connect(port), tmp_path)
    os.kill(info["conn"], signal.SIGKILL)  # its connection process: the kernel drops its locks at once
    killed = time.time()
    result = waiting.result()
    assert result["running"] == [], f"the GPU was granted again while the dead job's {mode} program still ran"
    granted = granted_at(lock_dir, waiting.job_id)
    assert granted - killed < GRACE, f"granted {granted - killed:.2f} s after the kill"


@pytest.mark.parametrize("mode", ["group", "session"])
def test_what_a_finished_job_started_is_gone_before_its_gpu_is_granted_again(server, connect, tmp_path, mode,
                                                                              program_reaper):
    # The job returns; a program it started that left its process group, or its session, must not
    # run on: the forkserver adopted it (a child subreaper) and kills it before it tells the job's end.
    port = server("pytorch", "fake:1")
    blocker = Background(connect(port), HOLDER, {"dir": str(tmp_path), "mode": mode, "program": PROGRAM,
                                                 "end": "return"}, ngpus=1)
    info = blocker.result()
    program_reaper.append(info["program"])
    result = Background(connect(port), NEXT, {"dir": str(tmp_path)}, ngpus=1).result()
    assert result["running"] == [], f"the GPU was granted again while the finished job's {mode} program ran"


def test_a_wakeup_right_after_the_holder_died_does_not_grant_its_gpu_early(cluster, server, connect, tmp_path,
                                                                           program_reaper):
    # The kernel frees the lock as the connection process dies, before anyone has killed what its
    # job started. A waiter woken at that moment (any release or grant of the host wakes it) must
    # not take the GPU while those programs still run.
    port = server("pytorch", "fake:1")
    queue = Path(cluster.lock_dir) / "queue"
    for attempt in range(5):
        directory = tmp_path / str(attempt)
        directory.mkdir()
        _, info = hold(connect(port), directory, "plain")
        program_reaper.append(info["program"])
        waiting = queued(connect(port), directory)
        os.kill(info["conn"], signal.SIGKILL)
        while not waiting.done:  # wake it as often as we can
            for name in lockdir.names(queue, "", ".fifo"):
                lockdir.poke(queue / name)
        assert waiting.result()["running"] == [], f"attempt {attempt}: granted while the dead job's program ran"


def test_a_zombie_of_the_job_does_not_hold_its_gpu(server, connect, tmp_path, program_reaper):
    # The job leaves a zombie in its process group whose parent, outside the group, never reaps it:
    # the zombie runs nothing, so the GPU is free as soon as the rest of the job is gone.
    port = server("pytorch", "fake:1")
    conn = connect(port)
    job = Background(conn, HOLDER, {"dir": str(tmp_path), "mode": "zombie", "program": PROGRAM, "end": "return"},
                     ngpus=1)
    other = connect(port)
    info = job.result()
    ended = time.time()
    program_reaper.append(info["program"])
    free = seen_at(lambda: not other.root.gpu_status()["gpus"][0]["holders"], 5, "the GPU to be free")
    assert free - ended < GRACE, f"the GPU was free {free - ended:.2f} s after the job ended"
    assert not running(info["program"]), "a program the job started outlived it"


def test_after_a_server_restart_a_dead_holder_of_the_old_server_is_cleaned_up(cluster, connect, tmp_path,
                                                                              program_reaper):
    # kill -9 of the server parent leaves its connection processes serving their clients; a new
    # server on the same lock directory must clean up after them when they die, as the old would have.
    _, old_port = cluster.add_server("pytorch", "fake:1")
    _, info = hold(connect(old_port), tmp_path, "plain")
    program_reaper.append(info["program"])
    os.kill(server_pid(cluster, old_port), signal.SIGKILL)
    _, new_port = cluster.add_server("pytorch", "fake:1")
    waiting = queued(connect(new_port), tmp_path)
    os.kill(info["conn"], signal.SIGKILL)
    killed = time.time()
    result = waiting.result()
    assert result["running"] == [], "the GPU was granted again while the dead job's program still ran"
    granted = granted_at(cluster.lock_dir, waiting.job_id)
    assert granted - killed < GRACE, f"granted {granted - killed:.2f} s after the kill"
    wait_until(lambda: records(cluster.lock_dir).get(info["job_id"]) == "FAILED", GRACE,
               f"the dead job's record to say failed (it says {records(cluster.lock_dir).get(info['job_id'])})")


def test_no_record_stays_pending_or_running_after_its_server_and_connections_died(cluster, connect, tmp_path,
                                                                                  program_reaper):
    _, old_port = cluster.add_server("pytorch", "fake:1")
    _, info = hold(connect(old_port), tmp_path, "plain")
    program_reaper.append(info["program"])
    waiter = queued(connect(old_port), tmp_path)
    serving = connection_processes(server_pid(cluster, old_port))
    assert info["conn"] in serving and len(serving) == 2, serving  # the holder's and the waiter's
    os.kill(server_pid(cluster, old_port), signal.SIGKILL)
    assert records(cluster.lock_dir) == {info["job_id"]: "RUNNING", waiter.job_id: "PENDING"}
    for pid in serving:
        os.kill(pid, signal.SIGKILL)
    _, new_port = cluster.add_server("pytorch", "fake:1")
    wait_until(lambda: records(cluster.lock_dir) == {info["job_id"]: "FAILED", waiter.job_id: "FAILED"}, GRACE,
               "both records to say failed")
    assert not running(info["program"])
    status = connect(new_port).root.gpu_status()
    assert status["gpus"][0]["holders"] == [] and status["queue"] == []


def test_a_server_in_another_pid_namespace_is_refused_on_a_shared_lock_directory(cluster, server):
    # Its pids would mean other processes to the servers already there, and theirs nothing to it.
    server("pytorch", "fake:1")
    argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable, "-m", "rpycdl", "serve",
            "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none", "--lock-dir",
            cluster.lock_dir, *one_account()]
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        unavailable("needs a new PID namespace (unshare --pid, as root)", "run this test as root")
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the server started: {exc.stdout!r}") from None
    assert result.returncode != 0, result.stdout
    assert "used by servers in another PID namespace" in result.stderr and "--pid host" in result.stderr, result.stderr
