"""Each running job has a process of its own (its keeper, or a detached job's supervisor) that outlives every shared
one: kill -9 of the job forkserver, of the server parent, of the spares, of the registry or of the monitor ends no
running job of any kind, and a double fault (the server parent, then a job's own processes) leaves nothing of the
job holding its GPUs past a second after the next server start. Real registry, servers and clients on loopback."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    comm,
    forkserver,
    granted_at,
    kept_jobs,
    running,
    server_pid,
    spare_processes,
    wait_until,
)

import rpycdl
from rpycdl.scheduler import procs
from rpycdl.site.local import start

GRACE = 1.0  # promise 3: free again within a second


def _make_job() -> Callable[[dict[str, Any]], Any]:
    """A job that starts a child of its own in a session of its own (as a daemon would: only its environment
    names the job), writes who it is to args["dir"]/NAME.json,
    and returns once args["dir"]/release exists, saying whether its child still ran."""

    def job(args: dict[str, Any]) -> Any:
        import json
        import os
        import subprocess
        import time

        child = subprocess.Popen(["sleep", "120"], start_new_session=True)  # out of the job's group and session
        info = {"pid": os.getpid(), "ppid": os.getppid(), "child": child.pid, "job_id": os.environ["RPYCDL_JOB_ID"]}
        path = os.path.join(args["dir"], args["name"] + ".json")
        with open(path + ".tmp", "w") as f:
            json.dump(info, f)
        os.replace(path + ".tmp", path)
        while not os.path.exists(os.path.join(args["dir"], "release")):
            time.sleep(0.02)
        alive = child.poll() is None
        child.kill()
        child.wait()
        return {"name": args["name"], "pid": os.getpid(), "child_lived": alive}

    return job


JOB = _make_job()
KINDS = ("attached", "detached", "session")


class Running:
    """One job of each kind on a server, each holding one GPU, running until `release()`."""

    def __init__(self, connect: Callable[[int], rpycdl.Connection], port: int, directory: Path) -> None:
        self.directory = directory
        self.values: dict[str, Any] = {}
        self._threads = [threading.Thread(target=self._attached, args=(connect(port),), daemon=True),
                         threading.Thread(target=self._session, args=(connect(port),), daemon=True)]
        for thread in self._threads:
            thread.start()
        self._detached = connect(port).root.submit(JOB, self._args("detached"), ngpus=1)
        self.info = {kind: wait_until(lambda kind=kind: self._read(kind), 20, f"the {kind} job to start")
                     for kind in KINDS}

    def _args(self, name: str) -> dict[str, str]:
        return {"dir": str(self.directory), "name": name}

    def _read(self, kind: str) -> dict[str, Any] | None:
        path = self.directory / f"{kind}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _outcome(self, kind: str, call: Callable[[], Any]) -> None:
        try:
            self.values[kind] = call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.values[kind] = exc

    def _attached(self, conn: rpycdl.Connection) -> None:
        self._outcome("attached", lambda: conn.root.run_code(JOB, self._args("attached"), ngpus=1))

    def _session(self, conn: rpycdl.Connection) -> None:
        def call() -> Any:
            with conn.root.session(ngpus=1) as session:
                return session.run(JOB, self._args("session"))

        self._outcome("session", call)

    def release(self) -> dict[str, Any]:
        """Let every job return; the value (or exception) of each."""
        (self.directory / "release").touch()
        for thread in self._threads:
            thread.join(30)
        self._outcome("detached", lambda: self._detached.result(timeout=30))
        return self.values


def _spares(server: int) -> list[int]:
    """The server's spare connection processes and the spare job processes kept for them."""
    return [*spare_processes(server), *kept_jobs(forkserver(server))]


@pytest.mark.parametrize("victim", ["forkserver", "server", "server, then forkserver", "spares",
                                    "registry and monitor"])
