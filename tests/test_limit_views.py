"""How limits show (rpycdl serve --limits), with real servers and a real monitor process: with `gpus = 1` for alice
on fake:4 and two of her jobs (one running, one waiting), the monitor's JSON and its dashboard (a real headless
browser) show the waiting job's reason and alice's use against her limit, Prometheus has the gauges, `rpycdl status`
lists her against her limit, and the notebook displays of the waiting job, of an array and of the server's status
say why it waits. Nothing of it shows where no limits are in force."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import gate_job, open_gate, scrape, wait_until
from test_dashboard import _monitor, _text, api, browser  # noqa: F401 - browser: the headless Chromium fixture
from test_monitor import value

from rpycdl import JobState

LIMITS = '[users.alice]\ngpus = 1\n\n[groups.vision]\nmembers = ["alice", "bob"]\ngpus = 3\n'
REASON = "alice holds 1 GPU, the limit of users.alice.gpus = 1"


@pytest.fixture
def monitor(cluster) -> Iterator[str]:
    """A monitor of the cluster's four simulated GPUs, started before any server: its base URL."""
    with _monitor(cluster.lock_dir, "fake:4") as base:
        yield base


def _held_back(cluster: Any, connect: Any, tmp_path: Any) -> tuple[int, Any, Any, Any, str]:
    """A fake:4 server under LIMITS, alice's job running there and her second waiting on her limit: (its port,
    alice's connection, the running job, the waiting one, the gate that ends them)."""
    path = tmp_path / "limits.toml"
    path.write_text(LIMITS)
    port = cluster.add_server("pytorch", "fake:4", "--limits", str(path))[1]
    alice = connect(port)
    alice.root.identify("alice")
    gate = str(tmp_path / "gate")
    running = alice.root.submit(gate_job(gate), 1, name="first")
    wait_until(lambda: running.status().state is JobState.RUNNING, 30, "alice's first job to run")
    waiting = alice.root.submit(gate_job(gate), 2, name="second")
    wait_until(lambda: waiting.status().reason == REASON, 30, "her second job to wait on her limit")
    return port, alice, running, waiting, gate


