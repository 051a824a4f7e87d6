"""Detached jobs' retries (submit's `retries=` and `retry_on_failure=`, issue 37 item 3): a job whose process is
killed from outside, or whose supervisor and server die while it runs (LOST), is requeued up to `retries` times, each
attempt seeing its number in rpycdl.attempt() and the same output directory, and its history keeps each attempt; a
raise is retried only with retry_on_failure; a cancel never; retries exhausted, it ends with the last attempt's end;
bad options are refused, nothing submitted. Real registry, servers, supervisors and clients on loopback; only the
GPUs are simulated."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import rpycdl_cli, running, wait_until

import rpycdl
from rpycdl import JobState

END = 60.0
"""Seconds a test gives a job to reach a state (generous: a busy two-core machine)."""


def _make_resumer() -> Callable[[dict[str, Any]], Any]:
    """A job (made in a function, so that dill sends it by value) that leaves `attempt-N` in its output directory
    and its pid in `dir`/attempt-N.pid; before attempt `succeed_at` (default 2) it raises ValueError("attempt N") if
    `raise`, else waits to be killed; from it on, it returns its attempt, what its output directory held, and where
    that is."""

    def resumer(args: dict[str, Any]) -> Any:
        import os
        import time

        import rpycdl

        number, out = rpycdl.attempt(), rpycdl.output_dir()
        seen = sorted(os.listdir(out))
        with open(os.path.join(out, f"attempt-{number}"), "w") as file:
            file.write(out)
        pid_file = os.path.join(args["dir"], f"attempt-{number}.pid")
        with open(pid_file + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        if number < args.get("succeed_at", 2):
            print(f"attempt {number} begins", flush=True)
            if args.get("raise"):
                raise ValueError(f"attempt {number}")
            while True:
                time.sleep(0.05)
        return {"attempt": number, "seen": seen, "out": out}

    return resumer


RESUMER = _make_resumer()


@pytest.fixture
def conn(cluster, connect) -> rpycdl.Connection:
    """A connection to a server with one simulated GPU (its port: conn.address[1])."""
    return connect(cluster.add_server("pytorch", "fake:1")[1])


def job_pid(directory: Path, number: int) -> int:
    """The pid of the job process of attempt `number`, once it has started."""
    path = directory / f"attempt-{number}.pid"
    wait_until(path.exists, END, f"attempt {number} to start")
    return int(path.read_text())


def wait_state(job: rpycdl.Job, state: JobState) -> rpycdl.JobStatus:
    return wait_until(lambda: (status := job.status()).state is state and status, END, f"job {job.id} {state}")


def test_retries_1_turns_a_job_killed_on_its_first_attempt_into_a_success_on_its_second(conn, tmp_path):
    job = conn.root.submit(RESUMER, {"dir": str(tmp_path)}, retries=1, name="resumes")
    assert job.refresh()["request"]["retries"] == 1 and job.refresh()["attempt"] == 1
    os.kill(job_pid(tmp_path, 1), signal.SIGKILL)  # as the OOM killer, or a user, would
    value = job.result(timeout=END)
    assert value["attempt"] == 2 and value["seen"] == ["attempt-1"], value  # the first attempt's output kept
    first = tmp_path / "attempt-1.pid"
    assert first.exists() and value["out"].endswith(f"{job.id}/output"), value
    row = job.refresh()
    assert (row["state"], row["attempt"]) == ("SUCCEEDED", 2), row
    history = job.attempts()
    assert [(each["attempt"], each["state"]) for each in history] == [(1, "FAILED"), (2, "SUCCEEDED")], history
    assert history[0]["error_type"] == "JobCrashedError" and "signal 9" in history[0]["error"], history[0]
    assert history[0]["ended"] <= history[1]["started"], history
    log = "".join(job.logs())
    assert "attempt 1 begins" in log and "[rpycdl] attempt 2 of 2 (attempt 1 ended FAILED" in log, log
    listed = rpycdl_cli("jobs", "--long", "--host", "127.0.0.1", "--port", str(conn.address[1]))
    line = next(line for line in listed.stdout.splitlines() if line.startswith(job.id))
    assert "2/2" in line.split()[12:], listed.stdout  # TRY: its second attempt of two


def test_a_job_without_retries_is_not_requeued(conn, tmp_path):
    job = conn.root.submit(RESUMER, {"dir": str(tmp_path)})
    os.kill(job_pid(tmp_path, 1), signal.SIGKILL)
    assert job.wait(END).state is JobState.FAILED
    with pytest.raises(rpycdl.JobCrashedError, match="signal 9"):
        job.result()
    assert job.refresh()["attempt"] == 1 and len(job.attempts()) == 1
    assert not (tmp_path / "attempt-2.pid").exists()


def test_a_raise_is_retried_only_with_retry_on_failure(conn, tmp_path):
    (tmp_path / "plain").mkdir()
    plain = conn.root.submit(RESUMER, {"dir": str(tmp_path / "plain"), "raise": True}, retries=2)
    with pytest.raises(ValueError, match="attempt 1"):
        plain.result(timeout=END)
    assert plain.refresh()["attempt"] == 1
    (tmp_path / "again").mkdir()
    again = conn.root.submit_command(["true"], retries=1, retry_on_failure=True)  # a command takes them too
    assert again.result(timeout=END) == 0 and again.refresh()["request"]["retry_on_failure"] is True
    retried = conn.root.submit(RESUMER, {"dir": str(tmp_path / "again"), "raise": True}, retries=2,
                               retry_on_failure=True)
    assert retried.result(timeout=END)["attempt"] == 2
    history = retried.attempts()
    assert [each["state"] for each in history] == ["FAILED", "SUCCEEDED"], history
    assert (history[0]["error_type"], history[0]["error"]) == ("ValueError", "attempt 1"), history


def test_retries_exhausted_end_with_the_last_attempts_error(conn, tmp_path):
    job = conn.root.submit(RESUMER, {"dir": str(tmp_path), "raise": True, "succeed_at": 99}, retries=2,
                           retry_on_failure=True)
    with pytest.raises(ValueError, match="attempt 3"):
        job.result(timeout=END)
    row = job.refresh()
    assert (row["state"], row["attempt"], row["error"]) == ("FAILED", 3, "attempt 3"), row
    assert [each["error"] for each in job.attempts()] == ["attempt 1", "attempt 2", "attempt 3"]


def test_a_cancel_is_never_retried(conn, tmp_path):
    job = conn.root.submit(RESUMER, {"dir": str(tmp_path)}, retries=3)
    job_pid(tmp_path, 1)
    assert job.cancel().state is JobState.CANCELLED
    assert job.refresh()["attempt"] == 1 and len(job.attempts()) == 1
    assert not (tmp_path / "attempt-2.pid").exists()


def test_a_job_lost_with_its_server_and_supervisor_is_requeued_by_the_restarted_server(cluster, connect, tmp_path):
    process, port = cluster.add_server("pytorch", "fake:1")
    job = connect(port).root.submit(RESUMER, {"dir": str(tmp_path)}, retries=1)
    first = job_pid(tmp_path, 1)
    supervisor = wait_state(job, JobState.RUNNING) and job.refresh()["owner_pid"]
    process.popen.send_signal(signal.SIGKILL)  # a node's restart: the server, then the job's own processes
    process.popen.wait()
    os.kill(supervisor, signal.SIGKILL)
    wait_until(lambda: not running(first) and not running(supervisor), END, "the first attempt to be gone")
    again = connect(cluster.add_server("pytorch", "fake:1")[1])
    job = again.root.job(job.id)
    value = job.result(timeout=END)
    assert value["attempt"] == 2 and value["seen"] == ["attempt-1"], value
    history = job.attempts()
    assert [each["state"] for each in history] == ["LOST", "SUCCEEDED"], history
    assert history[0]["error_type"] == "JobLostError" and f"pid {supervisor}" in history[0]["error"], history


def test_bad_retries_are_refused_saying_why(conn, tmp_path):
    for options, said in (({"retries": -1}, "from 0 to 100"), ({"retries": 101}, "from 0 to 100"),
                          ({"retries": 1.5}, "whole number"), ({"retries": "2"}, "whole number"),
                          ({"retry_on_failure": True}, "needs retries= of 1 or more"),
                          ({"retries": 1, "retry_on_failure": "yes"}, "True or False")):
        with pytest.raises(rpycdl.InvalidRequestError, match=said):
            conn.root.submit(RESUMER, {"dir": str(tmp_path)}, **options)
        with pytest.raises(rpycdl.InvalidRequestError, match=said):
            conn.root.submit_command(["true"], **options)
    refused = rpycdl_cli("submit", "pytorch", "--host", "127.0.0.1", "--port", str(conn.address[1]), "--retries", "-1",
                         "--", "true")
    assert refused.returncode == 2 and "from 0 to 100" in refused.stderr, refused.stderr
    refused = rpycdl_cli("submit", "pytorch", "--host", "127.0.0.1", "--port", str(conn.address[1]),
                         "--retry-on-failure", "--", "true")
    assert refused.returncode == 2 and "needs retries=" in refused.stderr, refused.stderr
    assert conn.root.jobs() == []  # nothing was submitted
