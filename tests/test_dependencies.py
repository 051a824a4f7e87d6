"""Detached jobs' dependencies (submit's `after=`, issue 37): a job after ok: waits, held with no place in line, and
runs once its dependency succeeded; it fails at once with DependencyError, never having run, when its dependency
failed (and its own dependents after it); notok: and any:; a chain; a cancel of a held job; a held job survives
kill -9 of its server's parent and runs when a restarted server sees its dependency ended (promise 8); bad
input is refused, saying why. Real registry, servers, supervisors and clients on loopback; only the GPUs are
simulated."""

from __future__ import annotations

import signal
import time

import pytest
from helpers import TALKER, open_gate, rpycdl_cli, running, wait_until

import rpycdl
from rpycdl import JobState

END = 30.0
"""Seconds a test gives a job to reach a state (generous: a busy two-core machine)."""


def wait_state(job: rpycdl.Job, state: JobState, timeout: float = END) -> rpycdl.JobStatus:
    return wait_until(lambda: (status := job.status()).state is state and status, timeout, f"job {job.id} {state}")


def held_a_while(job: rpycdl.Job) -> None:
    """Check that `job` stays PENDING, never started, through several of its server's sweeps (twice a second)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        row = job.refresh()
        assert row["state"] == "PENDING" and row["started"] is None and row["ahead"] is None, row
        time.sleep(0.2)


def test_after_ok_waits_held_and_runs_once_its_dependency_succeeded(two, tmp_path, cluster):
    port, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "first"}, name="first")
    wait_state(first, JobState.RUNNING)
    second = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "second"}, after="ok:first")  # by name
    assert second.refresh()["request"]["after"] == f"ok:{first.id}"  # resolved to its id at submit
    held_a_while(second)  # a GPU is free: only its dependency holds it
    status = second.status()
    assert str(status) == f"PENDING (after ok:{first.id})" and status.after == f"ok:{first.id}", repr(status)
    listed = rpycdl_cli("jobs", "--host", "127.0.0.1", "--port", str(port))
    line = next(line for line in listed.stdout.splitlines() if line.startswith(second.id))
    assert line.endswith(f"after ok:{first.id}"), listed.stdout
    open_gate(gate)
    assert second.result(timeout=END) == "second"
    first_row, second_row = first.refresh(), second.refresh()
    assert first_row["state"] == "SUCCEEDED" and second_row["started"] >= first_row["ended"], (first_row, second_row)


def test_after_ok_of_a_job_that_fails_fails_at_once_with_its_reason_and_so_do_its_dependents(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "raise": "bad lr"})
    second = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "never"}, after=f"ok:{first.id}")
    third = conn.root.submit_command(["true"], after=f"ok:{second.id}")
    wait_state(first, JobState.RUNNING)
    open_gate(gate)
    assert first.wait(END).state is JobState.FAILED
    assert second.wait(END).state is JobState.FAILED
    row, ended = second.refresh(), first.refresh()["ended"]
    assert row["error_type"] == "DependencyError" and row["started"] is None, row
    assert (row["ended"] - ended).total_seconds() < 5.0, (row["ended"], ended)  # a few sweeps, not forever
    for part in (f"job {second.id}", f"after=ok:{first.id} cannot be met", f"job {first.id} FAILED",
                 "ValueError: bad lr"):
        assert part in row["error"], row["error"]
    with pytest.raises(rpycdl.DependencyError, match=f"job {first.id} FAILED"):
        second.result(timeout=5)
    assert third.wait(END).state is JobState.FAILED  # its dependents after it
    assert f"job {second.id} FAILED" in third.refresh()["error"], third.info
    assert not (tmp_path / f"started-{second.id}").exists()
    with pytest.raises(rpycdl.DependencyError, match=f"not submitted: .*job {first.id} FAILED"):
        conn.root.submit(TALKER, {"dir": str(tmp_path)}, after=f"ok:{first.id}")  # ended already: refused
    assert conn.root.submit_command(["true"], after=f"notok:{first.id}").result(timeout=END) == 0  # met already


@pytest.mark.parametrize("fails", [True, False], ids=["dependency-fails", "dependency-succeeds"])
def test_notok_runs_after_a_failure_only_and_any_after_either(fails, two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, **({"raise": "no"} if fails else {})})
    dependents = {kind: conn.root.submit(TALKER, {"dir": str(tmp_path), "value": kind}, after=f"{kind}:{first.id}")
                  for kind in ("ok", "notok", "any")}
    wait_state(first, JobState.RUNNING)
    held_a_while(dependents["any"])
    open_gate(gate)
    ended_as_their_kinds_say(dependents, fails)


def ended_as_their_kinds_say(dependents: dict[str, rpycdl.Job], fails: bool) -> dict[str, bool]:
    """Check that the jobs after ok:, notok: and any: of what `fails` or not ran, or failed never having run, as
    their kinds say; which ran, by kind."""
    runs = {"ok": not fails, "notok": fails, "any": True}
    for kind, job in dependents.items():
        status = job.wait(END)
        if runs[kind]:
            assert status.state is JobState.SUCCEEDED and job.result() == kind, (kind, status)
        else:
            assert status.state is JobState.FAILED and job.refresh()["error_type"] == "DependencyError", (kind, status)
            assert job.refresh()["started"] is None
    return runs


@pytest.mark.parametrize("fails", [True, False], ids=["an-element-fails", "every-element-succeeds"])
def test_after_an_array_waits_for_every_element(fails, two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    array = conn.root.submit_array(TALKER, [{"dir": str(tmp_path), "gate": gate, "value": index, **(
        {"raise": "no"} if fails and index == 2 else {})} for index in range(3)], name="sweep")
    dependents = {kind: conn.root.submit(TALKER, {"dir": str(tmp_path), "value": kind}, after=f"{kind}:sweep")
                  for kind in ("ok", "notok", "any")}
    assert dependents["ok"].refresh()["request"]["after"] == f"ok:{array.id}"  # the array's id, resolved at submit
    wait_until(lambda: array.status().counts["RUNNING"] == 2, END, "two elements running")
    held_a_while(dependents["any"])  # no place in line: its dependency holds it
    open_gate(gate)
    runs = ended_as_their_kinds_say(dependents, fails)
    last = max(element.refresh()["ended"] for element in array)
    for kind, job in dependents.items():  # those that ran started after every element's end; the others name it
        row = job.refresh()
        assert row["started"] >= last if runs[kind] else f"after={kind}:{array.id}" in row["error"], (kind, row)


def test_a_chain_of_three_runs_in_order(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    a = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "a"}, name="chain-a")
    b = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "b"}, name="chain-b", after="ok:chain-a")
    c = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "c"}, after="any:chain-a,chain-b")
    wait_state(a, JobState.RUNNING)
    held_a_while(c)
    open_gate(gate)
    assert [job.result(timeout=END) for job in (a, b, c)] == ["a", "b", "c"]
    rows = [job.refresh() for job in (a, b, c)]
    assert rows[0]["ended"] <= rows[1]["started"] and rows[1]["ended"] <= rows[2]["started"], rows


def test_a_held_job_is_cancelled_at_once_and_never_runs(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate})
    held = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "never"}, after=f"any:{first.id}")
    assert held.cancel().state is JobState.CANCELLED  # at once: no supervisor, no place in line to wait for
    row = held.refresh()
    assert row["state"] == "CANCELLED" and row["error"] == f"job {held.id} was cancelled while waiting", row
    with pytest.raises(rpycdl.JobCancelledError):
        held.result(timeout=5)
    open_gate(gate)
    assert first.wait(END).state is JobState.SUCCEEDED
    time.sleep(1.0)  # a few sweeps: none starts it
    assert held.refresh()["started"] is None and not (tmp_path / f"started-{held.id}").exists()


def test_a_held_job_survives_kill_9_of_its_server_and_runs_when_a_restarted_one_sees_its_dependency_end(
        cluster, connect, tmp_path):
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "first"})
    second = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "second"}, after=f"ok:{first.id}")
    third = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "third"}, after=f"ok:{second.id}")
    supervisor = wait_state(first, JobState.RUNNING) and first.refresh()["owner_pid"]
    process.popen.send_signal(signal.SIGKILL)
    process.popen.wait()
    open_gate(gate)  # its dependency ends while no server is up: nobody releases it yet
    wait_until(lambda: not running(supervisor), END, "the first job's supervisor to end")
    again = connect(cluster.add_server("pytorch", "fake:1")[1])
    second, third = again.root.job(second.id), again.root.job(third.id)
    assert again.root.job(first.id).status().state is JobState.SUCCEEDED
    assert (second.result(timeout=END), third.result(timeout=END)) == ("second", "third")


def test_bad_dependencies_are_refused_saying_why(two, tmp_path, cluster):
    port, conn = two
    for after, said in (("ok:", "after= takes KIND:JOB[,JOB...]"), ("sometimes:x", "KIND one of ok, notok, any"),
                        ("ok", "not 'ok'"), (3, "not 3"), ("ok:a b", "not 'ok:a b'"),
                        ("ok:no-such-job", "after='ok:no-such-job': no job 'no-such-job' here")):
        with pytest.raises(rpycdl.InvalidRequestError) as info:
            conn.root.submit(TALKER, {"dir": str(tmp_path)}, after=after)
        assert said in str(info.value), (after, info.value)
    refused = rpycdl_cli("submit", "pytorch", "--host", "127.0.0.1", "--port", str(port), "--after", "sometimes:x",
                         "--", "true")
    assert refused.returncode == 2 and "KIND one of ok, notok, any" in refused.stderr, refused.stderr
    assert conn.root.jobs() == []  # nothing was submitted