def _standing(host: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{row['kind']}:{row['name']}": row for row in host["limits"]}


def test_the_monitor_status_and_notebooks_show_why_a_job_waits_and_use_against_limits(cluster, connect, monitor,
                                                                                       tmp_path):
    assert api(monitor, "/api/host")["limits"] is None  # no limits in force: nothing to show
    assert not [name for name in scrape(monitor) if name.startswith(("rpycdl_user_", "rpycdl_group_"))]
    port, alice, running, waiting, gate = _held_back(cluster, connect, tmp_path)

    def shown() -> dict[str, Any] | None:
        host = api(monitor, "/api/host")  # nobody signed in: alice's jobs reduced, their reason shown
        rows = [row for row in host["queue"] if row["job_id"] == waiting.id and row.get("reason")]
        return host if rows and host["limits"] else None

    host = wait_until(shown, 30, "the monitor to show why alice's job waits")
    [row] = host["queue"]
    assert row["reason"] == REASON and row["reduced"] and "name" not in row
    standing = _standing(host)
    assert sorted(standing) == ["group:vision", "user:alice"]  # bob holds, waits and ran nothing
    alice_row, vision = standing["user:alice"], standing["group:vision"]
    assert (alice_row["gpus"], alice_row["limits"], alice_row["pending"]) == (1, {"gpus": 1}, 1)
    assert (vision["gpus"], vision["limits"], vision["members"]) == (1, {"gpus": 3}, ["alice", "bob"])
    assert 0 < alice_row["gpu_hours_day"] == vision["gpu_hours_day"] < 1  # her running job, up to now
    job = api(monitor, f"/api/jobs/{waiting.id}")["job"]
    assert (job["reason"], job["position"], job["reduced"]) == (REASON, 1, True)

    samples = scrape(monitor)
    assert value(samples, "rpycdl_user_gpus_held", user="alice") == 1
    assert value(samples, "rpycdl_user_gpu_limit", user="alice") == 1
    assert value(samples, "rpycdl_user_pending_requests", user="alice") == 1
    assert value(samples, "rpycdl_user_pending_limit", user="alice") is None  # none set
    assert 0 < value(samples, "rpycdl_user_gpu_hours", user="alice", window="week") < 1
    assert value(samples, "rpycdl_user_gpu_hours_limit", user="alice", window="day") is None
    assert value(samples, "rpycdl_group_gpus_held", group="vision") == 1
    assert value(samples, "rpycdl_group_gpu_limit", group="vision") == 3
    assert value(samples, "rpycdl_user_gpus_held", user="bob") is None

    status = subprocess.run([sys.executable, "-m", "rpycdl", "status", "--host", "127.0.0.1", "--port", str(port)],
                            capture_output=True, text=True, timeout=60).stdout
    lines = status.splitlines()
    assert "  use against the limits in force:" in lines, status
    table = lines[lines.index("  use against the limits in force:") + 1:]
    assert table[0].split() == ["USER", "GPUS", "HELD", "GPU-HOURS,", "LAST", "DAY", "GPU-HOURS,", "LAST", "WEEK",
                                "WAITING"], status
    cells = [cell.strip() for cell in table[1].strip().split("  ") if cell.strip()]
    assert cells[0] == "alice" and cells[1] == "1 / 1" and cells[-1] == "1", status
    assert table[2].strip().startswith("group vision (alice, bob)") and "1 / 3" in table[2], status

    shown_html = waiting._repr_mimebundle_()
    assert f"held back: {REASON}" in shown_html["text/html"] and REASON in shown_html["text/plain"]
    assert "held back" not in running._repr_mimebundle_()["text/html"]
    assert "1 / 1" in alice.root.gpu_status()._repr_html_()
    array = alice.root.submit_array(gate_job(gate), [3, 4])
    wait_until(lambda: f"held back: {REASON}" in array._repr_mimebundle_()["text/html"], 30,
               "the array's display to say why its elements wait")
    open_gate(gate)
    assert [running.result(60), waiting.result(60), array.results(60)] == [1, 2, [3, 4]]
    assert "held back" not in array._repr_mimebundle_()["text/html"]
    wait_until(lambda: _standing(api(monitor, "/api/host"))["user:alice"]["gpus"] == 0, 30,
               "alice to hold nothing once her jobs ended")


def test_the_dashboard_shows_why_a_job_waits_and_a_limits_panel(cluster, connect, monitor, browser,  # noqa: F811
                                                                 tmp_path):
    browser.get(monitor + "/")
    wait_until(lambda: _text(browser, "#status").startswith("live"), 30, "the dashboard to read the host")
    assert not browser.find_element("id", "limits-section").is_displayed()  # no limits in force
    _, _, running, waiting, gate = _held_back(cluster, connect, tmp_path)
    why = f'#queue tr[data-key="{waiting.id}"] td.why'
    wait_until(lambda: _text(browser, why) == REASON, 30, "the queue to say why alice's job waits")
    assert _text(browser, f'#queue tr[data-key="{waiting.id}"]').count(REASON) == 1
    assert browser.find_element("id", "limits-section").is_displayed()

    def cells(key: str) -> list[str]:
        return browser.execute_script("const r = document.querySelector(`#limits tr[data-key='${arguments[0]}']`);"
                                      "return r ? [...r.cells].map(c => c.textContent) : []", key)

    wait_until(lambda: cells("user:alice")[:2] == ["alice", ""], 30, "the limits panel to list alice")
    assert cells("user:alice")[2] == "1 / 1" and cells("user:alice")[3] == "0.0" and cells("user:alice")[5] == "1"
    assert cells("group:vision")[:3] == ["group vision", "alice, bob", "1 / 3"]
    assert browser.execute_script("return document.querySelector(`#limits tr[data-key='user:alice'] td`)"
                                  ".parentNode.cells[2].className") == "at-limit"
    browser.get(f"{monitor}/jobs/{waiting.id}")  # the job's page, nobody signed in
    wait_until(lambda: _text(browser, "#job-reason") == REASON, 30, "the job's page to say why it waits")
    open_gate(gate)
    assert [running.result(60), waiting.result(60)] == [1, 2]
    wait_until(lambda: _text(browser, "#job-state") == "SUCCEEDED", 30, "the job's page to show its end")
    assert _text(browser, "#job-reason") == ""
