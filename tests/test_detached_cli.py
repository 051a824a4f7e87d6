"""The detached-job verbs of the `rpycdl` command end to end, each in a subprocess against a real registry
and server: submit with a name and a share, jobs and its filters, logs (-f, --tail), result (printed,
saved, --no-wait), delete. Only the GPUs are simulated."""

from __future__ import annotations

import contextlib
import getpass
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import dill
import pytest
from helpers import TALKER, cli_env, open_gate, rpycdl_cli, wait_until

import rpycdl
from rpycdl import JobState
from rpycdl.cli.common import EXIT_QUEUE_TIMEOUT, EXIT_USAGE

DAY = 24 * 3600.0


@pytest.fixture
def host(cluster, connect) -> tuple[list[str], rpycdl.Connection]:
    """A fake:2 server: the flags that find it through the registry, and a connection to it."""
    port = cluster.add_server("pytorch", "fake:2")[1]
    return ["--registry", cluster.registry_address], connect(port)


def running(job: rpycdl.Job) -> None:
    wait_until(lambda: job.status().state is JobState.RUNNING, 10, f"job {job.id} to run")


def age(lock_dir: str, job_id: str, seconds: float) -> None:
    """Move a finished job's times `seconds` back, in its host's ledger file."""
    with contextlib.closing(sqlite3.connect(Path(lock_dir) / "state" / "ledger.sqlite3")) as db, db:
        db.execute("UPDATE jobs SET submitted = submitted - ?, started = started - ?, ended = ended - ? "
                   "WHERE job_id = ?", (seconds, seconds, seconds, job_id))


def listed(flags: list[str], *args: str) -> list[str]:
    """The ids `rpycdl jobs --json ARGS` prints, newest first."""
    shown = rpycdl_cli("jobs", "--json", *args, *flags)
    assert shown.returncode == 0, shown.stderr
    return [row["job_id"] for row in json.loads(shown.stdout)]


def test_jobs_lists_the_recent_ones_or_all_by_user_state_and_since(host, lock_dir, connect, tmp_path):
    flags, conn = host
    bobs = connect(conn.address[1])
    bobs.root.identify("bob")
    ended = {name: conn.root.submit_command(["true"], name=name) for name in ("three-days", "yesterday")}
    ended["today"] = conn.root.submit_command(["false"], name="today")
    ended["bob"] = bobs.root.submit_command(["true"], name="bobs")
    assert all(job.wait(10).finished for job in ended.values())
    age(lock_dir, ended["three-days"].id, 3 * DAY)
    age(lock_dir, ended["yesterday"].id, 1.5 * DAY)  # submitted within two days, ended more than one ago
    gate = str(tmp_path / "gate")
    live = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate}, name="live")
    running(live)
    ids = {name: job.id for name, job in {**ended, "live": live}.items()}

    assert listed(flags) == [ids["live"], ids["bob"], ids["today"]]  # unfinished, or ended in the last day
    assert listed(flags, "--since", "2d") == [ids["live"], ids["bob"], ids["today"], ids["yesterday"]]
    assert listed(flags, "--since", "2d", "--state", "SUCCEEDED") == [ids["bob"], ids["yesterday"]]
    assert listed(flags, "--since", "1h") == [ids["live"], ids["bob"], ids["today"]]
    everything = [ids[name] for name in ("live", "bob", "today", "yesterday", "three-days")]
    assert listed(flags, "--all") == everything
    assert listed(flags, "--all", "--limit", "2") == everything[:2]
    assert listed(flags, "--all", "--user", "bob") == [ids["bob"]]
    assert listed(flags, "--all", "--user", getpass.getuser(), "--state", "failed", "--state", "RUNNING") == [
        ids["live"], ids["today"]]
    rows = json.loads(rpycdl_cli("jobs", "--json", "--all", *flags).stdout)
    assert [(row.get("name"), row["state"], row["user"]) for row in rows] == [  # bob's job's name is his
        ("live", "RUNNING", getpass.getuser()), (None, "SUCCEEDED", "bob"), ("today", "FAILED", getpass.getuser()),
        ("yesterday", "SUCCEEDED", getpass.getuser()), ("three-days", "SUCCEEDED", getpass.getuser())]
    table = rpycdl_cli("jobs", "--all", *flags)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:4] == ["ID", "NAME", "STATE", "USER"]
    assert [line.split()[:3] for line in table.stdout.splitlines()[1:]] == [
        [row["job_id"], row.get("name", "-"), row["state"]] for row in rows]
    bad = rpycdl_cli("jobs", "--state", "SLEEPING", *flags)
    assert bad.returncode == EXIT_USAGE and "invalid choice: 'SLEEPING'" in bad.stderr
    open_gate(gate)
    assert live.wait(10).state is JobState.SUCCEEDED


