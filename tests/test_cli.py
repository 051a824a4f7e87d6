"""The `rpycdl` command: help, status, jobs, cancel, run, its exit codes and one-line failures, and the
refusals of `rpycdl serve`."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import (
    Background,
    children,
    cli_env,
    comm,
    gate_job,
    kept_jobs,
    open_gate,
    rpycdl_cli,
    spare_processes,
    wait_until,
)

import rpycdl
from rpycdl import cli
from rpycdl.cli.common import EXIT_JOB_TIMEOUT, EXIT_QUEUE_TIMEOUT
from rpycdl.site.local import one_account

SUBCOMMANDS = ["registry", "serve", "monitor", "status", "jobs", "cancel", "run", "submit", "logs", "wait", "result",
               "delete", "demo", "selftest", "certs"]
ME = f"{getpass.getuser()} (unverified)"
"""How a server without authentication names the user of these tests."""


def test_help_of_the_command_and_of_every_subcommand_exits_0():
    commands = [["--help"], *[[name, "--help"] for name in SUBCOMMANDS]]
    running = [(argv, subprocess.Popen([sys.executable, "-m", "rpycdl", *argv], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=cli_env()))
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
        assert "0 B / 16 GiB" in line  # sizes in words
    assert "waiting (2), first come first served:" in out
    waiting = [line.strip() for line in out.splitlines() if re.match(r"\s+\d+\. job ", line)]
    assert waiting[0].startswith(f"1. job {b.job_id} of {ME} wants 1 GPU, from {clients[1]}"), out
    assert waiting[1].startswith(f"2. job {c.job_id} of {ME} wants 2 GPUs, from {clients[2]}"), out
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
    assert [(w["job_id"], w["ngpus"], w["client"]) for w in status["queue"]] == [
        (b.job_id, 1, clients[1]), (c.job_id, 2, clients[2])]


def test_jobs_lists_the_servers_jobs(cluster, queue):
    port, (a, b, c), _ = queue
    result = rpycdl_cli("jobs", "--registry", cluster.registry_address)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["ID", "NAME", "STATE", "USER"]
    states = {line.split()[0]: line.split()[2] for line in lines[1:]}
    assert states == {a.job_id: "RUNNING", b.job_id: "PENDING", c.job_id: "PENDING"}
    assert all(ME in line and "attached from 127.0.0.1:" in line for line in lines[1:]), lines
    jobs = json.loads(rpycdl_cli("jobs", "--json", "--registry", cluster.registry_address).stdout)
    assert [(job["job_id"], job["state"], job["ngpus"], job["server"]) for job in jobs] == [
        (c.job_id, "PENDING", 2, f"127.0.0.1:{port}"), (b.job_id, "PENDING", 1, f"127.0.0.1:{port}"),
        (a.job_id, "RUNNING", 2, f"127.0.0.1:{port}")]  # newest first


def test_cancel_stops_a_running_and_a_waiting_job(cluster, queue):
    port, (a, b, c), _ = queue
    result = rpycdl_cli("cancel", a.job_id, "--registry", cluster.registry_address)
    assert result.returncode == 0, result.stderr
    assert f"job {a.job_id} (RUNNING) on 127.0.0.1:{port}: CANCELLED" in result.stdout  # the state after it
    a.join(10)
    assert isinstance(a.error, rpycdl.JobCancelledError), repr(a.error)
    b.wait_state("running")  # the next in line got the GPU at once
    result = rpycdl_cli("cancel", c.job_id, "--registry", cluster.registry_address)
    assert result.returncode == 0 and "(PENDING)" in result.stdout, result.stdout + result.stderr
    c.join(10)
    assert isinstance(c.error, rpycdl.JobCancelledError), repr(c.error)
    assert not b.done
    jobs = {job["job_id"]: job["state"] for job in json.loads(
        rpycdl_cli("jobs", "--json", "--registry", cluster.registry_address).stdout)}
    assert jobs == {a.job_id: "CANCELLED", b.job_id: "RUNNING", c.job_id: "CANCELLED"}


def test_cancel_of_an_unknown_job_fails(cluster, server):
    server("pytorch", "fake:1")
    result = rpycdl_cli("cancel", "0123456789ab", "--registry", cluster.registry_address)
    assert result.returncode != 0
    assert "no server knows job '0123456789ab'" in result.stderr


def test_status_with_no_server_registered_fails_clearly(cluster):
    result = rpycdl_cli("status", "--registry", cluster.registry_address)
    assert result.returncode == 1
    assert f"the registry (udp {cluster.registry_address}) knows no server" in result.stderr


def test_serve_on_a_public_address_without_insecure_is_refused(lock_dir):
    result = rpycdl_cli("serve", "--service", "pytorch", "--host", "0.0.0.0", "--port", "0", "--registry", "none",
                        "--gpus", "fake:1", "--lock-dir", lock_dir, timeout=20)
    assert result.returncode == 1
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
                               stderr=subprocess.STDOUT, text=True, env=cli_env(RPYCDL_GPUS="fake:3x8GiB",
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


# -- the first hour of a new user (issue 13) ---------------------------------------------------


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed on stderr: no traceback, nothing else."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_version():
    result = rpycdl_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"rpycdl {rpycdl.__version__} (Python {platform.python_version()})"


def test_verbose_is_taken_after_the_subcommand_too(tmp_path, lock_dir):
    parser = cli.parser()
    for argv in (["-v", "status"], ["status", "-v"], ["status", "--verbose", "pytorch"], ["run", "pytorch", "-v"],
                 ["certs", "ca", str(tmp_path), "-v"], ["up", "jax", "-v"], ["serve", "--service", "x", "-v"]):
        assert parser.parse_args(argv).verbose is True, argv
    assert parser.parse_args(["status"]).verbose is False
    # and it does what it says: a server logs at INFO
    process = subprocess.Popen([sys.executable, "-m", "rpycdl", "serve", "--service", "pytorch", "--gpus", "fake:1",
                                "--port", "0", "--registry", "none", "--lock-dir", lock_dir, "-v"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=cli_env(PYTHONUNBUFFERED="1"))
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(3)]
        assert any(" INFO " in line for line in lines), lines
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:  # not this test's business, but leave nothing behind
            process.kill()
            process.wait()


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str,
                                                                                             argparse.ArgumentParser]]:
    """(path, help line, parser) of every subcommand and sub-subcommand."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append(((*path, name), lines.get(name), sub))
                found.extend(_subcommands(sub, (*path, name)))
    return found


