"""Detached jobs end to end: submit, walk away, come back for the logs and the result; the job outlives
its client (kill -9 while it waits and while it runs), its server's parent (kill -9 or a graceful stop,
and a restart while jobs run and wait), and a supervisor killed makes it LOST with its GPUs free within
a second; names across hosts, timeouts, owners and admins. Real registry, servers, supervisors and
clients on loopback; only the GPUs are simulated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TALKER, cli_env, idle, open_gate, rpycdl_cli, running, seen_at, unavailable, wait_until

import rpycdl
from rpycdl import JobState
from rpycdl.cli.common import EXIT_JOB_TIMEOUT

CLIENT = """
import sys
import rpycdl
conn = rpycdl.connect(host="127.0.0.1", port=int(sys.argv[1]))
job = conn.root.submit_command([sys.executable, "-c", sys.argv[2]], name=sys.argv[3])
print(job.id, flush=True)
sys.stdin.read()  # until the test kills it
"""


def wait_state(job: rpycdl.Job, state: JobState, timeout: float = 10.0) -> rpycdl.JobStatus:
    return wait_until(lambda: (status := job.status()).state is state and status, timeout, f"job {job.id} {state}")


def test_submit_returns_at_once_and_the_job_runs_to_its_result(two, tmp_path):
    port, conn = two
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "lines": 3, "gate": gate, "value": {"ok": 1}},
                           name="first")
    assert job.name == "first" and len(job.id) == 12
    wait_state(job, JobState.RUNNING)
    # its log holds what it printed while it runs (the log is written as the output arrives, after RUNNING)
    wait_until(lambda: list(job.logs())[:3] == ["line 0\n", "line 1\n", "line 2\n"], 30, "three lines in its log")
    open_gate(gate)
    assert job.result(timeout=10) == {"ok": 1}
    status = job.status()
    assert status.state is JobState.SUCCEEDED and status.finished, status
    assert list(job.logs()) == ["line 0\n", "line 1\n", "line 2\n", "done\n"]
    row = job.refresh()
    assert row["detached"] and row["kind"] == "call" and row["started"] >= row["submitted"]
    assert row["ended"] >= row["started"] and row["log_bytes"] == len("line 0\nline 1\nline 2\ndone\n")
    assert row["result_bytes"] > 0 and row["gpu_uuids"]
    wait_until(lambda: idle(conn), 2, "the GPUs to be free")


def test_a_job_that_raises_re_raises_on_result(two, tmp_path):
    _, conn = two
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "raise": "bad lr"})
    with pytest.raises(ValueError, match="bad lr") as info:
        job.result(timeout=10)
    assert "talker" in info.value.remote_traceback
    row = job.refresh()
    assert (row["state"], row["error_type"], row["error"]) == ("FAILED", "ValueError", "bad lr")


def test_logs_follow_from_the_first_line_live_until_the_end(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "lines": 2, "gate": gate})
    lines = job.logs(follow=True)
    assert next(lines) == "line 0\n" and next(lines) == "line 1\n"
    started = time.monotonic()
    open_gate(gate)
    assert list(lines) == ["done\n"]  # then the generator ends with the job
    assert time.monotonic() - started < 5
    assert list(job.logs(tail=1)) == ["done\n"]


def test_a_job_is_found_again_by_id_and_by_name_from_another_process(two, tmp_path, cluster):
    port, conn = two
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": 42}, name="lr-1e-3")
    conn.close()
    script = ("import sys, rpycdl\n"
              "job = rpycdl.job(sys.argv[1], registry_address=sys.argv[2])\n"
              "print(job.id, job.name, job.status().state.value, flush=True)\n"
              "open(sys.argv[3], 'w').close()\n"
              "print(job.result(timeout=20))\n")
    for ref in ("lr-1e-3", job.id):
        done = subprocess.run([sys.executable, "-c", script, ref, cluster.registry_address, gate],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [job.id, "lr-1e-3", done.stdout.split()[2], "42"], done.stdout
    with pytest.raises(rpycdl.InvalidRequestError, match="no server knows job 'no-such-job'"):
        rpycdl.job("no-such-job", registry_address=cluster.registry_address)


def test_a_name_on_several_hosts_finds_the_unfinished_job_else_the_latest_and_refuses_two_unfinished(
        cluster, connect, tmp_path):
    hosts = [connect(cluster.add_server("pytorch", "fake:2")[1]),
             connect(cluster.add_server("pytorch", "fake:2", lock_dir=str(tmp_path / "host-b"))[1])]
    gate = str(tmp_path / "gate")
    where = {"registry_address": cluster.registry_address}
    waiting = {}
    for done, live in ((0, 1), (1, 0)):  # whichever host the registry lists first
        name = f"lr-{done}"
        assert hosts[done].root.submit(TALKER, {"dir": str(tmp_path)}, name=name).wait(10).finished
        waiting[name] = hosts[live].root.submit(TALKER, {"dir": str(tmp_path), "gate": gate}, name=name)
        assert rpycdl.job(name, **where).id == waiting[name].id  # the unfinished one, not the finished one
    for first, then in ((0, 1), (1, 0)):  # finished only: the latest
        name = f"done-{first}"
        older = hosts[first].root.submit(TALKER, {"dir": str(tmp_path), "value": "older"}, name=name)
        assert older.wait(10).finished
        newer = hosts[then].root.submit(TALKER, {"dir": str(tmp_path), "value": "newer"}, name=name)
        assert newer.wait(10).finished
        assert rpycdl.job(name, **where).result() == "newer"
        assert rpycdl.job(older.id, **where).result() == "older"  # an id is never ambiguous
    both = [host.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate}, name="both") for host in hosts]
    with pytest.raises(rpycdl.InvalidRequestError, match="unfinished jobs named 'both' on several hosts") as info:
        rpycdl.job("both", **where)
    assert all(f"{job.id} on {job.info['server']}" in str(info.value) for job in both), info.value
    assert "give the job's id" in str(info.value)
    flags = ["--registry", cluster.registry_address]
    refused = rpycdl_cli("logs", "both", *flags)  # the command line asks the same way
    assert refused.returncode == 2 and "on several hosts" in refused.stderr, refused.stderr
    cancelled = rpycdl_cli("cancel", "lr-0", *flags)
    assert cancelled.returncode == 0 and waiting["lr-0"].id in cancelled.stdout, cancelled.stdout + cancelled.stderr
    assert waiting["lr-0"].wait(10).state is JobState.CANCELLED
    open_gate(gate)
    assert all(job.wait(10).state is JobState.SUCCEEDED for job in (waiting["lr-1"], *both))


def test_names_are_unique_among_a_users_unfinished_jobs(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate}, name="sweep")
    with pytest.raises(rpycdl.InvalidRequestError, match=f"unfinished job named 'sweep' \\({first.id}"):
        conn.root.submit(TALKER, {"dir": str(tmp_path)}, name="sweep")
    for bad in ("", "12345", "a b", "x" * 65, 7):
        with pytest.raises(rpycdl.InvalidRequestError, match="not a job name"):
            conn.root.submit(TALKER, {"dir": str(tmp_path)}, name=bad)
    open_gate(gate)
    first.wait(10)
    again = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": 2}, name="sweep")  # a finished one frees it
    assert again.result(timeout=10) == 2
    assert conn.root.job("sweep").id == again.id  # the latest of that name


def test_a_submit_with_exists_return_or_replace_can_be_run_again(two, tmp_path):
    """A notebook cell that submits name="x" run twice: "return" gives back the same job (unfinished, then the
    one that ended) and submits nothing; "replace" cancels the unfinished one, then submits anew."""
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": 1}, name="cell", exists="return")
    again = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": 2}, name="cell", exists="return")
    assert again.id == first.id
    assert [row["job_id"] for row in conn.root.jobs(all=True)] == [first.id], "a second job was submitted"
    replaced = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": 3}, name="cell", exists="replace")
    assert replaced.id != first.id and first.status().state is JobState.CANCELLED
    assert replaced.result(timeout=10) == 3
    assert conn.root.submit(TALKER, {"dir": str(tmp_path)}, name="cell", exists="return").id == replaced.id
    fresh = conn.root.submit_command(["true"], name="cell", exists="replace")  # one that ended: nothing to cancel
    assert fresh.id != replaced.id and fresh.wait(10).state is JobState.SUCCEEDED
    with pytest.raises(rpycdl.InvalidRequestError, match="exists='return' needs name="):
        conn.root.submit(TALKER, {}, exists="return")
    with pytest.raises(rpycdl.InvalidRequestError, match="exists= takes 'error', 'return', 'replace', not 'keep'"):
        conn.root.submit(TALKER, {}, name="cell", exists="keep")
    assert len(conn.root.jobs(all=True)) == 3  # first, replaced, fresh: the bad requests submitted nothing


def test_concurrent_submits_with_exists_return_give_one_job(two, tmp_path):
    """Eight processes run the same cell at once: one job is submitted, and every one of them gets it."""
    port, conn = two
    gate = str(tmp_path / "gate")
    script = ("import sys, rpycdl\n"
              "from helpers import TALKER\n"
              "conn = rpycdl.connect(host='127.0.0.1', port=int(sys.argv[1]))\n"
              "print(conn.root.submit(TALKER, {'dir': sys.argv[2], 'gate': sys.argv[3]}, name='race', "
              "exists='return').id)\n")
    tests_dir = str(Path(__file__).parent)
    clients = [subprocess.Popen([sys.executable, "-c", script, str(port), str(tmp_path), gate], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env={**cli_env(), "PYTHONPATH": tests_dir})
               for _ in range(8)]
    ids = set()
    for client in clients:
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, err
        ids.add(out.strip())
    open_gate(gate)
    assert len(ids) == 1 and [row["job_id"] for row in conn.root.jobs(all=True)] == list(ids)


def test_bad_requests_get_clear_errors_and_change_nothing(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate})
    wait_state(job, JobState.RUNNING)
    with pytest.raises(rpycdl.JobNotFinishedError, match=f"job {job.id} is RUNNING"):
        job.result(wait=False)
    with pytest.raises(rpycdl.JobNotFinishedError):
        job.result(timeout=0.2)
    asked = time.monotonic()
    assert job.wait(0).state is JobState.RUNNING and time.monotonic() - asked < 5  # at once, not after 10 s
    with pytest.raises(rpycdl.InvalidRequestError, match="RUNNING: cancel it first"):
        job.delete()
    for ref in ("nope", "0123456789ab", "../etc", 5, None):
        with pytest.raises(rpycdl.InvalidRequestError):
            conn.root.job(ref)
    with pytest.raises(rpycdl.InvalidRequestError, match="asked for 3 GPUs but this server has 2"):
        conn.root.submit(TALKER, {}, ngpus=3)
    with pytest.raises(rpycdl.InvalidRequestError, match="timeout=-1: must be a positive number"):
        conn.root.submit(TALKER, {}, timeout=-1)
    with pytest.raises(rpycdl.InvalidRequestError, match="a command is a non-empty list of strings"):
        conn.root.submit_command([])
    assert job.status().state is JobState.RUNNING
    open_gate(gate)
    job.wait(10)
    job.delete()
    with pytest.raises(rpycdl.InvalidRequestError, match=f"no job '{job.id}'"):
        job.status()


def test_only_the_owner_reads_logs_and_result_cancels_and_deletes(two, tmp_path, connect):
    port, conn = two
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "lines": 1})
    other = connect(port)
    other.root.identify("mallory")
    theirs = other.root.job(job.id)  # anyone sees that it exists
    assert theirs.status().state in (JobState.PENDING, JobState.RUNNING)
    assert any(row["job_id"] == job.id for row in other.root.jobs())
    for attempt in (lambda: list(theirs.logs()), lambda: theirs.result(wait=False), theirs.cancel, theirs.delete):
        with pytest.raises(rpycdl.NotAllowedError, match="only its owner or an admin"):
            attempt()
    with pytest.raises(rpycdl.InvalidRequestError):  # a name is looked up among the caller's own jobs
        other.root.job(job.name or "unnamed")
    open_gate(gate)
    assert job.result(timeout=10) is None


def test_cancel_of_a_waiting_and_a_running_job(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    holder = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate}, ngpus=2)
    waiting = conn.root.submit(TALKER, {"dir": str(tmp_path)}, ngpus=1)
    wait_state(holder, JobState.RUNNING)
    status = wait_state(waiting, JobState.PENDING)
    assert status.ahead == 1 and str(status) == "PENDING (behind 1 running job and 0 queued requests)"
    assert {(holder["job_id"], holder["gpu"]) for holder in status.holders} == {(holder.id, 0), (holder.id, 1)}
    assert waiting.cancel().state is JobState.CANCELLED  # the state after the cancel
    with pytest.raises(rpycdl.JobCancelledError):
        waiting.result()
    assert holder.cancel().state is JobState.CANCELLED
    wait_until(lambda: idle(conn), 1, "the GPUs to be free after the cancel")
    assert holder.cancel().state is JobState.CANCELLED  # a finished job stays as it ended


@pytest.mark.parametrize("when", ["pending", "running"])
def test_the_job_outlives_its_client_killed(when, cluster, connect, tmp_path):
    port = cluster.add_server("pytorch", "fake:1")[1]
    conn = connect(port)
    gate = str(tmp_path / "gate")
    if when == "pending":
        wait_state(conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate}), JobState.RUNNING)  # holds the GPU
    code = (f"import os, time\nprint('hello from the job', flush=True)\n"
            f"while not os.path.exists({gate!r}): time.sleep(0.01)\nprint('through the gate')")
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), code, f"walk-away-{when}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    job = conn.root.job(client.stdout.readline().strip())
    state = JobState(when.upper())
    wait_state(job, state)
    client.kill()
    client.wait()
    time.sleep(0.5)  # a sweep or two
    assert job.status().state is state, job.info
    open_gate(gate)
    assert job.wait(20).state is JobState.SUCCEEDED, job.info
    assert job.result() == 0
    assert list(job.logs()) == ["hello from the job\n", "through the gate\n"]


@pytest.mark.parametrize("end", ["kill-9", "stop"])
def test_the_jobs_outlive_their_server_ended_and_a_restarted_server_serves_them(end, cluster, connect, tmp_path):
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "lines": 2, "value": "first"})
    second = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "second"})
    third = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "third"})
    wait_state(first, JobState.RUNNING)
    assert second.status().ahead == 1 and third.status().ahead == 2  # behind the running first, and second
    if end == "stop":  # SIGTERM: a graceful stop, as an upgrade does
        process.stop()
        assert process.popen.returncode == 0, process.lines[-5:]
    else:
        process.popen.send_signal(signal.SIGKILL)
        process.popen.wait()
    time.sleep(0.5)
    assert running(first.info["owner_pid"]), "the supervisor died with the server"
    port = cluster.add_server("pytorch", "fake:1")[1]
    again = connect(port)
    jobs = {row["job_id"]: row["state"] for row in again.root.jobs()}
    assert (jobs[first.id], jobs[second.id], jobs[third.id]) == ("RUNNING", "PENDING", "PENDING")
    first, second, third = (again.root.job(job.id) for job in (first, second, third))
    lines = first.logs(follow=True)
    assert next(lines) == "line 0\n"
    assert third.cancel().state is JobState.CANCELLED  # cancelled through the new server
    open_gate(gate)
    assert list(lines) == ["line 1\n", "done\n"]
    assert (first.result(timeout=10), second.result(timeout=10)) == ("first", "second")
    assert third.wait(5).state is JobState.CANCELLED


@pytest.mark.parametrize("left", [False, True], ids=["alone", "with-a-child-left-running"])
def test_a_killed_supervisor_makes_the_job_lost_and_frees_its_gpus_within_a_second(left, two, tmp_path, cluster):
    _, conn = two
    if left:  # the job process dies with its supervisor; what it started must be killed by a sweep
        job = conn.root.submit_command(["sh", "-c", "sleep 600 & echo $!; wait"], ngpus=2)
        wait_state(job, JobState.RUNNING)
        child = int(wait_until(lambda: "".join(job.logs()).strip(), 5, "the child's pid"))
    else:
        job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": str(tmp_path / "gate")}, ngpus=2)
        wait_state(job, JobState.RUNNING)
        child = None
    supervisor = job.refresh()["owner_pid"]
    job_process = job.info["pgid"]
    os.kill(supervisor, signal.SIGKILL)
    killed = time.monotonic()
    freed = seen_at(lambda: idle(conn), 1.0, "the GPUs to be free after the supervisor died", time.monotonic)
    assert freed - killed < 1.0  # promise 3
    assert not running(job_process) and not (child and running(child))  # and not before the job is gone
    assert wait_state(job, JobState.LOST, 2).error.startswith(f"its supervisor (pid {supervisor}) died")
    with pytest.raises(rpycdl.JobLostError):
        job.result()
    listed = rpycdl_cli("jobs", "--registry", cluster.registry_address)
    assert any(job.id in line and "LOST" in line and "its supervisor" in line for line in listed.stdout.splitlines())


def test_a_detached_job_past_its_timeout_ends_timed_out_and_rpycdl_wait_exits_124(two, tmp_path, cluster):
    _, conn = two
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": str(tmp_path / "never"), "lines": 1}, timeout=2,
                           name="too-long")
    wait_state(job, JobState.RUNNING)
    waiting = subprocess.Popen([sys.executable, "-m", "rpycdl", "wait", "too-long", "--registry",
                                cluster.registry_address], stderr=subprocess.PIPE, text=True, env=cli_env())
    assert waiting.wait(30) == EXIT_JOB_TIMEOUT, waiting.stderr.read()
    assert f"job {job.id}: TIMED_OUT" in waiting.stderr.read()
    row = job.refresh()
    assert row["state"] == "TIMED_OUT" and 2 <= (row["ended"] - row["started"]).total_seconds() < 10, row
    with pytest.raises(rpycdl.JobTimeoutError):
        job.result()
    assert list(job.logs()) == ["line 0\n"]
    wait_until(lambda: idle(conn), 1, "the GPUs to be free after the timeout")


def test_an_admin_reads_cancels_and_deletes_another_users_detached_job_and_another_user_cannot(tls_server, tmp_path):
    alice, bob, admin = (tls_server(user) for user in ("alice", "bob", "root"))
    done = alice.root.submit(TALKER, {"dir": str(tmp_path), "lines": 2, "value": "alice's"}, name="mine")
    assert done.wait(10).state is JobState.SUCCEEDED
    live = alice.root.submit(TALKER, {"dir": str(tmp_path), "gate": str(tmp_path / "never")})
    wait_state(live, JobState.RUNNING)
    for job in (done, live):
        theirs = bob.root.job(job.id)  # anyone sees that it exists
        for attempt in (lambda theirs=theirs: list(theirs.logs()), lambda theirs=theirs: theirs.result(wait=False),
                        theirs.cancel, theirs.delete):
            with pytest.raises(rpycdl.NotAllowedError, match=f"job {job.id} belongs to alice and you are bob"):
                attempt()
    with pytest.raises(rpycdl.InvalidRequestError, match="no job 'mine'"):  # a name is the owner's
        bob.root.job("mine")
    assert live.status().state is JobState.RUNNING
    as_admin = admin.root.job(done.id)
    assert list(as_admin.logs()) == ["line 0\n", "line 1\n", "done\n"]
    assert as_admin.result() == "alice's"
    assert admin.root.job(live.id).cancel().state is JobState.CANCELLED
    assert live.wait(10).state is JobState.CANCELLED
    as_admin.delete()
    with pytest.raises(rpycdl.InvalidRequestError, match="no job"):
        done.status()


def test_attached_jobs_are_rows_of_the_ledger_too(two, tmp_path):
    _, conn = two
    assert conn.root.run_code(TALKER, {"dir": str(tmp_path), "value": 5}) == 5
    (row,) = [row for row in conn.root.jobs() if not row["detached"]]
    assert (row["state"], row["kind"], row["service"]) == ("SUCCEEDED", "call", "pytorch")


def test_a_command_fails_unless_it_exits_0_and_its_result_is_its_exit_code(two):
    _, conn = two
    job = conn.root.submit_command([sys.executable, "-c", "print('out'); raise SystemExit(3)"])
    assert job.wait(10).state is JobState.FAILED
    assert job.result() == 3 and job.info["exit_code"] == 3 and "exited with code 3" in job.info["error"]
    assert list(job.logs()) == ["out\n"]
    fine = conn.root.submit_command(["true"])
    assert fine.wait(10).state is JobState.SUCCEEDED and fine.result() == 0


def test_server_refuses_to_start_over_a_missing_or_corrupted_ledger(cluster, connect, lock_dir):
    state = Path(lock_dir) / "state"
    port = cluster.add_server("pytorch", "fake:1")[1]  # creates the ledger
    assert connect(port).root.submit_command(["true"]).wait(10).state is JobState.SUCCEEDED  # a history
    cluster.close()
    ledger = state / "ledger.sqlite3"
    assert ledger.exists()
    for damage in ("corrupt", "missing"):
        if damage == "corrupt":
            ledger.write_bytes(b"not a database at all" * 100)
        else:
            ledger.unlink()
            for extra in state.glob("ledger.sqlite3-*"):
                extra.unlink()
        started = subprocess.run([sys.executable, "-m", "rpycdl", "serve", "--service", "pytorch", "--gpus", "fake:1",
                                  "--port", "0", "--registry", "none", "--lock-dir", lock_dir],
                                 capture_output=True, text=True, timeout=30)
        assert started.returncode == 1, started.stdout
        assert str(ledger) in started.stderr and damage in started.stderr, started.stderr
        assert len(started.stderr.strip().splitlines()) == 1, started.stderr


def test_a_log_over_its_limit_ends_with_a_marker_and_a_result_over_its_limit_fails(cluster, connect, tmp_path):
    port = cluster.add_server("pytorch", "fake:1", "--max-log", "1KiB", "--max-result", "64KiB")[1]
    conn = connect(port)
    chatty = conn.root.submit_command([sys.executable, "-c", "for i in range(1000): print('x' * 20)"])
    assert chatty.wait(10).state is JobState.SUCCEEDED
    text = "".join(chatty.logs())
    assert text.startswith("x" * 20) and "reached its limit of 1 KiB (--max-log)" in text
    assert len(text) < 1024 + 200
    big = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": b"y" * 100_000})
    assert big.wait(10).state is JobState.FAILED
    with pytest.raises(rpycdl.LimitError, match="over this server's limit of 65536 bytes \\(--max-result\\)"):
        big.result()


def test_a_full_disk_fails_the_job_clearly_and_leaves_no_half_written_result(cluster, connect, tmp_path):
    if os.geteuid() != 0:
        unavailable("mounting a small tmpfs as the state directory needs root", "run this test as root")
    state = tmp_path / "small-state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(state)], check=True)
    try:
        port = cluster.add_server("pytorch", "fake:1", "--state-dir", str(state))[1]
        conn = connect(port)
        flood = conn.root.submit_command([sys.executable, "-c", "import sys\nfor i in range(100000): print('z' * 99)"])
        assert flood.wait(20).state is JobState.FAILED
        assert "No space left on device" in flood.info["error"] and "log" in flood.info["error"]
        flood.delete()
        big = conn.root.submit(bytes, 4 * 1024 * 1024)  # made on the server: 4 MiB for a 2 MiB disk
        assert big.wait(20).state is JobState.FAILED
        assert "could not be stored" in big.info["error"] and "No space left" in big.info["error"]
        assert not list(state.glob(f"jobs/{big.id}/*result*"))
    finally:
        cluster.close()
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_finished_jobs_past_their_retention_are_removed_with_their_files(cluster, connect, lock_dir):
    port = cluster.add_server("pytorch", "fake:1", "--keep", "1s")[1]
    conn = connect(port)
    job = conn.root.submit_command(["echo", "kept for a second"])
    assert job.wait(10).state is JobState.SUCCEEDED
    folder = Path(lock_dir) / "state" / "jobs" / job.id
    assert folder.is_dir()
    wait_until(lambda: not folder.exists(), 5, "the job's files to be removed")
    with pytest.raises(rpycdl.InvalidRequestError, match="no job"):
        job.status()


def test_the_detached_example_submits_walks_away_and_comes_back(cluster):
    cluster.add_server("pytorch", "fake:1")
    script = Path(__file__).parent.parent / "clients" / "detached.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RPYCDL_REGISTRY": cluster.registry_address})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("submitted job") and "epoch 1/5" in done.stdout and "epoch 5/5" in done.stdout
    assert lines[-1].startswith("SUCCEEDED; it returned {'loss': 0.168")