def test_submit_with_a_name_and_a_share_then_logs_follow_to_the_end_and_tail(host, tmp_path):
    flags, conn = host
    gate = str(tmp_path / "gate")
    script = (f"import os, time\nfor i in range(3): print('line', i, flush=True)\n"
              f"while not os.path.exists({gate!r}): time.sleep(0.01)\nprint('line 3')\nprint('done')")
    submitted = rpycdl_cli("submit", "pytorch", "--name", "follow-me", "--gpu-memory", "1GiB", *flags, "--",
                           sys.executable, "-c", script)
    assert submitted.returncode == 0, submitted.stderr
    shown = re.fullmatch(rf"job ([0-9a-f]{{12}}) \(follow-me\) submitted to pytorch on 127\.0\.0\.1:{conn.address[1]}: "
                         r"(PENDING \(behind \d running jobs? and 0 queued requests\)|RUNNING)\n", submitted.stdout)
    assert shown, submitted.stdout
    job = conn.root.job("follow-me")
    assert job.id == shown.group(1) and job.name == "follow-me"
    assert (job.info["ngpus"], job.info["share_bytes"], job.info["kind"]) == (1, 1024**3, "command")
    followed = tmp_path / "followed"
    with open(followed, "w") as out:
        follow = subprocess.Popen([sys.executable, "-m", "rpycdl", "logs", "follow-me", "-f", *flags], stdout=out,
                                  stderr=subprocess.PIPE, text=True, env=cli_env())
        try:
            wait_until(lambda: followed.read_text() == "line 0\nline 1\nline 2\n", 10, "the first lines")
            assert follow.poll() is None, "logs -f ended while the job runs"
            open_gate(gate)
            assert follow.wait(20) == 0, follow.stderr.read()
        finally:
            follow.kill()
            follow.wait()
    assert followed.read_text() == "line 0\nline 1\nline 2\nline 3\ndone\n"
    assert job.status().state is JobState.SUCCEEDED
    for tail, expected in (("2", "line 3\ndone\n"), ("0", ""), ("9", followed.read_text())):
        tailed = rpycdl_cli("logs", job.id, "--tail", tail, *flags)
        assert (tailed.returncode, tailed.stdout) == (0, expected), tailed.stderr
    negative = rpycdl_cli("logs", job.id, "--tail", "-1", *flags)
    assert negative.returncode == EXIT_USAGE and "--tail takes a number of lines" in negative.stderr
    quiet = rpycdl_cli("submit", "pytorch", "-q", *flags, "--", "true")
    assert quiet.returncode == 0 and re.fullmatch(r"[0-9a-f]{12}\n", quiet.stdout), quiet.stdout


def test_submit_exists_return_prints_the_same_job_and_logs_follow_exits_with_the_jobs_code(host, tmp_path):
    flags, conn = host
    gate = str(tmp_path / "gate")
    script = f"import os, sys, time\nwhile not os.path.exists({gate!r}): time.sleep(0.01)\nprint('bye')\nsys.exit(3)"
    ids = []
    for _ in range(2):  # the same command, run again
        submitted = rpycdl_cli("submit", "pytorch", "--name", "again", "--exists", "return", "-q", *flags, "--",
                               sys.executable, "-c", script)
        assert submitted.returncode == 0, submitted.stderr
        ids.append(submitted.stdout.strip())
    assert ids[0] == ids[1] and len(conn.root.jobs(all=True)) == 1
    open_gate(gate)
    followed = rpycdl_cli("logs", "again", "-f", *flags)
    assert (followed.returncode, followed.stdout) == (3, "bye\n"), followed.stderr
    assert rpycdl_cli("logs", "again", *flags).returncode == 0  # without -f: the log, printed whole
    refused = rpycdl_cli("submit", "pytorch", "--name", "again", "--exists", "maybe", *flags, "--", "true")
    assert refused.returncode == EXIT_USAGE and "invalid choice: 'maybe'" in refused.stderr