def test_every_subcommand_and_sub_subcommand_has_a_description():
    found = _subcommands(cli.parser())
    assert {" ".join(path) for path, _, _ in found} >= {*SUBCOMMANDS, "up", "down", "certs ca", "certs server",
                                                        "certs user"}
    for path, line, parser in found:
        assert line, f"rpycdl {' '.join(path)} has no line in its parent's --help"
        assert parser.description and len(parser.description) > len(line), f"rpycdl {' '.join(path)}"
        shown = " ".join(parser.format_help().split())
        assert " ".join(parser.description.split()) in shown, f"rpycdl {' '.join(path)} --help"


def test_sizes_in_help_and_status_are_in_words(server, connect, tmp_path):
    shown = " ".join(rpycdl_cli("serve", "--help").stdout.split())
    assert "at least 1 MiB (default: 8 GiB)" in shown and "watchdog stops it (default: 1 GiB)" in shown
    assert "8589934592" not in shown and "1073741824" not in shown

    port = server("pytorch", "fake:1x16GiB")
    gate = str(tmp_path / "gate")
    share = Background(connect(port), gate_job(gate), "share", gpu_memory="512MiB")
    share.wait_state("running")
    whole = Background(connect(port), gate_job(gate), "whole", ngpus=1)
    whole.wait_state("pending")
    later = Background(connect(port), gate_job(gate), "later", gpu_memory="4GiB")
    later.wait_state("pending")
    at = ["--host", "127.0.0.1", "--port", str(port)]
    status = rpycdl_cli("status", *at).stdout
    assert "0 B / 16 GiB" in status and "shared: 512 MiB of 16 GiB granted to 1 job(s)" in status, status
    assert f"512 MiB: job {share.job_id}" in status
    assert f"job {whole.job_id} of {ME} wants 1 GPU" in status and f"job {later.job_id} of {ME} wants 4 GiB" \
        " of one GPU" in status, status
    jobs = {line.split()[0]: line for line in rpycdl_cli("jobs", *at).stdout.splitlines()[1:]}
    assert "512 MiB of one GPU" in jobs[share.job_id] and "4 GiB of one GPU" in jobs[later.job_id], jobs
    open_gate(gate)
    for job in (share, whole, later):
        job.result()


def test_status_and_jobs_exit_1_when_a_server_is_unreachable(cluster):
    _, live = cluster.add_server("pytorch", "fake:1")
    dead, gone = cluster.add_server("pytorch", "fake:1")
    dead.popen.kill()
    dead.popen.wait()

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", gone), timeout=1).close()
        except OSError:
            return True
        return False

    wait_until(refused, 5, "the killed server's port to refuse connections")  # the registry still lists it
    for args in (["status"], ["status", "--json"], ["jobs"], ["jobs", "--json"]):
        result = rpycdl_cli(*args, "--registry", cluster.registry_address)
        assert result.returncode == 1, (args, result.stderr)
        assert f"1 of 2 server(s) could not be reached: 127.0.0.1:{gone}" in result.stderr
        assert str(live) in result.stdout or args[0] == "jobs"  # a job table names no server
        if "--json" in args:
            json.loads(result.stdout)


