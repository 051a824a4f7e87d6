"""The processes of a job as /proc shows them (rpycdl.scheduler.procs): identities, zombies, sessions,
the environment marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rpycdl.scheduler import procs


def test_a_zombie_is_gone_and_a_reused_pid_is_not_the_process_recorded():
    child = subprocess.Popen(["sleep", "30"])
    pid, start = procs.identify(child.pid)
    assert procs.alive(pid, start) and not procs.alive(pid, start + 1)
    child.kill()
    deadline = time.monotonic() + 5
    while procs.stat(pid).state != "Z" and time.monotonic() < deadline:  # dead, not reaped yet
        time.sleep(0.01)
    assert not procs.alive(pid, start)
    child.wait()
    assert procs.stat(pid) is None


def test_a_jobs_processes_are_found_by_its_session_and_by_its_environment():
    env = {**os.environ, procs.JOB_ID_VARIABLE: "job123"}
    leader = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(30)"])
    marked = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while procs.stat(leader.pid).session != leader.pid and time.monotonic() < deadline:  # its setsid() done
            time.sleep(0.01)
        found = procs.job_processes("job123", procs.identify(leader.pid))
        assert leader.pid in found and marked.pid in found and os.getpid() not in found
        assert procs.job_processes("job456") == []
    finally:
        for process in (leader, marked):
            process.send_signal(signal.SIGKILL)
            process.wait()


def test_kill_until_gone_kills_what_it_finds_until_nothing_is_left():
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(30)"])
    assert procs.kill_until_gone(lambda: [child.pid] if procs.alive(child.pid) else [], 5)
    assert child.wait(5) == -signal.SIGKILL


def test_the_subtree_of_a_process_lists_its_descendants():
    outer = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(procs.subtree(outer.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(procs.subtree(outer.pid)) == 2
    finally:
        procs.kill([outer.pid, *procs.subtree(outer.pid)])
        outer.wait()
