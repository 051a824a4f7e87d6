"""Scheduling policies with real servers and clients: backfill onto a free GPU in front of a waiting head
(shown by `rpycdl status`, stopped at its timeout), fair share before a user's hundred queued jobs, mixed
policies on one lock directory refused by name, and least-busy placement from the (fake) driver's load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import gate_job, open_gate, server_process, wait_until

from rpycdl import JobState
from rpycdl.errors import RpycdlError
from rpycdl.scheduler import fairshare
from rpycdl.scheduler.load import read_load
from rpycdl.site.local import start
from rpycdl.units import GiB

UUIDS = ["GPU-11111111-1111-4111-8111-111111111111", "GPU-22222222-2222-4222-8222-222222222222"]


def _status(port: int) -> str:
    return subprocess.run([sys.executable, "-m", "rpycdl", "status", "--host", "127.0.0.1", "--port", str(port)],
                          capture_output=True, text=True, timeout=30).stdout


@pytest.mark.parametrize("policy", ["fcfs-backfill", "fcfs"])
def test_a_short_job_backfills_onto_a_free_gpu_only_under_backfill(server, connect, tmp_path, policy):
    port = server("pytorch", "fake:2", "--policy", policy)
    conn = connect(port)
    first, short = str(tmp_path / "first"), str(tmp_path / "short")
    holder = conn.root.submit(gate_job(first), 1, ngpus=1, timeout=60, name="holder")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 20, "the first job to run")
    head = conn.root.submit(lambda x: x, "head", ngpus=2, timeout=30, name="head")
    wait_until(lambda: head.status().queued == 0 and head.status().state is JobState.PENDING, 20, "the head to wait")
    backfill = conn.root.submit(gate_job(short), 2, ngpus=1, timeout=3, name="short")
    unbounded = conn.root.submit(lambda x: x, 3, ngpus=1, name="no-timeout")  # never backfills
    if policy == "fcfs":
        time.sleep(1.5)
        assert backfill.status().state is JobState.PENDING and unbounded.status().state is JobState.PENDING
        open_gate(first)
        open_gate(short)
        assert [job.result(30) for job in (head, backfill, unbounded)] == ["head", 2, 3]
        return
    wait_until(lambda: backfill.status().state is JobState.RUNNING, 20, "the short job to backfill")
    status = conn.root.gpu_status()
    holders = {holder["job_id"]: holder for gpu in status["gpus"] for holder in gpu["holders"]}
    assert holders[backfill.id]["backfilled"] and not holders[holder.id]["backfilled"]
    head_entry = status["queue"][0]
    assert head_entry["job_id"] == head.id
    planned = (head_entry["planned_start"] - holders[holder.id]["since"]).total_seconds()
    assert planned == pytest.approx(60, abs=0.01)
    assert status["server"]["scheduling"]["policy"] == "fcfs-backfill"
    text = _status(port)
    assert "policy fcfs-backfill" in text and "backfilled" in text and "reserved start" in text, text
    assert unbounded.status().state is JobState.PENDING
    # the backfilled job runs past its declared timeout: it is stopped, and its GPU is free again
    assert backfill.wait(20).state is JobState.TIMED_OUT
    assert head.status().state is JobState.PENDING
    open_gate(first)
    assert head.result(30) == "head" and unbounded.result(30) == 3
    assert head.refresh()["started"] <= unbounded.refresh()["started"]


def test_fair_share_serves_another_users_request_before_one_users_hundred(cluster, server, connect, lock_dir,
                                                                          tmp_path):
    port = server("pytorch", "fake:1", "--policy", "fair")
    alice, bob = connect(port), connect(port)
    alice.root.identify("alice")
    bob.root.identify("bob")
    gate = str(tmp_path / "gate")
    holder = alice.root.submit(gate_job(gate), 0, name="holder")
    wait_until(lambda: holder.status().state is JobState.RUNNING, 20, "alice's first job to run")
    queued = [alice.root.submit(lambda x: x, n) for n in range(100)]
    late = bob.root.submit(lambda x: x, "bob's")
    wait_until(lambda: late.status().state is JobState.PENDING, 20, "bob's job to wait")
    status = bob.root.gpu_status()
    assert status["queue"][0]["job_id"] == late.id and status["queue"][0]["usage"] == 0
    assert status["queue"][1]["usage"] > 0  # alice's: her first job has been running
    assert late.status().ahead == 1 and queued[0].status().ahead == 2  # in the policy's order, not the tickets'
    # Once her first job ends, what it used counts from the host's snapshot, refreshed every FAIR_SHARE_REFRESH:
    # wait until it has counted her, as it does for any job running longer than that.
    wait_until(lambda: (snapshot := fairshare.read_snapshot(lock_dir)) and snapshot.usage.get("alice", 0) > 0,
               20, "the fair-share snapshot to count alice's running job")
    open_gate(gate)
    assert late.result(60) == "bob's"
    results = [job.result(120) for job in queued]
    assert results == list(range(100))
    starts = [job.refresh()["started"] for job in queued]
    assert late.refresh()["started"] < min(starts)
    assert starts == sorted(starts)  # one user's jobs keep their order


def test_servers_of_one_lock_directory_must_share_a_policy(cluster, server, lock_dir, tmp_path, connect):
    port = server("pytorch", "fake:2", "--policy", "fcfs-backfill", "--placement", "spread")
    with pytest.raises(RpycdlError) as refused:
        server("pytorch", "fake:2", "--policy", "fair")
    words = str(refused.value)
    assert "--policy fcfs-backfill --placement spread" in words and "--policy fair --placement pack" in words
    # a detached job's supervisor keeps its policy's claim while its server is gone
    gate = str(tmp_path / "gate")
    job = connect(port).root.submit(gate_job(gate), 1, ngpus=1)
    wait_until(lambda: job.status().state is JobState.RUNNING, 20, "the job to run")
    server_process(cluster, port).stop()
    with pytest.raises(RpycdlError, match="--policy fcfs-backfill"):
        server("pytorch", "fake:2")
    open_gate(gate)
    wait_until(lambda: not _supervisors(lock_dir), 20, "the supervisor to end")
    assert server("pytorch", "fake:2")  # fcfs now: nobody grants with another policy any more


def _supervisors(lock_dir: str) -> list[int]:
    """The live supervisors that hold files of `lock_dir` open (its policy's claim among them)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "comm").read_text().strip() != "rpycdl-superv":
                continue
            held = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(path.startswith(lock_dir + os.sep) for path in held):
            found.append(int(entry.name))
    return found


def test_least_busy_places_a_share_on_the_gpu_the_driver_says_is_idle(cluster, connect, tmp_path, monkeypatch):
    state = tmp_path / "driver.json"

    def driver(busy: list[int], bandwidth: list[int]) -> None:
        state.write_text(json.dumps([{"uuid": uuid, "total": 16 * GiB, "utilization": b, "memory_utilization": m,
                                      "bus_id": f"00000000:{7 + i:02X}:00.0"}
                                     for i, (uuid, b, m) in enumerate(zip(UUIDS, busy, bandwidth, strict=True))]))

    driver([95, 5], [10, 5])  # GPU 0 busy with work that is not ours
    monkeypatch.setenv("RPYCDL_NVML_MODULE", "fake_nvml_driver")
    monkeypatch.setenv("FAKE_NVML_STATE", str(state))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    conn = connect(cluster.add_server("pytorch", "nvml", "--placement", "least-busy")[1])
    wait_until(lambda: read_load(cluster.lock_dir, time.time()).get(UUIDS[0], 0) > 0.9, 20, "the sampler's figures")
    gate = str(tmp_path / "gate")
    first = conn.root.submit(gate_job(gate), 1, gpu_memory="4GiB")
    wait_until(lambda: first.status().state is JobState.RUNNING, 20, "the first share to run")
    assert first.refresh()["gpu_uuids"] == [UUIDS[1]]  # pack would take GPU 0, the first idle one
    driver([5, 8], [5, 97])  # now GPU 1's memory is saturated, GPU 0 idle
    wait_until(lambda: read_load(cluster.lock_dir, time.time()).get(UUIDS[1], 0) > 0.5, 20, "the load to move")
    second = conn.root.submit(gate_job(gate), 2, gpu_memory="4GiB")
    wait_until(lambda: second.status().state is JobState.RUNNING, 20, "the second share to run")
    assert second.refresh()["gpu_uuids"] == [UUIDS[0]]  # pack would add it to GPU 1, the fullest with room
    open_gate(gate)
    assert first.result(20) == 1 and second.result(20) == 2


def test_a_server_of_simulated_gpus_with_least_busy_places_as_pack(server, connect, tmp_path):
    conn = connect(server("pytorch", "fake:2", "--placement", "least-busy"))
    gate = str(tmp_path / "gate")
    jobs = [conn.root.submit(gate_job(gate), n, gpu_memory="4GiB") for n in range(2)]
    for job in jobs:
        wait_until(lambda job=job: job.status().state is JobState.RUNNING, 20, "the shares to run")
    assert jobs[0].refresh()["gpu_uuids"] == jobs[1].refresh()["gpu_uuids"]  # no load known: the fullest with room
    open_gate(gate)
    assert [job.result(20) for job in jobs] == [0, 1]


def test_a_bad_fair_share_file_is_a_start_failure(tmp_path, lock_dir):
    bad = tmp_path / "fair.toml"
    bad.write_text("half_life = 'soon'\n")
    process = start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--lock-dir", lock_dir, "--port", "0",
                     "--registry", "none", "--policy", "fair", "--fair-share", str(bad)])
    assert process.popen.wait(30) == 1
    assert any("half_life" in line and str(bad) in line for line in process.lines), process.lines
    usage = subprocess.run([sys.executable, "-m", "rpycdl", "serve", "--service", "pytorch", "--fair-share", str(bad)],
                           capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "--fair-share is for --policy fair" in usage.stderr
