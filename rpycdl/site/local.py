"""A registry and servers on loopback in subprocesses: the embedded default of `rpycdl demo`, and
what the tests start."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rpycdl import registry
from rpycdl.defaults import KILL_WAIT, STATE_SUBDIR, SUPERVISOR_NAME
from rpycdl.errors import RpycdlError
from rpycdl.scheduler import procs
from rpycdl.scheduler.ledger import Ledger

READY_TIMEOUT = 30.0


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Process:
    """A child process running an rpycdl command, with the lines it printed."""

    argv: list[str]
    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    echo: bool = False

    def pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.echo:
                print(f"  | {line}", end="", file=sys.stderr, flush=True)

    def wait_for(self, pattern: str, timeout: float = READY_TIMEOUT) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.02)
        raise RpycdlError(f"{' '.join(self.argv[2:])} did not start: " + " / ".join(self.lines[-10:]))

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def one_account() -> list[str]:
    """`rpycdl serve` flags that run every job as the server's account, as a demo or a test of one user
    expects: `--one-account` where this process is root (which would run each job as its owner's), none
    elsewhere."""
    return ["--one-account"] if os.geteuid() == 0 else []


def stop_supervisors(state_dir: str) -> list[str]:
    """Kill the supervisors of the unfinished detached jobs of `state_dir` (as its ledger names them), and
    everything their jobs run; returns the jobs' ids (their rows say LOST once a server sweeps)."""
    if not os.path.isfile(os.path.join(state_dir, Ledger.FILE)):
        return []
    stopped = []
    for record in Ledger(state_dir, read_only=True).unfinished():
        owner = (record.owner_pid, record.owner_start)
        if record.detached and procs.alive(*owner) and procs.named(record.owner_pid, SUPERVISOR_NAME):
            procs.kill([record.owner_pid])
            procs.kill_until_gone(lambda job_id=record.job_id: procs.job_processes(job_id), KILL_WAIT)
            stopped.append(record.job_id)
    return stopped


def start(args: Sequence[str], env: dict[str, str] | None = None, echo: bool = False) -> Process:
    """Start `python -m rpycdl ARGS` in a session of its own (Ctrl-C at a terminal reaches the caller, which
    stops it) and collect its output in the background."""
    argv = [sys.executable, "-m", "rpycdl", *args]
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    process = Process(argv, popen, echo=echo)
    threading.Thread(target=process.pump, daemon=True).start()
    return process


class LocalCluster:
    """A registry on a free loopback port and servers registered with it.

    Args:
        lock_dir: the lock directory every server shares.
        echo: copy the processes' output to stderr.
    """

    def __init__(self, lock_dir: str, echo: bool = False) -> None:
        self.lock_dir = lock_dir
        self.echo = echo
        self.registry_port = free_udp_port()
        self.registry_address = f"127.0.0.1:{self.registry_port}"
        self.processes: list[Process] = []
        self.state_dirs = {os.path.join(lock_dir, STATE_SUBDIR)}
        self.registry = self._start(["registry", "--host", "127.0.0.1", "--port", str(self.registry_port)])
        self.registry.wait_for(r"listening")

    def _start(self, args: list[str], env: dict[str, str] | None = None) -> Process:
        process = start(args, env, echo=self.echo)
        self.processes.append(process)
        return process

    def add_server(self, service: str, inventory: str | None, *extra: str, lock_dir: str | None = None,
                   isolated: bool = False, env: dict[str, str] | None = None) -> tuple[Process, int]:
        """Start a server of `service` on a free loopback port (with a lock directory of its own, as a
        server of another host has, if `lock_dir` is given); returns it and its port. Started as root, it
        runs every job as root (--one-account), as the demo's one user expects, unless `isolated`: then each
        job runs as its owner's account (rpycdl.security.accounts). `env`: variables it gets beside this
        process's."""
        lock_dir = lock_dir or self.lock_dir
        args = ["serve", "--service", service, "--host", "127.0.0.1", "--port", "0",
                "--registry", self.registry_address, "--lock-dir", lock_dir, *([] if isolated else one_account()),
                *extra]
        if inventory:
            args += ["--gpus", inventory]
        self.state_dirs.add(extra[extra.index("--state-dir") + 1] if "--state-dir" in extra
                            else os.path.join(lock_dir, STATE_SUBDIR))
        process = self._start(args, env)
        port = int(process.wait_for(r"on 127\.0\.0\.1:(\d+) as").group(1))
        deadline = time.monotonic() + READY_TIMEOUT
        while ("127.0.0.1", port) not in registry.discover(service, self.registry_address):
            if time.monotonic() > deadline or process.popen.poll() is not None:
                raise RpycdlError(f"server {service} on port {port} never registered: " + " / ".join(process.lines))
            time.sleep(0.05)
        return process, port

    def add_monitor(self, inventory: str | None) -> tuple[Process, str]:
        """Start `rpycdl monitor` of the lock directory on a free loopback port; returns it and its URL."""
        process = self._start(["monitor", "--lock-dir", self.lock_dir, "--port", "0",
                               *(["--gpus", inventory] if inventory else [])])
        return process, process.wait_for(r"on (http://127\.0\.0\.1:\d+)/metrics").group(1)

    def close(self) -> None:
        """Stop the servers and the registry, and the detached jobs of their state directories, which
        would outlive them."""
        for process in reversed(self.processes):
            process.stop()
        for state_dir in self.state_dirs:
            stop_supervisors(state_dir)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
