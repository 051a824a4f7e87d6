"""The `rpycdl` command: help, status, jobs, cancel, and the refusals of `rpycdl serve`."""

from __future__ import annotations

import getpass
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import Background, gate_job, open_gate

import rpycdl

SUBCOMMANDS = ["registry", "serve", "status", "jobs", "cancel", "run", "demo", "selftest", "certs"]
ME = f"{getpass.getuser()} (unverified)"
"""How a server without authentication names the user of these tests."""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPYCDL_") or k == "RPYCDL_CONFIG"}
    return {**env, **extra}


def rpycdl_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpycdl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or _env())


def test_help_of_the_command_and_of_every_subcommand_exits_0():
    commands = [["--help"], *[[name, "--help"] for name in SUBCOMMANDS]]
    running = [(argv, subprocess.Popen([sys.executable, "-m", "rpycdl", *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=_env()))
               for argv in commands]
    for argv, process in running:
        out, err = process.communicate(timeout=30)
        assert process.returncode == 0, f"rpycdl {' '.join(argv)}: {err}"
        assert out.startswith("usage: rpycdl"), out
        if argv == ["--help"]:
            for name in SUBCOMMANDS:
                assert name in out
    no_command = rpycdl_cli()
    assert no_command.returncode == 2 and "COMMAND" in no_command.stderr


def _client_address(conn: rpycdl.Connection) -> str:
    host, port = conn._conn._channel.stream.sock.getsockname()[:2]
    return f"{host}:{port}"


@pytest.fixture
def queue(server, connect, tmp_path):
    """A fake:2 server: job A holds both GPUs; B (1 GPU) then C (2 GPUs) wait, in that order."""
    port = server("pytorch", "fake:2")
    gate = str(tmp_path / "gate")
    conns = [connect(port) for _ in range(3)]
    a = Background(conns[0], gate_job(gate), "A", ngpus=2)
    a.wait_state("running")
    b = Background(conns[1], gate_job(gate), "B", ngpus=1)
    b.wait_state("pending")
    c = Background(conns[2], gate_job(gate), "C", ngpus=2)
    c.wait_state("pending")
    yield port, (a, b, c), [_client_address(conn) for conn in conns]
    open_gate(gate)
    for job in (a, b, c):
        job.join()


def test_status_shows_each_gpu_its_holder_and_the_queue_in_order(cluster, queue):
    port, (a, b, c), clients = queue
    result = rpycdl_cli("status", "--registry", cluster.registry_address)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"pytorch @ 127.0.0.1:{port}" in out and "PYTORCH" in out and "simulated fake:2" in out
    gpu_lines = [line for line in out.splitlines() if re.match(r"\s+[01]\s+GPU-", line)]
    assert len(gpu_lines) == 2, out
    for index, line in enumerate(gpu_lines):
        assert line.split()[0] == str(index)
        assert f"job {a.job_id} of {ME} from {clients[0]} (pytorch)" in line, line
        assert "0.0/16.0 GiB" in line
    assert "waiting (2), first come first served:" in out
    waiting = [line.strip() for line in out.splitlines() if re.match(r"\s+\d+\. job ", line)]
    assert waiting[0].startswith(f"1. job {b.job_id} of {ME} wants 1 GPU(s), from {clients[1]}"), out
    assert waiting[1].startswith(f"2. job {c.job_id} of {ME} wants 2 GPU(s), from {clients[2]}"), out
    # by service name and directly by address, the same
    for args in (["pytorch", "--registry", cluster.registry_address], ["--host", "127.0.0.1", "--port", str(port)]):
        again = rpycdl_cli("status", *args)
        assert again.returncode == 0 and f"job {a.job_id}" in again.stdout and f"1. job {b.job_id}" in again.stdout


def test_status_json(cluster, queue):
    port, (a, b, c), clients = queue
    result = rpycdl_cli("status", "--json", "--registry", cluster.registry_address)
    assert result.returncode == 0, result.stderr
    (status,) = json.loads(result.stdout)
    assert status["server"]["port"] == port and status["server"]["simulated"] is True
    assert [gpu["index"] for gpu in status["gpus"]] == [0, 1]
    assert [gpu["holders"][0]["job_id"] for gpu in status["gpus"]] == [a.job_id, a.job_id]
    assert [gpu["holders"][0]["client"] for gpu in status["gpus"]] == [clients[0], clients[0]]
    assert [(w["job_id"], w["count"], w["client"]) for w in status["queue"]] == [
        (b.job_id, 1, clients[1]), (c.job_id, 2, clients[2])]


def test_jobs_lists_the_servers_jobs(cluster, queue):
    port, (a, b, c), _ = queue
    result = rpycdl_cli("jobs", "--registry", cluster.registry_address)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"127.0.0.1:{port}"
    states = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert states == {a.job_id: "running", b.job_id: "pending", c.job_id: "pending"}
    assert all(ME in line for line in lines[1:]), lines
    as_json = json.loads(rpycdl_cli("jobs", "--json", "--registry", cluster.registry_address).stdout)
    jobs = as_json[f"127.0.0.1:{port}"]
    assert [(job["job_id"], job["state"], job["ngpus"]) for job in jobs] == [
        (a.job_id, "running", 2), (b.job_id, "pending", 1), (c.job_id, "pending", 2)]


def test_cancel_stops_a_running_and_a_waiting_job(cluster, queue):
    port, (a, b, c), _ = queue
    result = rpycdl_cli("cancel", a.job_id, "--registry", cluster.registry_address)
    assert result.returncode == 0, result.stderr
    assert f"job {a.job_id} (running) on 127.0.0.1:{port}: cancel requested as {ME}" in result.stdout
    a.join(10)
    assert isinstance(a.error, rpycdl.JobCancelledError), repr(a.error)
    b.wait_state("running")  # the next in line got the GPU at once
    result = rpycdl_cli("cancel", c.job_id, "--registry", cluster.registry_address)
    assert result.returncode == 0 and "(pending)" in result.stdout, result.stdout + result.stderr
    c.join(10)
    assert isinstance(c.error, rpycdl.JobCancelledError), repr(c.error)
    assert not b.done
    jobs = {job["job_id"]: job["state"] for job in json.loads(
        rpycdl_cli("jobs", "--json", "--registry", cluster.registry_address).stdout)[f"127.0.0.1:{port}"]}
    assert jobs == {a.job_id: "cancelled", b.job_id: "running", c.job_id: "cancelled"}


def test_cancel_of_an_unknown_job_fails(cluster, server):
    server("pytorch", "fake:1")
    result = rpycdl_cli("cancel", "0123456789ab", "--registry", cluster.registry_address)
    assert result.returncode != 0
    assert "no server knows job 0123456789ab" in result.stderr


def test_status_with_no_server_registered_fails_clearly(cluster):
    result = rpycdl_cli("status", "--registry", cluster.registry_address)
    assert result.returncode != 0
    assert "knows no server" in result.stderr


def test_serve_on_a_public_address_without_insecure_is_refused(lock_dir):
    result = rpycdl_cli("serve", "--service", "pytorch", "--host", "0.0.0.0", "--port", "0", "--registry", "none",
                        "--gpus", "fake:1", "--lock-dir", lock_dir, timeout=20)
    assert result.returncode != 0
    assert "authentication" in result.stderr and "--insecure" in result.stderr
    assert "0.0.0.0" in result.stderr


def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_serve_without_gpus_on_a_machine_without_nvml_says_how_to_simulate(lock_dir, cluster):
    if _nvml_works():  # a GPU machine: no simulation needed, and the server says it uses NVML
        process, _ = cluster.add_server("pytorch", None)
        assert "NVML" in process.lines[0]
        return
    result = rpycdl_cli("serve", "--service", "pytorch", "--port", "0", "--registry", "none",
                        "--lock-dir", lock_dir, timeout=20)
    assert result.returncode != 0
    assert "NVML" in result.stderr
    assert "--gpus fake:" in result.stderr and "RPYCDL_GPUS=fake:" in result.stderr
    # and the hint works
    hinted = rpycdl_cli("serve", "--service", "pytorch", "--port", "0", "--registry", "none",
                        "--lock-dir", lock_dir, "--gpus", "fake:0", timeout=20)
    assert hinted.returncode != 0 and "between 1 and 64" in hinted.stderr


def test_serve_reads_the_inventory_from_rpycdl_gpus(lock_dir):
    process = subprocess.Popen([sys.executable, "-m", "rpycdl", "serve", "--service", "pytorch", "--port", "0",
                                "--registry", "none", "--lock-dir", lock_dir], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env(RPYCDL_GPUS="fake:3x8GiB",
                                                                             PYTHONUNBUFFERED="1"))
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert "3 GPU(s) (SIMULATED fake:3x8GiB)" in first, first
        port = int(re.search(r"127\.0\.0\.1:(\d+)", first).group(1))
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            gpus = conn.root.gpu_status()["gpus"]
        assert [gpu["memory_total"] for gpu in gpus] == [8 * 2**30] * 3
    finally:
        process.terminate()
        process.wait(10)


def test_run_streams_a_commands_output_and_exits_with_its_code(cluster, server):
    port = server("pytorch", "fake:2x16GiB")
    script = "import os, sys; print(os.environ['RPYCDL_GPU_MEMORY'], os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(3)"
    done = rpycdl_cli("run", "pytorch", "--registry", cluster.registry_address, "--gpu-memory", "2GiB", "--",
                      sys.executable, "-c", script)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == [str(2 * 1024**3), "0"]
    assert re.search(r"rpycdl run: job \w+ runs on GPU 0", done.stderr), done.stderr

    whole = rpycdl_cli("run", "ignored", "--host", "127.0.0.1", "--port", str(port), "--ngpus", "2", "--",
                       "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; kill -9 $$")
    assert whole.stdout.strip() == "0,1" and whole.returncode == 128 + 9, whole.stderr


@pytest.mark.parametrize(("args", "message"), [
    ([], "give the command to run"),
    (["--gpus", "1.5", "--", "true"], "neither a share of one GPU"),
    (["--ngpus", "1", "--gpus", "0.5", "--", "true"], "not allowed with argument"),
    (["--", "no-such-command-here"], "no-such-command-here: No such file or directory"),
])
def test_run_refuses_bad_requests_with_a_clear_message(server, args, message):
    port = server("pytorch", "fake:1")
    done = rpycdl_cli("run", "pytorch", "--host", "127.0.0.1", "--port", str(port), *args)
    assert done.returncode in (2, 127) and message in done.stderr, done.stderr
