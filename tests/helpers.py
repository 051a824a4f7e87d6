"""Helpers shared by the functional tests: jobs run in background threads, gates, waiting, the `rpycdl`
command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import rpycdl
from rpycdl.scheduler.ledger import Ledger


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without the RPYCDL_ variables of whoever runs the tests (but RPYCDL_CONFIG and
    RPYCDL_MANIFESTS, set by the tests), with `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RPYCDL_") or k in ("RPYCDL_CONFIG", "RPYCDL_MANIFESTS")}
    return {**env, **extra}


def rpycdl_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run `python -m rpycdl ARGS` (in cli_env() unless `env` is given) to its end; its output as text."""
    return subprocess.run([sys.executable, "-m", "rpycdl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env())


def unavailable(reason: str, ci_needs: str) -> None:
    """Skip a test whose tool (a Docker engine, a browser, kustomize) is not here, with `reason`; under CI
    (the variable CI set, as .ci/run does), fail it instead, saying what CI must provide."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must {ci_needs}", pytrace=False)
    pytest.skip(reason)


ACCOUNTS = {"alice": "rpycdl-alice", "bob": "rpycdl-bob", "carol": "rpycdl-carol"}
"""Identities of the team's certificates (the `team` fixture), and the Unix accounts a user map gives them (the
`accounts` fixture makes them)."""

MONITOR_ACCOUNT = "rpycdl-watch"
"""The account a monitor runs as on a host of root servers, and the group of their lock directory (the
`monitor_account` fixture makes both), as docs/monitor.md tells an operator to."""


def monitored_lock_dir(path: Path, gid: int) -> Path:
    """Make `path` a lock directory of root servers that the group `gid` (a monitor's) reads, as docs/monitor.md
    says (`install -d -m 2751 -g GROUP PATH`); returns it."""
    path.mkdir()
    os.chown(path, 0, gid)
    path.chmod(0o2751)
    return path


def write_user_map(path: Path) -> Path:
    """A `--user-map` file at `path` that maps each identity of ACCOUNTS to its account; returns `path`."""
    path.write_text("[accounts]\n" + "".join(f'{identity} = "{account}"\n' for identity, account in ACCOUNTS.items()))
    return path


def wait_until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail the test once a look begun `timeout` seconds
    after the start still finds it false (a look that a busy machine made slow judges the moment it began)."""
    deadline = time.monotonic() + timeout
    while True:
        began = time.monotonic()
        value = condition()
        if value:
            return value
        if began > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def seen_at(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
            clock: Callable[[], float] = time.time) -> float:
    """wait_until(condition, timeout, what); returns when (by `clock`) the look that found it true began: what
    that look saw was so by then, however long a busy machine made the look take."""

    def look() -> float | None:
        began = clock()
        return began if condition() else None

    return wait_until(look, timeout, what)


def idle(conn: rpycdl.Connection) -> bool:
    """Whether none of the server's GPUs is held and nobody waits."""
    status = conn.root.gpu_status()
    return all(not gpu["holders"] for gpu in status["gpus"]) and not status["queue"]


def wait_idle(conn: rpycdl.Connection, timeout: float = 1.0) -> None:
    """Wait until the server is idle. A job's reply goes out before its GPUs are released, which
    promise 3 bounds by a second, so a check made over another connection than the job's must
    allow for that."""
    wait_until(lambda: idle(conn), timeout, "every GPU to be free and the queue empty")


def granted_at(lock_dir: str, job_id: str) -> float:
    """When a job was granted its GPUs, by its server's clock (time.time(): its ledger row's start), for
    promise 3's bound: the moment a GPU went to the next job, not when that job's code began to run."""
    ledger = Ledger(Path(lock_dir, "state"))
    try:
        record = ledger.get(job_id)
    finally:
        ledger.close()
    assert record is not None and record.started is not None, f"job {job_id} was never granted: {record}"
    return record.started


def gate_job(gate: str) -> Callable[[Any], Any]:
    """A job that blocks until the file `gate` exists (the test creates it), then returns its args."""

    def job(args):
        import os
        import time

        while not os.path.exists(gate):
            time.sleep(0.01)
        return args

    return job


def _make_talker() -> Callable[[dict[str, Any]], Any]:
    """A job (made in a function, so that dill sends it by value) that prints `lines` numbered lines,
    leaves a file started-PID in `dir`, waits for the file `gate` if given, prints "done", and raises
    ValueError(`raise`) if given, else returns `value`."""

    def talker(args: dict[str, Any]) -> Any:
        import os
        import time

        for number in range(args.get("lines", 0)):
            print(f"line {number}", flush=True)
        open(os.path.join(args["dir"], f"started-{os.getpid()}"), "w").close()
        while args.get("gate") and not os.path.exists(args["gate"]):
            time.sleep(0.01)
        print("done", flush=True)
        if args.get("raise"):
            raise ValueError(args["raise"])
        return args.get("value")

    return talker


TALKER = _make_talker()


class Background:
    """run_code in a thread of its own, recording the job's states, value or exception.

    Attributes:
        states: (state, info) pairs in the order the server reported them.
        value, error: what run_code returned or raised, once `done`.
    """

    def __init__(self, conn: rpycdl.Connection, fn: Any, args: Any = None, **kwargs: Any) -> None:
        self.conn = conn
        self.states: list[tuple[str, dict[str, Any]]] = []
        self.value: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, args: Any, kwargs: dict[str, Any]) -> None:
        try:
            self.value = self.conn.root.run_code(fn, args, on_state=self._on_state, **kwargs)
        except BaseException as exc:  # noqa: B036 - recorded for the test to check
            self.error = exc

    def _on_state(self, state: str, info: dict[str, Any]) -> None:
        self.states.append((state, info))

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def job_id(self) -> str | None:
        return self.states[0][1]["job_id"] if self.states else None

    def wait_state(self, state: str, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until the server reports `state` ("pending" or "running"); returns its info."""

        def seen() -> dict[str, Any] | None:
            if self.done and not any(s == state for s, _ in self.states):
                raise AssertionError(f"the job ended ({self.error!r}) before it was {state}")
            return next((info for s, info in self.states if s == state), None)

        return wait_until(seen, timeout, f"the job to be {state}")

    def join(self, timeout: float = 15.0) -> Background:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"the job did not end within {timeout} s")
        return self

    def result(self, timeout: float = 15.0) -> Any:
        """The job's value; re-raises its exception."""
        self.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value


def open_gate(gate: str) -> None:
    Path(gate).touch()


def refusal(call: Callable[[], Any], limit: float = 120.0) -> BaseException | None:
    """Run `call` in a thread; return what it raised (None if it returned).

    For a request that must be refused rather than wait: the tests call it while what the request would wait
    for stays taken (a held GPU, open connections), so a request that waits instead never ends on its own, and
    the test fails after `limit` seconds (generous, so that a slow machine's refusal still counts as one; how
    fast a refusal is belongs to the benchmarks)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: B036 - returned to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        raise AssertionError(f"the call was still running after {limit} s: it waits instead of being refused")
    return outcome.get("error")


@dataclass(frozen=True)
class Team:
    """The files of a CA directory made by `rpycdl certs` (see the `team` fixture)."""

    dir: str

    def server_args(self, host: str = "localhost") -> list[str]:
        """`rpycdl serve` flags for mutual TLS with the certificate of `host`."""
        return ["--tls-cert", f"{self.dir}/server-{host}.crt", "--tls-key", f"{self.dir}/server-{host}.key",
                "--tls-ca", f"{self.dir}/ca.crt"]

    def user(self, name: str) -> dict[str, str]:
        """rpycdl.connect() keyword arguments for user `name`."""
        return {"tls_cert": f"{self.dir}/user-{name}.crt", "tls_key": f"{self.dir}/user-{name}.key",
                "tls_ca": f"{self.dir}/ca.crt"}


def connection_processes(server_pid: int) -> list[int]:
    """The live children of a server process serving clients (its connection processes, and jobs
    they left), not the spares waiting for a client (nor those just forked, still named as the
    server), nor its forkserver."""
    return [pid for pid in children(server_pid) if comm(pid) not in ("rpycdl-spare", "rpycdl-server",
                                                                     "rpycdl-forksrv")]


def spare_processes(server_pid: int) -> list[int]:
    """The server's connection processes forked ahead, waiting for a client."""
    return [pid for pid in children(server_pid) if comm(pid) == "rpycdl-spare"]


def forkserver(server_pid: int) -> int:
    """The server's job forkserver (rpycdl.server.forkserver), the parent of the keeper of every job process of its
    connections."""
    return wait_until(lambda: next((pid for pid in children(server_pid) if comm(pid) == "rpycdl-forksrv"), None),
                      what="the server's forkserver")


def kept_jobs(forkserver_pid: int) -> list[int]:
    """The job processes a forkserver's keepers keep (rpycdl.server.keeper: one each)."""
    return [job for keeper in children(forkserver_pid) if comm(keeper) == "rpycdl-keeper" for job in children(keeper)]


def children(pid: int) -> list[int]:
    """The live (not zombie) children of a process; none if it is gone (it may end while a tree is walked)."""
    try:
        listed = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    return [int(child) for child in listed if running(int(child))]


def running(pid: int) -> bool:
    """Whether a process runs: a zombie, dead but not yet reaped, does not; nor one that ends
    while its /proc entry is read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def comm(pid: int) -> str:
    """A process's name (/proc/PID/comm), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def server_process(cluster: Any, port: int) -> Any:
    """The cluster's server on `port` (a rpycdl.site.local.Process: its popen, its output lines)."""
    for process in cluster.processes:
        if any(f"127.0.0.1:{port} as" in line for line in process.lines):
            return process
    raise AssertionError(f"no server on port {port}")


def server_pid(cluster: Any, port: int) -> int:
    """The pid of the cluster's server on `port`."""
    return server_process(cluster, port).popen.pid



def scrape(base: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the monitor at `base`'s /metrics by name: (labels, value) pairs."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples
