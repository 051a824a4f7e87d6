"""Priorities with real servers and clients (`priority=`, `--priority`, the limits file's ceiling): a later job of a
higher priority goes before the jobs of priority 0 that wait on a busy GPU (by the ledger's start times), says its
priority in job.status() and `rpycdl jobs --long`; a priority above its owner's ceiling, or no priority at all, is
refused by name on every kind of request; and the order survives kill -9 of the server and its restart."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import cli_env, gate_job, open_gate, rpycdl_cli, server_process, wait_until

from rpycdl import JobState
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler.ledger import Ledger

CEILINGS = "[users.alice]\npriority = 5\n"


def _limits(tmp_path: Path) -> str:
    path = tmp_path / "limits.toml"
    path.write_text(CEILINGS)
    return str(path)


def _as(connect, port: int, user: str):
    conn = connect(port)
    conn.root.identify(user)
    return conn


def _queue_behind_a_busy_gpu(conn, gate: str):
    """A job holding the one GPU until `gate` opens, three jobs of priority 0 behind it, then one of priority 5."""
    holder = conn.root.submit(gate_job(gate), "holder")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 60, "the first job to hold the GPU")
    plain = [conn.root.submit(gate_job(gate), f"plain {index}") for index in range(3)]
    urgent = conn.root.submit(gate_job(gate), "urgent", priority=5)
    return holder, plain, urgent


def _started_first(lock_dir: str, urgent, plain) -> None:
    ledger = Ledger(os.path.join(lock_dir, "state"))
    rows = {job.id: ledger.get(job.id) for job in [urgent, *plain]}
    assert all(row.state is JobState.SUCCEEDED for row in rows.values()), rows
    starts = sorted(rows, key=lambda job_id: rows[job_id].started)
    assert starts == [urgent.id, *(job.id for job in plain)], {job_id: rows[job_id].started for job_id in starts}
    assert rows[urgent.id].priority == 5 and {rows[job.id].priority for job in plain} == {0}


def test_a_later_job_of_a_higher_priority_runs_before_the_waiting_ones_and_says_its_priority(server, connect,
                                                                                              tmp_path, lock_dir):
    port = server("pytorch", "fake:1", "--limits", _limits(tmp_path))
    alice = _as(connect, port, "alice")
    gate = str(tmp_path / "gate")
    _, plain, urgent = _queue_behind_a_busy_gpu(alice, gate)
    status = urgent.status()
    assert status.state is JobState.PENDING and status.priority == 5 and "priority 5" in str(status), status
    listing = rpycdl_cli("jobs", "--long", "--host", "127.0.0.1", "--port", str(port),
                         env=cli_env(USER="alice", LOGNAME="alice"))
    row = next(line for line in listing.stdout.splitlines() if line.startswith(urgent.id))
    assert "PRIO" in listing.stdout.splitlines()[0] and " 5 " in row, listing.stdout
    open_gate(gate)
    assert [job.result(120) for job in [urgent, *plain]] == ["urgent", "plain 0", "plain 1", "plain 2"]
    _started_first(lock_dir, urgent, plain)


def test_a_priority_above_the_ceiling_or_not_a_priority_is_refused_on_every_kind_of_request(server, connect,
                                                                                             tmp_path):
    port = server("pytorch", "fake:2", "--limits", _limits(tmp_path))
    alice, bob = _as(connect, port, "alice"), _as(connect, port, "bob")
    with pytest.raises(LimitError, match=r"priority=6: alice .*may ask at most 5 \(users.alice.priority\)"):
        alice.root.submit(lambda x: x, 1, priority=6)
    with pytest.raises(LimitError, match=r"priority=1: bob .*may ask at most 0 \(the default"):
        bob.root.run_code(lambda x: x, 1, priority=1)
    with pytest.raises(LimitError, match="may ask at most 5"), alice.root.session(priority=7) as session:
        session.run(lambda x: x, 1)
    with pytest.raises(LimitError, match="may ask at most 5"):
        alice.root.submit_command_array([["true"], ["true"]], priority=9)
    for bad in (True, 11, -11, 2.5, "3"):
        with pytest.raises(InvalidRequestError, match="must be a whole number from -10 to 10"):
            alice.root.submit(lambda x: x, 1, priority=bad)
    refused = rpycdl_cli("submit", "pytorch", "--host", "127.0.0.1", "--port", str(port), "--priority", "4", "--",
                         "true", env=cli_env(USER="bob", LOGNAME="bob"))
    assert refused.returncode != 0 and "bob" in refused.stderr and "at most 0" in refused.stderr, refused.stderr
    array = alice.root.submit_array(lambda x: x, [1, 2], priority=5)  # within her ceiling: every element's
    assert array.results(timeout=120) == [1, 2]
    assert {alice.root.job(job_id).status().priority for job_id in array.info["job_ids"]} == {5}
    assert alice.root.run_code(lambda x: x + 1, 1, priority=-3) == 2  # below 0: anyone
    with alice.root.session(priority=5) as session:
        assert session.run(lambda x: x * 2, 4) == 8


def test_the_order_survives_kill_9_of_the_server_and_its_restart(cluster, server, connect, tmp_path, lock_dir):
    limits = _limits(tmp_path)
    port = server("pytorch", "fake:1", "--limits", limits)
    gate = str(tmp_path / "gate")
    _, plain, urgent = _queue_behind_a_busy_gpu(_as(connect, port, "alice"), gate)
    process = server_process(cluster, port)
    process.popen.kill()
    process.popen.wait(30)
    port = server("pytorch", "fake:1", "--limits", limits)
    again = _as(connect, port, "alice").root
    assert again.job(urgent.id).status().state is JobState.PENDING
    open_gate(gate)
    assert [again.job(job.id).result(120) for job in [urgent, *plain]] == ["urgent", "plain 0", "plain 1", "plain 2"]
    _started_first(lock_dir, urgent, plain)