def test_with_no_registry_clients_say_none_answered_where_and_what_to_do():
    address = f"127.0.0.1:{_free_udp_port()}"  # nothing listens there
    with pytest.raises(rpycdl.DiscoveryError) as info:
        rpycdl.connect("pytorch", registry_address=address)
    message = str(info.value)
    assert f"no registry answered at udp {address}" in message and "may not be running" in message
    assert "`rpycdl registry`" in message and "host=" in message and "--registry" in message
    for args in (["status", "--registry", address], ["run", "pytorch", "--registry", address, "--", "true"]):
        result = rpycdl_cli(*args)
        assert result.returncode == 1, result.stderr
        line = _one_line(result)
        assert f"no registry answered at udp {address}" in line and "`rpycdl registry`" in line
        assert "--host" in line


def test_a_registry_host_that_does_not_resolve_is_one_clear_line():
    with pytest.raises(rpycdl.DiscoveryError, match="cannot find the registry's host 'no-such-registry.invalid'"):
        rpycdl.connect("pytorch", registry_address="no-such-registry.invalid:18811")
    result = rpycdl_cli("status", "--registry", "no-such-registry.invalid")
    assert result.returncode == 1
    assert "cannot find the registry's host 'no-such-registry.invalid'" in _one_line(result)


def test_a_registry_that_knows_no_such_server_says_so(cluster):
    with pytest.raises(rpycdl.DiscoveryError, match=rf"the registry \(udp {cluster.registry_address}\) knows no "
                                                    "server of 'PYTORCH': start one"):
        rpycdl.connect("pytorch", registry_address=cluster.registry_address)