def test_result_prints_or_saves_the_value_and_without_waiting_says_the_job_has_not_ended(host, tmp_path):
    flags, conn = host
    gate = str(tmp_path / "gate")
    late = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "at last"}, name="late")
    running(late)
    early = rpycdl_cli("result", "late", "--no-wait", *flags)
    assert early.returncode == EXIT_QUEUE_TIMEOUT, early.stderr
    assert f"job {late.id} is RUNNING: it has not ended yet: wait for it with rpycdl wait {late.id}" in early.stderr
    assert early.stdout == ""
    values = {"dict": {"loss": 0.25, "epochs": [1, 2]}, "bytes": b"\x00raw\xff", "str": "text\n"}
    jobs = {kind: conn.root.submit(TALKER, {"dir": str(tmp_path), "value": value}, name=f"value-{kind}")
            for kind, value in values.items()}
    assert all(job.wait(10).state is JobState.SUCCEEDED for job in jobs.values())
    printed = rpycdl_cli("result", "value-dict", *flags)
    assert (printed.returncode, printed.stdout) == (0, "{'loss': 0.25, 'epochs': [1, 2]}\n"), printed.stderr
    raw = subprocess.run([sys.executable, "-m", "rpycdl", "result", jobs["bytes"].id, *flags], capture_output=True,
                         timeout=30, env=cli_env())
    assert (raw.returncode, raw.stdout) == (0, b"\x00raw\xff"), raw.stderr
    for kind, value in values.items():
        saved = tmp_path / f"value.{kind}"
        done = rpycdl_cli("result", f"value-{kind}", "-o", str(saved), *flags)
        assert done.returncode == 0 and done.stdout == "", done.stderr
        assert f"job {jobs[kind].id}'s value ({kind}, " in done.stderr and f"saved to {saved}" in done.stderr
        data = saved.read_bytes()
        assert (dill.loads(data) if kind == "dict" else data) == (value.encode() if kind == "str" else value)
    failed = conn.root.submit(TALKER, {"dir": str(tmp_path), "raise": "diverged"})
    raised = rpycdl_cli("result", failed.id, *flags)
    assert raised.returncode == 1 and raised.stdout == "", raised.stdout
    assert "talker" in raised.stderr  # the remote traceback, then one line
    assert raised.stderr.splitlines()[-1] == f"rpycdl result: job {failed.id} raised ValueError: diverged"
    waiting = subprocess.Popen([sys.executable, "-m", "rpycdl", "result", "late", *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=cli_env())
    open_gate(gate)  # result waits for the job to end, then prints its value
    out, err = waiting.communicate(timeout=30)
    assert (waiting.returncode, out) == (0, "at last\n"), err


def test_delete_removes_a_finished_jobs_record_log_and_result_and_refuses_a_running_job(host, lock_dir, tmp_path):
    flags, conn = host
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "lines": 1, "value": 1}, name="scratch")
    running(job)
    refused = rpycdl_cli("delete", "scratch", *flags)
    assert refused.returncode == EXIT_USAGE and f"job {job.id} is RUNNING: cancel it first" in refused.stderr
    assert job.status().state is JobState.RUNNING
    open_gate(gate)
    assert job.wait(10).state is JobState.SUCCEEDED
    files = Path(lock_dir) / "state" / "jobs" / job.id
    assert (files / "result").exists()
    deleted = rpycdl_cli("delete", "scratch", *flags)
    assert (deleted.returncode, deleted.stdout) == (0, f"job {job.id} deleted: its record, log and result\n")
    assert not files.exists() and job.id not in listed(flags, "--all")
    for verb in ("logs", "result", "delete"):
        gone = rpycdl_cli(verb, job.id, *flags)
        assert gone.returncode == EXIT_USAGE and f"no server knows job '{job.id}'" in gone.stderr, gone.stderr
