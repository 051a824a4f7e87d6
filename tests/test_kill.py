"""Promise 3, nothing leaks: however a job ends, its GPUs are free again within a second and
none of its processes still runs. Real registry, server and clients on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helpers
import pytest
from helpers import granted_at, idle, running

import rpycdl
from rpycdl.scheduler import procs

GRACE = 1.0  # promise 3: free again within a second


def _make_job() -> Callable[[dict[str, Any]], Any]:
    """The job every test runs (defined in a function so dill sends its code, not a reference).

    It starts `sleep 60`, writes its own pid, its parent's (its keeper) and the parent's name, the
    child's and its job id to args["dir"]/info.json, then ends as args["how"] says."""

    def job(args: dict[str, Any]) -> Any:
        import json
        import os
        import subprocess
        import time

        child = subprocess.Popen(["sleep", "60"])
        with open(f"/proc/{os.getppid()}/comm") as comm:
            parent = comm.read().strip()
        info = {"pid": os.getpid(), "ppid": os.getppid(), "parent": parent, "child": child.pid,
                "job_id": os.environ["RPYCDL_JOB_ID"], "uuids": os.environ["RPYCDL_GPU_UUIDS"].split(",")}
        tmp = os.path.join(args["dir"], ".info.json")
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, os.path.join(args["dir"], "info.json"))
        if args["how"] == "return":
            return info
        if args["how"] == "raise":
            raise RuntimeError("the job failed on purpose")
        if args["how"] == "until_file":
            while not os.path.exists(os.path.join(args["dir"], "release")):
                time.sleep(0.02)
            return info
        time.sleep(60)
        return info

    return job


JOB = _make_job()

CLIENT = """
import sys
import rpycdl

def job(args):
    import json, os, subprocess, time
    child = subprocess.Popen(["sleep", "60"])
    info = {"pid": os.getpid(), "ppid": os.getppid(), "child": child.pid, "job_id": os.environ["RPYCDL_JOB_ID"]}
    with open(os.path.join(args["dir"], ".info.json"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(args["dir"], ".info.json"), os.path.join(args["dir"], "info.json"))
    time.sleep(60)

port, directory, ngpus = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
conn = rpycdl.connect(host="127.0.0.1", port=port)
print("connected", flush=True)
conn.root.run_code(job, {"dir": directory}, ngpus=ngpus)
"""


# -- helpers --------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    """True when no process `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    return not running(pid)


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return predicate()
        time.sleep(0.01)


def read_info(directory: Path, timeout: float = 20) -> dict[str, Any]:
    path = directory / "info.json"
    assert wait_until(path.exists, timeout), "the job never started"
    return json.loads(path.read_text())


def connection_of(conn: rpycdl.Connection, job_id: str) -> int:
    """The connection process that owns an attached job (its ledger row's owner)."""
    return conn.root.job(job_id).info["owner_pid"]


