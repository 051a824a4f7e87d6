"""`rpycdl monitor` against real servers on simulated GPUs: known grants, shares, a queue and ended jobs,
checked metric by metric from a real scrape over HTTP, parsed by prometheus_client's parser."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import pytest
from helpers import gate_job, open_gate, scrape, wait_until

import rpycdl
from rpycdl import JobState
from rpycdl.monitor import web as monitor_web
from rpycdl.site.local import start
from rpycdl.units import GiB

UUIDS = [f"GPU-00000000-0000-4000-8000-{index:012d}" for index in range(2)]


def value(samples: dict[str, Any], name: str, **labels: str) -> float | None:
    """The value of the one sample of `name` whose labels include `labels` (None: no such sample)."""
    found = [number for got, number in samples.get(name, []) if labels.items() <= got.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def test_every_metric_says_what_the_servers_do(cluster, connect, monitor, tmp_path):
    conn = connect(cluster.add_server("pytorch", "fake:2")[1])
    conn.root.identify("alice")
    whole_gate, share_gate = str(tmp_path / "whole"), str(tmp_path / "share")
    whole = conn.root.submit(gate_job(whole_gate), 1, ngpus=1)
    wait_until(lambda: whole.status().state is JobState.RUNNING, 10, "the whole-GPU job to run")
    share = conn.root.submit(gate_job(share_gate), 2, gpu_memory="4GiB")
    wait_until(lambda: share.status().state is JobState.RUNNING, 10, "the share to run")
    waiting = conn.root.submit(gate_job(whole_gate), 3, ngpus=2)
    wait_until(lambda: waiting.status().queued == 0, 10, "the two-GPU job to wait")
    held = {uuid: i for i, uuid in enumerate(UUIDS)}
    whole_gpu = held[whole.refresh()["gpu_uuids"][0]]
    share_gpu = 1 - whole_gpu

    samples = scrape(monitor)
    for index, uuid in enumerate(UUIDS):
        assert value(samples, "rpycdl_gpu_info", gpu=str(index), uuid=uuid, model="Simulated GPU") == 1
        assert value(samples, "rpycdl_gpu_memory_total_bytes", uuid=uuid) == 16 * GiB
        assert value(samples, "rpycdl_gpu_memory_used_bytes", uuid=uuid) == 0
        assert value(samples, "rpycdl_gpu_utilization_ratio", uuid=uuid) is None  # simulated: unknown
    assert value(samples, "rpycdl_gpu_memory_granted_bytes", gpu=str(whole_gpu)) == 16 * GiB
    assert value(samples, "rpycdl_gpu_memory_granted_bytes", gpu=str(share_gpu)) == 4 * GiB
    assert value(samples, "rpycdl_gpu_holder_info", gpu=str(whole_gpu), job=whole.id, user="alice (unverified)",
                 kind="whole") == 1
    assert value(samples, "rpycdl_gpu_holder_info", gpu=str(share_gpu), job=share.id, kind="share") == 1
    assert len(samples["rpycdl_gpu_holder_info"]) == 2
    assert value(samples, "rpycdl_queue_waiting_requests", service="pytorch") == 1
    assert value(samples, "rpycdl_jobs", state="RUNNING") == 2 and value(samples, "rpycdl_jobs", state="PENDING") == 1
    assert "rpycdl_job_run_seconds_count" not in samples  # nothing ended yet
    assert value(samples, "rpycdl_scheduling_info", policy="fcfs", placement="pack") == 1

    open_gate(whole_gate)
    open_gate(share_gate)
    for job in (whole, share, waiting):
        assert job.wait(10).state is JobState.SUCCEEDED
    assert conn.root.run_code(lambda x: x, 7) == 7  # an attached job counts as well
    wait_until(lambda: value(scrape(monitor), "rpycdl_job_run_seconds_count", service="pytorch") == 4, 5,
               "the four ended jobs to be counted")
    samples = scrape(monitor)
    assert value(samples, "rpycdl_jobs", state="SUCCEEDED") == 4 and value(samples, "rpycdl_jobs", state="RUNNING") == 0
    assert value(samples, "rpycdl_job_queue_wait_seconds_count", service="pytorch") == 4
    assert value(samples, "rpycdl_job_queue_wait_seconds_bucket", service="pytorch", le="+Inf") == 4
    # as long as each waited by its ledger row (three were granted at once, the fourth waited for the gate,
    # but a busy machine may take a second to grant a free GPU: the histogram must count what happened)
    rows = conn.root.jobs()
    waits = [(row["started"] - row["submitted"]).total_seconds() for row in rows]
    assert len(waits) == 4
    assert value(samples, "rpycdl_job_queue_wait_seconds_bucket", service="pytorch", le="1.0") == sum(
        wait <= 1.0 for wait in waits), waits
    ran = sum((row["ended"] - row["started"]).total_seconds() for row in rows)
    # the rows' datetimes hold microseconds: each run time is exact to 1 µs
    assert 0 < value(samples, "rpycdl_job_run_seconds_sum", service="pytorch") == pytest.approx(ran, abs=1e-5)
    # what they used, for those their server measured (none where it cannot fence its jobs)
    measured = [row for row in rows if row.get("peak_memory") is not None]
    assert (value(samples, "rpycdl_job_peak_memory_bytes_count", service="pytorch") or 0) == len(measured)
    assert (value(samples, "rpycdl_job_cpu_seconds_total", service="pytorch") or 0.0) == pytest.approx(
        sum(row["cpu_seconds"] or 0.0 for row in rows))
    assert value(samples, "rpycdl_queue_waiting_requests", service="pytorch") is None
    assert all(value(samples, "rpycdl_gpu_memory_granted_bytes", uuid=uuid) == 0 for uuid in UUIDS)
    assert scrape(monitor) == samples  # counted once, however often it is scraped


def test_refused_requests_are_counted_by_service_and_reason(cluster, connect, monitor, tmp_path):
    port = cluster.add_server("pytorch", "fake:2", "--max-queued", "1")[1]
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    secret.chmod(0o600)
    secured = cluster.add_server("secured", "fake:2", "--secret-file", str(secret))[1]
    narrow = cluster.add_server("narrow", "fake:2", "--max-connections", "1")[1]
    conn = connect(port)
    conn.root.identify("alice")
    assert "rpycdl_requests_refused_total" not in scrape(monitor)  # nothing refused yet: no series

    with pytest.raises(rpycdl.InvalidRequestError, match="asked for 3 GPUs but this server has 2"):
        conn.root.run_code(lambda x: x, 1, ngpus=3)
    with pytest.raises(rpycdl.InvalidRequestError, match="asked for 3 GPUs"):
        conn.root.submit(lambda x: x, 1, ngpus=3)
    gate = str(tmp_path / "gate")
    holder = conn.root.submit(gate_job(gate), 1, ngpus=2)
    wait_until(lambda: holder.status().state is JobState.RUNNING, 10, "the job holding both GPUs to run")
    with pytest.raises(rpycdl.QueueTimeoutError):  # a queue timeout is a job that failed, not a refusal
        conn.root.run_code(lambda x: x, 2, queue_timeout=0.3)
    waiting = conn.root.submit(gate_job(gate), 3, ngpus=1)
    wait_until(lambda: waiting.status().queued == 0, 10, "the second job to wait")
    with pytest.raises(rpycdl.LimitError, match="queue is full"):  # one waits already: --max-queued 1
        conn.root.submit(gate_job(gate), 4, ngpus=1)
    with pytest.raises(rpycdl.LimitError, match="queue is full"):  # an attached request, as it would wait
        connect(port).root.run_code(lambda x: x, 5)
    mallory = connect(port)
    mallory.root.identify("mallory")
    with pytest.raises(rpycdl.NotAllowedError):
        mallory.root.cancel(holder.id)
    with pytest.raises(rpycdl.NotAllowedError):
        mallory.root.job(holder.id).result(wait=False)
    mallory.root.job(holder.id).status()  # anyone may see that it exists: no refusal
    with pytest.raises(rpycdl.InvalidRequestError):  # no such job: a question answered, not a request refused
        mallory.root.cancel("nosuchjob")
    open_gate(gate)  # the servers share the host's GPUs: the next ones need them free
    assert holder.wait(10).state is JobState.SUCCEEDED and waiting.wait(10).state is JobState.SUCCEEDED
    with pytest.raises(rpycdl.AuthFailedError):
        rpycdl.connect(host="127.0.0.1", port=secured)
    with rpycdl.connect(host="127.0.0.1", port=secured, secret_file=str(secret)) as known:
        assert known.root.run_code(lambda x: x, "in") == "in"
    with rpycdl.connect(host="127.0.0.1", port=narrow) as first:
        with pytest.raises(rpycdl.LimitError, match="--max-connections"):
            rpycdl.connect(host="127.0.0.1", port=narrow)
        assert first.root.run_code(lambda x: x, "served") == "served"

    def refused() -> dict[tuple[str, str], float]:
        return {(labels["service"], labels["reason"]): count
                for labels, count in scrape(monitor).get("rpycdl_requests_refused_total", [])}

    reasons = ("invalid", "limit", "connections", "auth", "not_allowed")
    expected = {("pytorch", "invalid"): 2, ("pytorch", "limit"): 2, ("pytorch", "not_allowed"): 2,
                ("secured", "auth"): 1, ("narrow", "connections"): 1}
    every = {(service, reason): expected.get((service, reason), 0)
             for service in ("pytorch", "secured", "narrow") for reason in reasons}
    wait_until(lambda: refused() == every, 5, f"the refusals counted as {expected}")  # a scrape may be 1 s old
    time.sleep(monitor_web.SCRAPE_REUSE)
    assert refused() == every  # a fresh collection counts each once


def test_simulated_memory_in_use_shows_as_used(cluster, connect, monitor, tmp_path):
    conn = connect(cluster.add_server("pytorch", "fake:2")[1])
    gate = str(tmp_path / "gate")

    def hold(args: Any) -> None:
        import os
        import time

        import rpycdl

        rpycdl.simulate_memory(3 * 1024**3)
        while not os.path.exists(args):
            time.sleep(0.01)

    job = conn.root.submit(hold, gate, gpu_memory="4GiB")
    uuid = wait_until(lambda: job.refresh()["gpu_uuids"], 10, "the share")[0]
    wait_until(lambda: value(scrape(monitor), "rpycdl_gpu_memory_used_bytes", uuid=uuid) == 3 * GiB, 10,
               "the job's memory to show")
    open_gate(gate)
    assert job.wait(10).state is JobState.SUCCEEDED


def test_health_and_what_is_not_there(monitor):
    with urllib.request.urlopen(f"{monitor}/healthz", timeout=10) as response:
        assert response.status == 200 and response.read() == b"ok\n"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{monitor}/nothing", timeout=10)
    assert missing.value.code == 404
    assert "rpycdl_scheduling_info" not in scrape(monitor)  # no server lives: no policy is in force


def test_a_monitor_on_a_public_address_needs_insecure(lock_dir):
    refused = subprocess.run([sys.executable, "-m", "rpycdl", "monitor", "--gpus", "fake:1", "--lock-dir", lock_dir,
                              "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "not loopback" in refused.stderr and "--insecure" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_monitor_with_tls_serves_https_on_any_address(lock_dir, team):
    cert, key, ca = (f"{team.dir}/{name}" for name in ("server-localhost.crt", "server-localhost.key", "ca.crt"))
    base = ["monitor", "--gpus", "fake:1", "--lock-dir", lock_dir, "--host", "0.0.0.0", "--port", "0",
            "--tls-cert", cert, "--tls-key", key]
    half = subprocess.run([sys.executable, "-m", "rpycdl", *base[:-2]], capture_output=True, text=True, timeout=30)
    assert half.returncode == 2 and "needs a certificate and its key; missing: key" in half.stderr

    def scrape_tls(port: str, client: str | None = None) -> bytes:
        context = ssl.create_default_context(cafile=ca)  # checks that the certificate names 127.0.0.1
        if client is not None:
            context.load_cert_chain(f"{team.dir}/user-{client}.crt", f"{team.dir}/user-{client}.key")
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", timeout=10, context=context) as response:
            return response.read()

    anyone = start(base)  # no --insecure needed: the metrics cross the network encrypted
    mutual = start([*base, "--tls-ca", ca])
    try:
        port = anyone.wait_for(r"on https://0\.0\.0\.0:(\d+)/metrics").group(1)
        assert b'rpycdl_gpu_info{gpu="0"' in scrape_tls(port)
        with pytest.raises((OSError, HTTPException)):  # plain HTTP gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10).read()
        port = mutual.wait_for(r"on https://0\.0\.0\.0:(\d+)/metrics.*client certificates of").group(1)
        assert b'rpycdl_gpu_info{gpu="0"' in scrape_tls(port, client="alice")
        with pytest.raises((OSError, HTTPException)):  # urllib.error.URLError is an OSError
            scrape_tls(port)  # no client certificate: refused
    finally:
        anyone.stop()
        mutual.stop()


def test_the_demo_starts_a_monitor_beside_its_server():
    demo = subprocess.run([sys.executable, "-m", "rpycdl", "demo", "--gpus", "fake:1", "--client",
                           str(Path(__file__).parent.parent / "clients" / "detached.py")],
                          capture_output=True, text=True, timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert re.search(r"^rpycdl demo: monitor on http://127\.0\.0\.1:\d+ \(/metrics, /healthz\)", demo.stdout, re.M)
    assert "SUCCEEDED; it returned" in demo.stdout


def _raw(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_slow_greedy_and_oversized_clients_stall_neither_others_nor_grants(cluster, connect, monitor):
    conn = connect(cluster.add_server("pytorch", "fake:2")[1])
    slow = [_raw(monitor) for _ in range(300)]  # slowloris: headers begun, never finished
    for sock in slow:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    for size, refusal in ((40_000, b"HTTP/1.1 431"), (4_000_000, b"HTTP/1.1 400")):
        oversized = _raw(monitor)
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"
        with contextlib.suppress(ConnectionError):  # it may hang up before reading all of it
            oversized.sendall(request[:size // 2])  # in two reads at least: the answer must not depend on it
            time.sleep(0.2)
            oversized.sendall(request[size // 2:])
        assert oversized.recv(64).startswith(refusal), f"a header of {size} bytes must be refused"
        oversized.close()

    def burst() -> int:  # 40 clients at once, 50 requests each over keep-alive
        def client(_: int) -> int:
            http = HTTPConnection(monitor.removeprefix("http://"), timeout=30)
            codes = []
            for _ in range(50):
                http.request("GET", "/metrics")
                response = http.getresponse()
                response.read()
                codes.append(response.status)
            http.close()
            return codes.count(200)

        with ThreadPoolExecutor(40) as pool:
            return sum(pool.map(client, range(40)))

    with ThreadPoolExecutor(1) as pool:
        burst_done = pool.submit(burst)
        assert conn.root.run_code(lambda x: x + 1, 1, ngpus=2) == 2  # a grant, while the monitor is flooded
        assert value(scrape(monitor), "rpycdl_gpu_memory_total_bytes", gpu="0") == 16 * GiB  # another client
        assert burst_done.result(timeout=120) == 2000
    time.sleep(monitor_web.REQUEST_DEADLINE + 1)
    closed = sum(1 for sock in slow if not sock.recv(1))  # the server hung up on each of them
    assert closed == len(slow)
    for sock in slow:
        sock.close()


def test_nvml_memory_in_use_and_utilisation_come_from_the_driver(cluster, tmp_path):
    state = tmp_path / "driver.json"

    def driver(used: list[int], busy: list[int]) -> None:
        state.write_text(json.dumps([{"uuid": uuid, "name": "NVIDIA H100 80GB HBM3", "total": 80 * GiB, "used": u,
                                      "utilization": b, "bus_id": f"00000000:{7 + i:02X}:00.0"}
                                     for i, (uuid, u, b) in enumerate(zip(UUIDS, used, busy, strict=True))]))

    driver([5 * GiB, 0], [87, 0])
    env = {"RPYCDL_NVML_MODULE": "fake_nvml_driver", "FAKE_NVML_STATE": str(state),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    process = start(["monitor", "--gpus", "nvml", "--lock-dir", cluster.lock_dir, "--port", "0"], env=env)
    try:
        base = "http://127.0.0.1:" + process.wait_for(r"on http://127\.0\.0\.1:(\d+)/metrics").group(1)
        samples = scrape(base)
        assert value(samples, "rpycdl_gpu_info", gpu="1", uuid=UUIDS[1], model="NVIDIA H100 80GB HBM3") == 1
        assert value(samples, "rpycdl_gpu_memory_total_bytes", uuid=UUIDS[0]) == 80 * GiB
        assert value(samples, "rpycdl_gpu_memory_used_bytes", uuid=UUIDS[0]) == 5 * GiB
        assert value(samples, "rpycdl_gpu_utilization_ratio", uuid=UUIDS[0]) == 0.87
        assert value(samples, "rpycdl_gpu_utilization_ratio", uuid=UUIDS[1]) == 0
        driver([5 * GiB, 30 * GiB], [87, 45])  # a job started on GPU 1
        wait_until(lambda: value(scrape(base), "rpycdl_gpu_memory_used_bytes", uuid=UUIDS[1]) == 30 * GiB, 5,
                   "the driver's new figures")
        assert value(scrape(base), "rpycdl_gpu_utilization_ratio", uuid=UUIDS[1]) == 0.45
    finally:
        process.stop()