def test_kill_9_of_a_shared_process_ends_no_running_job(cluster, server, connect, tmp_path, victim):
    port = server("pytorch", "fake:4")
    parent = server_pid(cluster, port)
    monitor = start(["monitor", "--gpus", "fake:4", "--lock-dir", cluster.lock_dir, "--port", "0"])
    monitor.wait_for(r"on http://127\.0\.0\.1:(\d+)/metrics")
    jobs = Running(connect, port, tmp_path)
    own = {kind: info["pid"] for kind, info in jobs.info.items()}
    assert comm(jobs.info["attached"]["ppid"]) == comm(jobs.info["session"]["ppid"]) == "rpycdl-keeper"
    assert comm(jobs.info["detached"]["ppid"]) == "rpycdl-superv"
    assert procs.stat(jobs.info["detached"]["ppid"]).ppid == forkserver(parent)  # forked by it, warm
    doomed = {"forkserver": lambda: [forkserver(parent)], "server": lambda: [parent],
              "server, then forkserver": lambda: [parent, forkserver(parent)],
              "spares": lambda: [pid for pid in _spares(parent) if pid not in own.values()],
              "registry and monitor": lambda: [cluster.registry.popen.pid, monitor.popen.pid]}[victim]()
    assert doomed and not set(doomed) & set(own.values())
    procs.kill(doomed)
    wait_until(lambda: not any(running(pid) for pid in doomed), 5, f"the {victim} to die")
    time.sleep(0.5)  # what would die with them has had time to
    values = jobs.release()
    monitor.stop()
    for kind in KINDS:
        value = values.get(kind)
        assert isinstance(value, dict), f"the {kind} job did not run to its value after kill -9 of the {victim}: " \
                                        f"{value!r}"
        assert value == {"name": kind, "pid": own[kind], "child_lived": True}


def _holder(connect: Callable[[int], rpycdl.Connection], port: int, directory: Path) -> tuple[threading.Thread,
                                                                                               dict[str, Any]]:
    """An attached job on both GPUs of a fake:2 server, its child started; its info once it runs."""
    conn = connect(port)
    thread = threading.Thread(target=lambda: _swallow(lambda: conn.root.run_code(
        JOB, {"dir": str(directory), "name": "holder"}, ngpus=2)), daemon=True)
    thread.start()
    path = directory / "holder.json"
    wait_until(path.exists, 20, "the holder to start")
    return thread, json.loads(path.read_text())


def _swallow(call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException:  # noqa: BLE001, S110 - its connection dies in these tests, as planned
        pass


@pytest.mark.parametrize("second", ["job process", "forkserver and keeper", "keeper and connection"])
def test_a_double_fault_frees_the_gpus_within_a_second_of_the_next_server_start(cluster, connect, tmp_path,
                                                                                 second):
    """kill -9 of the server parent, then, while no server runs, of the job's own processes (its job process;
    or the orphaned forkserver and then its keeper, the connection process noticing; or its connection process
    too): the child the job started is killed, and the next server grants the GPUs within a second of its start
    at the latest."""
    _, old_port = cluster.add_server("pytorch", "fake:2")
    old = server_pid(cluster, old_port)
    _, info = _holder(connect, old_port, tmp_path)
    connection = connect(old_port).root.job(info["job_id"]).info["owner_pid"]
    assert comm(connection) == "rpycdl-conn"
    orphaned_forkserver = forkserver(old)
    os.kill(old, signal.SIGKILL)
    doomed = {"job process": [info["pid"]], "forkserver and keeper": [orphaned_forkserver, info["ppid"]],
              "keeper and connection": [orphaned_forkserver, info["ppid"], connection]}[second]
    for pid in doomed:  # with the forkserver dead too, what the job left is adopted by no rpycdl process
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not running(info["pid"]), 5, "the job process to die")
    _, new_port = cluster.add_server("pytorch", "fake:2")
    started = time.time()
    waiting = connect(new_port).root.submit(lambda _: 1, ngpus=2)
    assert waiting.result(timeout=20) == 1
    granted = granted_at(cluster.lock_dir, waiting.id)
    assert granted - started < GRACE, f"granted {granted - started:.2f} s after the next server started"
    assert not running(info["child"]), "the child of the dead job outlived it"
