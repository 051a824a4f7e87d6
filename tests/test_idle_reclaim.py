"""Idle GPUs reclaimed (rpycdl serve --idle-reclaim) with real servers on a fake NVML driver
(tests/fake_nvml_driver.py), whose GPU utilization the test sets: an idle session is warned, then ended with its
reason, and its GPU goes to a waiting job; an idle attached call likewise; a busy job is never reclaimed;
idle_reclaim=False keeps a GPU within the user's keep_idle allowance and is refused above it; a detached job with
retries is requeued and its attempt counts; the reclaim goes on through kill -9 of the server and its restart,
and the ledger and Prometheus count it."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from helpers import cli_env, rpycdl_cli, scrape, server_process, wait_until

from rpycdl import JobState
from rpycdl.errors import IdleReclaimedError, LimitError
from rpycdl.scheduler.ledger import Ledger
from rpycdl.units import GiB

UUID = "GPU-a1000000-0000-0000-0000-000000000000"
RECLAIM = "2s"  # small for tests; every bound below is generous (a slow, busy machine)


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """The fake NVML driver of the servers started after it, with one GPU; driver(percent) sets its utilization."""
    state = tmp_path / "driver.json"

    def set_utilization(percent: int) -> None:
        state.write_text(json.dumps([{"uuid": UUID, "total": 16 * GiB, "utilization": percent,
                                      "bus_id": "00000000:07:00.0"}]))

    set_utilization(0)
    monkeypatch.setenv("RPYCDL_NVML_MODULE", "fake_nvml_driver")
    monkeypatch.setenv("FAKE_NVML_STATE", str(state))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    return set_utilization


def _reclaiming(server, *extra: str) -> int:
    return server("pytorch", "nvml", "--idle-reclaim", RECLAIM, *extra)


def _limits(tmp_path: Path, text: str) -> str:
    path = tmp_path / "limits.toml"
    path.write_text(text)
    return str(path)


def _waiting_job(connect, port: int):
    """A detached job of another user that waits for the one GPU, and returns at once once it has it."""
    conn = connect(port)
    conn.root.identify("bob")
    return conn.root.submit(lambda x: x, "bob's")


def _idle_once(_):
    """A job idle on its GPU in its first attempt; its second returns its number at once."""
    import rpycdl

    if rpycdl.attempt() == 1:
        time.sleep(120)
    return rpycdl.attempt()


def _idle_for(seconds):
    """A job idle on its GPU for `seconds`."""
    time.sleep(seconds)
    return seconds


def _row(lock_dir: str, job_id: str):
    return Ledger(os.path.join(lock_dir, "state")).get(job_id)


def test_an_idle_session_is_warned_then_ended_and_its_gpu_goes_to_a_waiting_job(driver, server, connect, lock_dir,
                                                                                 monitor):
    driver(50)  # busy while the session opens and runs its first call, however slow the machine
    port = _reclaiming(server)
    conn = connect(port)
    conn.root.identify("alice")
    err = io.StringIO()
    session = conn.root.session().open()
    assert session.run(lambda x: x + 1, 1, stderr=err) == 2
    job = _waiting_job(connect, port)
    driver(0)  # now its user thinks: the GPU is idle
    assert job.result(60) == "bob's"  # the session's GPU went to it
    with pytest.raises(IdleReclaimedError, match="--idle-reclaim") as caught:
        session.run(lambda x: x, 0)
    assert "idle_reclaim=False" in str(caught.value)
    warning = err.getvalue()  # it came first, sent between calls, read by the client at its next call
    assert "it will be ended unless they are used" in warning and "idle_reclaim=False" in warning, warning
    row = _row(lock_dir, session.id)
    assert row.state is JobState.FAILED and row.error_type == "IdleReclaimedError", row
    assert "showed no utilization" in row.error
    assert row.ended <= _row(lock_dir, job.id).started
    wait_until(lambda: any(number == 1 for _, number in scrape(monitor).get("rpycdl_idle_reclaims_total", [])), 20,
               "the monitor to count the reclaim")


def test_an_idle_attached_call_is_warned_on_its_stderr_then_ended(driver, server, connect):
    port = _reclaiming(server)
    conn = connect(port)
    err = io.StringIO()

    def waits_on_its_user(_):
        time.sleep(120)

    started = time.monotonic()
    with pytest.raises(IdleReclaimedError, match="showed no utilization") as caught:
        conn.root.run_code(waits_on_its_user, None, stderr=err)
    assert time.monotonic() - started < 90
    assert "this server reclaims GPUs idle for 2s (--idle-reclaim)" in err.getvalue()
    assert "idle_reclaim=False" in str(caught.value)


def test_a_busy_job_is_never_reclaimed(driver, server, connect):
    driver(40)
    port = _reclaiming(server)
    err = io.StringIO()

    def computes(_):
        time.sleep(8)  # four times --idle-reclaim, its GPU busy throughout
        return "done"

    assert connect(port).root.run_code(computes, None, stderr=err) == "done"
    assert "--idle-reclaim" not in err.getvalue()


def test_idle_reclaim_false_keeps_the_gpu_within_the_allowance_and_is_refused_above_it(driver, server, connect,
                                                                                        tmp_path):
    port = _reclaiming(server, "--limits", _limits(tmp_path, "[default]\nkeep_idle = 1\n"))
    conn = connect(port)
    conn.root.identify("alice")
    with conn.root.session(idle_reclaim=False) as session:
        assert session.run(lambda x: x, 1) == 1
        time.sleep(8)  # four times --idle-reclaim, its GPU idle throughout
        assert session.run(lambda x: x, 2) == 2
        other = connect(port)
        other.root.identify("alice")
        with pytest.raises(LimitError, match="keep_idle"):
            other.root.submit(lambda x: x, 0, idle_reclaim=False)
        with pytest.raises(LimitError, match="default.keep_idle = 1"):
            other.root.run_code(lambda x: x, 0, idle_reclaim=False, queue_timeout=1)
    bob = connect(port)
    bob.root.identify("bob")  # his own allowance: one, here for a detached job (its supervisor keeps its GPU)
    assert bob.root.submit(_idle_for, 8, idle_reclaim=False).result(90) == 8


def test_idle_reclaim_false_is_refused_without_an_allowance(driver, server, connect):
    port = _reclaiming(server)
    with pytest.raises(LimitError, match="keep_idle"):
        connect(port).root.run_code(lambda x: x, 0, idle_reclaim=False)


def test_the_cli_keeps_idle_gpus_with_keep_idle_within_the_allowance(driver, server, connect, tmp_path):
    """`rpycdl run/submit --keep-idle` is idle_reclaim=False: refused by name beyond the allowance (here none for bob,
    one for alice), recorded in the job's request when allowed; refused with --array."""
    port = _reclaiming(server, "--limits", _limits(tmp_path, "[users.alice]\nkeep_idle = 1\n"))
    flags = ["--host", "127.0.0.1", "--port", str(port)]
    bob, alice = (cli_env(LOGNAME=name, USER=name) for name in ("bob", "alice"))
    refused = rpycdl_cli("run", "pytorch", "--keep-idle", *flags, "--", "true", env=bob)
    assert refused.returncode != 0 and "keep_idle" in refused.stderr, refused.stderr
    kept = rpycdl_cli("submit", "pytorch", "-q", "--keep-idle", *flags, "--", "true", env=alice)
    assert kept.returncode == 0, kept.stderr
    hers = connect(port)
    hers.root.identify("alice")  # her job's request is hers alone to see
    job = hers.root.job(kept.stdout.strip())
    assert job.wait(60).state is JobState.SUCCEEDED and job.refresh()["request"]["idle_reclaim"] is False
    arrays = rpycdl_cli("submit", "pytorch", "--keep-idle", "--array", "0-1", *flags, "--", "true")
    assert arrays.returncode != 0 and "--keep-idle goes without --array" in arrays.stderr, arrays.stderr