class Background:
    """run_code in a thread of this process; the outcome (value or exception) in .result."""

    def __init__(self, conn: rpycdl.Connection, *args: Any, **kwargs: Any) -> None:
        self.result: Any = None
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._run, args=(conn, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, conn: rpycdl.Connection, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            self.result = conn.root.run_code(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            self.result = exc
        self.ended = time.time()

    def join(self, timeout: float = 20) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "run_code did not return"
        return self.result


def assert_nothing_leaks(port: int, connect, pids: dict[str, int], ended: float) -> None:
    """Within GRACE seconds of `ended`: every GPU free, the queue empty, every pid gone."""
    status_conn = connect(port)  # a fresh connection: the job's own may be dead

    def clean() -> bool:
        return idle(status_conn) and all(gone(pid) for pid in pids.values())

    wait_until(clean, max(0.0, ended + GRACE - time.time()))
    status = status_conn.root.gpu_status()
    took = time.time() - ended
    holders = [gpu["holders"] for gpu in status["gpus"]]
    assert holders == [[]] * len(holders), f"GPUs still held {took:.2f} s after the end"
    assert status["queue"] == []
    still = {name: pid for name, pid in pids.items() if not gone(pid)}
    assert not still, f"still running {took:.2f} s after the end: {still}"


def job_state(conn: rpycdl.Connection, job_id: str) -> str:
    return next(job["state"] for job in conn.root.jobs() if job["job_id"] == job_id)


@pytest.fixture
def popen():
    """Client subprocesses started by a test; killed at its end."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", CLIENT, *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


# -- every way a job ends ----------------------------------------------------------------------


def test_return(server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    conn = connect(port)
    info = conn.root.run_code(JOB, {"dir": str(tmp_path), "how": "return"}, ngpus=2)
    ended = time.time()
    assert len(info["uuids"]) == 2
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"]}, ended)
    assert job_state(conn, info["job_id"]) == "SUCCEEDED"


def test_exception(server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    conn = connect(port)
    with pytest.raises(RuntimeError, match="on purpose"):
        conn.root.run_code(JOB, {"dir": str(tmp_path), "how": "raise"}, ngpus=2)
    ended = time.time()
    info = read_info(tmp_path)
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"]}, ended)
    assert job_state(conn, info["job_id"]) == "FAILED"


def test_timeout(server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    conn = connect(port)
    started = time.time()
    with pytest.raises(rpycdl.JobTimeoutError):
        conn.root.run_code(JOB, {"dir": str(tmp_path), "how": "sleep"}, ngpus=2, timeout=1)
    ended = time.time()
    assert 1 <= ended - started < 5
    info = read_info(tmp_path)
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"]}, ended)
    assert job_state(conn, info["job_id"]) == "TIMED_OUT"


def test_cancel(server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    running = Background(connect(port), JOB, {"dir": str(tmp_path), "how": "sleep"}, ngpus=2)
    info = read_info(tmp_path)
    other = connect(port)
    assert job_state(other, info["job_id"]) == "RUNNING"
    assert other.root.cancel(info["job_id"]) == "RUNNING"
    assert isinstance(running.join(), rpycdl.JobCancelledError)
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"]}, running.ended)
    assert job_state(other, info["job_id"]) == "CANCELLED"


def test_client_disconnect(server, connect, popen, tmp_path):
    port = server("pytorch", "fake:4")
    client = popen(str(port), str(tmp_path), "2")
    info = read_info(tmp_path)
    serving = connection_of(connect(port), info["job_id"])
    assert client.poll() is None
    client.kill()
    ended = time.time()
    client.wait(5)
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"], "connection": serving}, ended)
    assert job_state(connect(port), info["job_id"]) == "CANCELLED"  # the client going away cancels


def test_ctrl_c_in_the_client(server, connect, popen, tmp_path):
    port = server("pytorch", "fake:4")
    client = popen(str(port), str(tmp_path), "2")
    info = read_info(tmp_path)
    serving = connection_of(connect(port), info["job_id"])
    client.send_signal(signal.SIGINT)
    ended = time.time()
    output, _ = client.communicate(timeout=10)
    assert "KeyboardInterrupt" in output
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"], "connection": serving}, ended)
    assert job_state(connect(port), info["job_id"]) == "CANCELLED"


def test_kill_9_of_the_job_process(server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    running = Background(connect(port), JOB, {"dir": str(tmp_path), "how": "sleep"}, ngpus=2)
    info = read_info(tmp_path)
    os.kill(info["pid"], signal.SIGKILL)
    ended = time.time()
    crash = running.join()
    assert isinstance(crash, rpycdl.JobCrashedError), repr(crash)
    assert "signal 9" in str(crash)
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"]}, ended)
    assert job_state(connect(port), info["job_id"]) == "FAILED"


def test_kill_9_of_the_connection_process(cluster, server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    server_pid = cluster.processes[-1].popen.pid
    running = Background(connect(port), JOB, {"dir": str(tmp_path), "how": "sleep"}, ngpus=2)
    info = read_info(tmp_path)
    serving = connection_of(connect(port), info["job_id"])
    assert serving not in (server_pid, info["ppid"]), "the job's owner should be a connection process"
    os.kill(serving, signal.SIGKILL)
    ended = time.time()
    assert isinstance(running.join(), Exception)  # the client's connection died with it
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"], "connection": serving}, ended)
    other = connect(port)
    assert wait_until(lambda: job_state(other, info["job_id"]) == "FAILED", 2)
    assert other.root.run_code(JOB, {"dir": str(tmp_path), "how": "return"}, ngpus=-1)["uuids"]


def test_kill_9_of_the_keeper(cluster, server, connect, tmp_path):
    """A job's keeper is its own: its death ends that job alone (its job process dies with it, what that started
    is killed), its GPUs free within a second, the other job on the server untouched."""
    port = server("pytorch", "fake:4")
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = Background(connect(port), JOB, {"dir": str(other_dir), "how": "until_file"}, ngpus=2)
    other_info = read_info(other_dir)
    running = Background(connect(port), JOB, {"dir": str(tmp_path), "how": "sleep"}, ngpus=2)
    info = read_info(tmp_path)
    assert info["parent"] == "rpycdl-keeper" and info["ppid"] != other_info["ppid"]
    os.kill(info["ppid"], signal.SIGKILL)
    ended = time.time()
    crash = running.join()
    assert isinstance(crash, rpycdl.JobCrashedError), repr(crash)
    (other_dir / "release").touch()
    assert other.join()["pid"] == other_info["pid"], "the other job should have run to its value"
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"], "keeper": info["ppid"]}, ended)
    assert job_state(connect(port), info["job_id"]) == "FAILED"


def test_kill_9_of_the_forkserver_ends_no_job(cluster, server, connect, tmp_path):
    """The job forkserver carries no job: a job running as it dies runs to its value, the spare job processes
    it forked stay, and the server starts another forkserver."""
    port = server("pytorch", "fake:4")
    server_pid = cluster.processes[-1].popen.pid
    running = Background(connect(port), JOB, {"dir": str(tmp_path), "how": "until_file"}, ngpus=2)
    info = read_info(tmp_path)
    forkserver = procs.stat(info["ppid"]).ppid
    assert read_comm(forkserver) == "rpycdl-forksrv"
    os.kill(forkserver, signal.SIGKILL)
    time.sleep(0.5)
    (tmp_path / "release").touch()
    assert running.join()["pid"] == info["pid"]
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"], "keeper": info["ppid"]},
                         time.time())
    restarted = helpers.forkserver(server_pid)
    assert restarted != forkserver
    (tmp_path / "info.json").unlink()
    again = connect(port).root.run_code(JOB, {"dir": str(tmp_path), "how": "return"}, ngpus=-1)
    assert again["parent"] == "rpycdl-keeper"  # a spare kept from before, or one of the new forkserver's


def test_a_forkserver_killed_as_it_starts_again_leaves_the_server_serving(cluster, server, connect, tmp_path):
    """The forkserver the server starts in place of a dead one is killed too, before it is ready, again and again:
    the server goes on trying, and serves."""
    port = server("pytorch", "fake:4")
    server_pid = cluster.processes[-1].popen.pid
    conn = connect(port)
    killed = {helpers.forkserver(server_pid)}
    for _ in range(5):
        procs.kill(killed)
        killed.add(helpers.wait_until(lambda: next((pid for pid in helpers.children(server_pid) if pid not in killed
                                                    and procs.runs_module(pid, "rpycdl.server.forkserver")), None),
                                      10, "the server to start a forkserver again"))  # killed at once, as it starts
    procs.kill(killed)
    helpers.wait_until(lambda: helpers.forkserver(server_pid) not in killed, 10, "a forkserver that lives")
    assert conn.root.run_code(JOB, {"dir": str(tmp_path), "how": "return"}, ngpus=1)["uuids"]
    assert connect(port).root.run_code(JOB, {"dir": str(tmp_path), "how": "return"}, ngpus=2)["uuids"]


def test_a_forkserver_slow_to_start_again_holds_up_no_release(cluster, connect, tmp_path):
    """While the forkserver started in place of a dead one imports a slow preload, the server goes on: it answers,
    and the GPUs of a job whose connection process is killed meanwhile are free within a second."""
    modules, slow, job_dir = tmp_path / "modules", tmp_path / "slow", tmp_path / "job"
    modules.mkdir()
    job_dir.mkdir()
    (modules / "slow_preload.py").write_text(f"import os, time\nif os.path.exists({str(slow)!r}):\n    time.sleep(5)\n")
    process, port = cluster.add_server("pytorch", "fake:4", "--preload", "slow_preload",
                                       env={"PYTHONPATH": str(modules)})
    server_pid = process.popen.pid
    running = Background(connect(port), JOB, {"dir": str(job_dir), "how": "sleep"}, ngpus=2)
    info = read_info(job_dir)
    serving = connection_of(connect(port), info["job_id"])
    slow.touch()
    forkserver = helpers.forkserver(server_pid)
    os.kill(forkserver, signal.SIGKILL)
    helpers.wait_until(lambda: next((pid for pid in helpers.children(server_pid) if pid != forkserver
                                     and procs.runs_module(pid, "rpycdl.server.forkserver")), None),
                       10, "the server to start a forkserver again")
    os.kill(serving, signal.SIGKILL)
    ended = time.time()
    assert isinstance(running.join(), Exception)
    assert_nothing_leaks(port, connect, {"job": info["pid"], "child": info["child"], "connection": serving}, ended)


def read_comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


# -- waiting requests -----------------------------------------------------------------------------


def test_queue_timeout_leaves_nothing_in_the_queue(server, connect, tmp_path):
    port = server("pytorch", "fake:4")
    holder = Background(connect(port), JOB, {"dir": str(tmp_path), "how": "until_file"}, ngpus=-1)
    info = read_info(tmp_path)
    conn = connect(port)
    started = time.time()
    with pytest.raises(rpycdl.QueueTimeoutError):
        conn.root.run_code(JOB, {"dir": str(tmp_path / "never"), "how": "return"}, ngpus=1, queue_timeout=0.5)
    assert 0.5 <= time.time() - started < 3
    status = connect(port).root.gpu_status()
    assert status["queue"] == []
    assert [gpu["holders"][0]["job_id"] for gpu in status["gpus"]] == [info["job_id"]] * 4
    (tmp_path / "release").touch()
    assert holder.join()["job_id"] == info["job_id"]
    assert conn.root.run_code(JOB, {"dir": str(tmp_path), "how": "return"}, ngpus=1)["uuids"]


@pytest.mark.slow
def test_killed_waiting_client_leaves_the_queue_and_the_next_request_goes(server, connect, popen, lock_dir, tmp_path):
    port = server("pytorch", "fake:4")
    status_conn = connect(port)
    holder_dir, later_dir = tmp_path / "holder", tmp_path / "later"
    holder_dir.mkdir()
    later_dir.mkdir()
    holder = Background(connect(port), JOB, {"dir": str(holder_dir), "how": "until_file"}, ngpus=3)
    read_info(holder_dir)

    # A client waits for all four GPUs, then a later request for one: first come, first served
    # keeps the later one waiting although a GPU is free.
    waiting = popen(str(port), str(tmp_path / "never"), "-1")
    assert wait_until(lambda: len(status_conn.root.gpu_status()["queue"]) == 1, 20), "the client never queued"
    later = Background(connect(port), JOB, {"dir": str(later_dir), "how": "return"}, ngpus=1)
    assert wait_until(lambda: len(status_conn.root.gpu_status()["queue"]) == 2, 10)
    time.sleep(0.5)
    assert later.ended is None and not (later_dir / "info.json").exists(), "a later request overtook"

    waiting.kill()
    killed = time.time()
    waiting.wait(5)
    result = later.join(10)
    assert not isinstance(result, BaseException), repr(result)
    granted = granted_at(lock_dir, result["job_id"])
    assert granted - killed < GRACE, f"granted {granted - killed:.2f} s after the kill"
    assert status_conn.root.gpu_status()["queue"] == []
    assert holder.ended is None  # the holder still runs: the free GPU went to the next request
    (holder_dir / "release").touch()
    holder.join()
    assert_nothing_leaks(port, connect, {}, time.time())