@pytest.fixture
def taken_port():
    """A TCP port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("case", ["port in use", "lock directory is a file", "lock directory under a file",
                                  "lock directory not writable", "state directory is a file",
                                  "state directory under a file", "state directory not writable",
                                  "registry host unknown", "host unknown"])
def test_serve_start_failures_are_one_line_saying_what_to_do(case, taken_port, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes in any directory of ours: sysfs refuses even root
        read_only = Path("/sys")
    extra, expected = {
        "port in use": (["--port", str(taken_port)], f"127.0.0.1:{taken_port}: the port is in use"),
        "lock directory is a file": (["--lock-dir", str(a_file)], f"cannot use the lock directory {a_file}"),
        "lock directory under a file": (["--lock-dir", str(a_file / "locks")], "cannot use the lock directory"),
        "lock directory not writable": (["--lock-dir", str(read_only / "locks")], "cannot use the lock directory"),
        "state directory is a file": (["--state-dir", str(a_file)], f"cannot use the state directory {a_file}"),
        "state directory under a file": (["--state-dir", str(a_file / "state")], "cannot use the state directory"),
        "state directory not writable": (["--state-dir", str(read_only / "state")], "cannot use the state directory"),
        "registry host unknown": (["--registry", "no-such-registry.invalid"], "cannot find the registry's host"),
        "host unknown": (["--host", "no-such-host.invalid", "--insecure"], "a host name of this machine"),
    }[case]
    result = rpycdl_cli("serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none",
                        "--lock-dir", str(tmp_path / "locks"), *extra, timeout=20)
    assert result.returncode == 1, result.stderr
    line = _one_line(result)
    assert line.startswith("rpycdl serve: ") and expected in line, line
    if "lock directory" in case:
        assert "chmod 1777" in line and "--lock-dir" in line
    if "state directory" in case:
        assert "make it a directory the servers may write" in line and "--state-dir" in line
    if case == "port in use":
        assert "--port" in line


@pytest.mark.parametrize(("flags", "expected"), [
    (["--secret-file", "/no/such/secret"], "cannot read the secret file /no/such/secret: No such file or directory: "
                                           "give the path of a file holding the secret"),
    (["--tls-cert", "/no/such.crt", "--tls-key", "/no/such.key", "--tls-ca", "/no/ca.crt"],
     "the certificate file /no/such.crt does not exist: give the path of the file `rpycdl certs` made"),
])
def test_serve_with_unusable_credential_files_is_a_start_failure_saying_what_to_do(flags, expected, lock_dir):
    result = rpycdl_cli("serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none",
                        "--lock-dir", lock_dir, *flags, timeout=20)
    assert result.returncode == 1 and expected in _one_line(result), result.stderr


def test_run_exit_codes_tell_what_happened(server, connect, tmp_path):
    port = server("pytorch", "fake:1")
    at = ["--host", "127.0.0.1", "--port", str(port)]
    timed_out = rpycdl_cli("run", "pytorch", *at, "--timeout", "0.5", "--", "sleep", "30")
    assert timed_out.returncode == EXIT_JOB_TIMEOUT == 124, timed_out.stderr
    crashed = rpycdl_cli("run", "pytorch", *at, "--", "sh", "-c", "kill -9 $PPID; sleep 5")  # kills the job process
    assert crashed.returncode == 1 and "signal 9" in crashed.stderr, crashed.stderr
    usage = rpycdl_cli("run", "pytorch", *at, "--ngpus", "3", "--", "true")
    assert usage.returncode == 2 and "has 1" in usage.stderr, usage.stderr
    assert rpycdl_cli("run", "pytorch", *at, "--", "sh", "-c", "exit 7").returncode == 7
    gate = str(tmp_path / "gate")
    holder = Background(connect(port), gate_job(gate), None, ngpus=1)
    holder.wait_state("running")
    queued = rpycdl_cli("run", "pytorch", *at, "--queue-timeout", "0.3", "--", "true")
    assert queued.returncode == EXIT_QUEUE_TIMEOUT == 75, queued.stderr
    open_gate(gate)
    holder.result()
    described = " ".join(rpycdl_cli("run", "--help").stdout.split())
    for code in ("1 the job failed", "2 usage error", "75 queue timeout", "124 job timeout", "130 interrupted"):
        assert code in described, code


def _interrupt(args: list[str], ready: Callable[[str, int], bool]) -> subprocess.CompletedProcess[str]:
    """Run `rpycdl ARGS` in a process group of its own, as a shell runs it, and press Ctrl-C (SIGINT to the
    whole group) once `ready(output so far, its pid)`."""
    process = subprocess.Popen([sys.executable, "-m", "rpycdl", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env=cli_env(PYTHONUNBUFFERED="1"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        wait_until(lambda: ready("".join(lines), process.pid), 20, f"rpycdl {args[0]} to be ready: {''.join(lines)}")
        os.killpg(process.pid, signal.SIGINT)
        process.wait(20)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    reader.join(5)
    return subprocess.CompletedProcess(process.args, process.returncode, "".join(lines), "")


def _spares_ready(pid: int) -> bool:
    """Whether a server has forked its spare connection processes and its forkserver their spare jobs (a
    Ctrl-C in the middle of a fork is the server's own business)."""
    forking = [child for child in children(pid) if comm(child) == "rpycdl-forksrv"]
    return len(spare_processes(pid)) == 2 and len(forking) == 1 and len(kept_jobs(forking[0])) == 2


def test_ctrl_c_prints_one_line_in_every_long_running_subcommand(server, connect, lock_dir):
    port = server("pytorch", "fake:1")
    run = _interrupt(["run", "pytorch", "--host", "127.0.0.1", "--port", str(port), "--", "sleep", "60"],
                     lambda out, _: "runs on GPU" in out)
    assert run.returncode == 130 and "Traceback" not in run.stdout, run.stdout
    assert run.stdout.splitlines()[-1] == "rpycdl run: interrupted: the job is cancelled"
    wait_until(lambda: connect(port).root.jobs()[0]["state"] == "CANCELLED", 5, "the job to be cancelled")

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a registry that never answers
    silent.bind(("127.0.0.1", 0))
    asked = threading.Event()
    threading.Thread(target=lambda: (silent.recvfrom(4096), asked.set()), daemon=True).start()
    status = _interrupt(["status", "--registry", f"127.0.0.1:{silent.getsockname()[1]}"],
                        lambda *_: asked.is_set())
    silent.close()
    assert status.returncode == 130 and status.stdout.strip() == "rpycdl status: interrupted", status.stdout

    served = _interrupt(["serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none",
                         "--lock-dir", lock_dir, *one_account()], lambda _, pid: _spares_ready(pid))
    assert served.returncode == 0 and "Traceback" not in served.stdout and "interrupt" not in served.stdout
    assert served.stdout.strip().splitlines()[-1] == "rpycdl serve: stopped", served.stdout

    registry = _interrupt(["registry", "--host", "127.0.0.1", "--port", str(_free_udp_port())],
                          lambda out, _: "listening" in out)
    assert registry.returncode == 0 and "Traceback" not in registry.stdout and "nterrupt" not in registry.stdout
    assert registry.stdout.strip().splitlines()[-1] == "rpycdl registry: stopped", registry.stdout