def test_a_detached_job_with_retries_is_requeued_and_its_attempt_counts(driver, server, connect):
    port = _reclaiming(server)
    job = connect(port).root.submit(_idle_once, None, retries=1)
    assert job.result(90) == 2
    history = job.attempts()
    assert history[0]["error_type"] == "IdleReclaimedError", history
    assert "requeued" in history[0]["error"]
    assert "will be stopped and requeued (its attempt 2)" in "".join(job.logs())


def test_a_detached_job_without_retries_ends_with_the_error(driver, server, connect):
    port = _reclaiming(server)
    job = connect(port).root.submit(lambda _: time.sleep(120), None)
    with pytest.raises(IdleReclaimedError, match="--idle-reclaim"):
        job.result(90)


def test_a_session_is_reclaimed_through_kill_9_of_the_server_and_its_restart(driver, cluster, server, connect,
                                                                              lock_dir):
    driver(50)  # busy until the server was killed and another started
    port = _reclaiming(server)
    conn = connect(port)
    session = conn.root.session().open()
    assert session.run(lambda x: x, 1) == 1
    detached = connect(port).root.submit(_idle_once, None, retries=1)  # waits behind the session
    server_process(cluster, port).popen.kill()
    server_process(cluster, port).popen.wait(30)
    port = _reclaiming(server)
    job = _waiting_job(connect, port)
    driver(0)
    assert job.result(90) == "bob's"
    with pytest.raises(IdleReclaimedError):
        session.run(lambda x: x, 0)
    assert _row(lock_dir, session.id).error_type == "IdleReclaimedError"
    again = connect(port).root.job(detached.id)
    assert again.result(90) == 2  # reclaimed by its supervisor, requeued by the new server's sweep
    assert again.attempts()[0]["error_type"] == "IdleReclaimedError"
