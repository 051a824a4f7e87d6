"""The detached-job verbs of the `rpycdl` command end to end, each in a subprocess against a real registry
and server: jobs and its filters. Only the GPUs are simulated."""

from __future__ import annotations

import contextlib
import getpass
import json
import sqlite3
from pathlib import Path

import pytest
from helpers import TALKER, open_gate, rpycdl_cli, wait_until

import rpycdl
from rpycdl import JobState
from rpycdl.cli.common import EXIT_USAGE

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
    assert [(row["name"], row["state"], row["user"]) for row in rows] == [
        ("live", "RUNNING", getpass.getuser()), ("bobs", "SUCCEEDED", "bob"), ("today", "FAILED", getpass.getuser()),
        ("yesterday", "SUCCEEDED", getpass.getuser()), ("three-days", "SUCCEEDED", getpass.getuser())]
    table = rpycdl_cli("jobs", "--all", *flags)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:4] == ["ID", "NAME", "STATE", "USER"]
    assert [line.split()[:3] for line in table.stdout.splitlines()[1:]] == [
        [row["job_id"], row["name"], row["state"]] for row in rows]
    bad = rpycdl_cli("jobs", "--state", "SLEEPING", *flags)
    assert bad.returncode == EXIT_USAGE and "invalid choice: 'SLEEPING'" in bad.stderr
    open_gate(gate)
    assert live.wait(10).state is JobState.SUCCEEDED
