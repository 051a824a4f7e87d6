"""Connection processes forked ahead of their clients (spares), each with a job process started
already by the server's forkserver, which the connection's first job runs in. Real registry, server and
clients on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from helpers import (
    Background,
    children,
    comm,
    connection_processes,
    forkserver,
    gate_job,
    idle,
    kept_jobs,
    open_gate,
    refusal,
    running,
    server_pid,
    server_process,
    spare_processes,
    wait_until,
)

import rpycdl
from rpycdl import registry
from rpycdl.defaults import SPARE_CONNECTIONS
from rpycdl.wire import codec


def _ready_jobs(pid: int, holding: int = 0) -> set[int]:
    """The job processes held ready (each kept by a keeper of the server's forkserver), once there is one for each
    spare and for each of `holding` idle connections (those that ran a second job hold their next job's process; one
    that ran one job holds none), each running its own code (named rpycdl-job: right after the fork it still has
    the forkserver's name), and no other job runs."""
    def jobs() -> set[int] | None:
        held = kept_jobs(forkserver(pid))
        spares = spare_processes(pid)
        if len(spares) != SPARE_CONNECTIONS or len(held) != len(spares) + holding or any(
                comm(job) != "rpycdl-job" for job in held):
            return None
        return set(held)

    return wait_until(jobs, what=f"{SPARE_CONNECTIONS} spares with their job process, {holding} held by connections")


def _bindable(port: int) -> bool:
    """Whether nothing listens on the port any more."""
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            again.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _make_job_pid():
    """The job of these tests (made in a function, so that dill sends its code, not a reference)."""
    def job_pid(blob: bytes | None) -> tuple[int, int]:
        import os

        return os.getpid(), len(blob or b"")

    return job_pid


_job_pid = _make_job_pid()


def test_a_server_keeps_spares_each_with_a_job_process_named_for_ps(server, cluster):
    pid = server_pid(cluster, server())
    jobs = _ready_jobs(pid)  # fails unless every spare holds one process named rpycdl-job
    assert {comm(spare) for spare in spare_processes(pid)} == {"rpycdl-spare"}
    assert len(jobs) == SPARE_CONNECTIONS
    assert comm(pid) == "rpycdl-server" and comm(forkserver(pid)) == "rpycdl-forksrv"
    assert connection_processes(pid) == []


def test_the_first_job_of_a_connection_runs_in_the_job_process_its_spare_forked_ahead(server, cluster, connect):
    """The spare that takes a connection has its job process already (which spare takes it is the kernel's pick:
    under load, the one forked in place of the first may win); later jobs of the connection are forked as they
    come."""
    port = server()
    pid = server_pid(cluster, port)
    _ready_jobs(pid)
    conn = connect(port)
    ready = _ready_jobs(pid, holding=1)  # the spares' and the connection's, before it asks for anything
    first, _ = conn.root.run_code(_job_pid, None)
    second, _ = conn.root.run_code(_job_pid, None)
    assert first in ready, (first, ready)
    assert second not in ready and second != first
    [serving] = connection_processes(pid)
    assert comm(serving) == "rpycdl-conn"
    # The spares still hold theirs; the connection holds its third job's process.
    assert len(_ready_jobs(pid, holding=1) - ready) == 1


def test_a_payload_with_out_of_band_buffers_runs_in_the_spare_too(server, cluster, connect):
    port = server()
    pid = server_pid(cluster, port)
    _ready_jobs(pid)
    conn = connect(port)
    ready = _ready_jobs(pid, holding=1)
    blob = os.urandom(codec.OUT_OF_BAND_MIN + 1)
    job, size = conn.root.run_code(_job_pid, blob)  # the buffers go down its go pipe (runner)
    assert size == len(blob)
    assert job in ready


def test_a_spare_job_process_that_died_is_replaced_by_a_fork(server, cluster, connect):
    port = server()
    pid = server_pid(cluster, port)
    ready = _ready_jobs(pid)
    for job in ready:
        os.kill(job, signal.SIGKILL)
    conn = connect(port)
    job, _ = conn.root.run_code(_job_pid, None)
    assert job not in ready
    assert conn.root.run_code(lambda x: x * 2, 21) == 42


def test_sigterm_to_a_spare_leaves_the_server_serving_and_registered(server, cluster, connect):
    port = server()
    pid = server_pid(cluster, port)
    _ready_jobs(pid)
    for spare in spare_processes(pid):
        os.kill(spare, signal.SIGTERM)  # the server's own SIGTERM handler would close the shared listener
    time.sleep(0.2)
    assert connect(port).root.run_code(lambda x: x + 1, 1) == 2
    assert ("127.0.0.1", port) in registry.discover("pytorch", cluster.registry_address)
    _ready_jobs(pid)


def test_spares_die_with_a_killed_server_and_free_its_port(server, cluster, connect):
    port = server()
    pid = server_pid(cluster, port)
    serving = connect(port)
    assert serving.root.run_code(lambda x: x, "before") == "before"
    # Once the spare that took the connection is replaced (a spare just forked still bears the server's name, and
    # holds the listening socket too): every process that could hold the port is known.
    jobs = _ready_jobs(pid)
    spares = spare_processes(pid)
    os.kill(pid, signal.SIGKILL)
    # Gone, or a zombie that init has yet to reap (the server, their parent, is dead): dead either way.
    wait_until(lambda: not any(running(p) for p in spares + list(jobs)), timeout=2.0,
               what="the spares and their job processes to be gone")
    assert _bindable(port), "something still holds the listening socket"
    assert serving.root.run_code(lambda x: x, "after") == "after"  # a connection already served goes on



def test_a_stopped_server_leaves_no_spare_behind_not_even_a_zombie(server, cluster):
    port = server()
    pid = server_pid(cluster, port)
    jobs = _ready_jobs(pid)
    spares = spare_processes(pid)
    forking = forkserver(pid)
    keepers = children(forking)
    os.kill(pid, signal.SIGTERM)
    server_process(cluster, port).popen.wait(10)
    left = {p: comm(p) for p in spares if os.path.exists(f"/proc/{p}")}
    assert not left, f"left to init by the stopped server: {left}"
    # The keepers kill the spares' jobs as their spares go, and the forkserver leaves once nobody can ask it for more.
    wait_until(lambda: not [p for p in [forking, *keepers, *jobs] if os.path.exists(f"/proc/{p}")], timeout=2.0,
               what="the forkserver, the keepers and the spares' job processes to be gone")


def test_a_server_stopped_as_it_starts_stops(lock_dir):
    # SIGTERM between the ready line and RPyC's start(), which sets the server active: the stop must
    # hold, not leave a server forking spares on a closed listener for ever.
    from rpycdl.site import local

    for _ in range(10):
        process = local.start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0",
                               "--registry", "none", "--lock-dir", lock_dir])
        try:
            process.wait_for(r"on 127\.0\.0\.1:\d+ as")
            process.popen.send_signal(signal.SIGTERM)
            process.popen.wait(10)
        finally:
            if process.popen.poll() is None:
                process.popen.kill()


def test_a_killed_server_frees_its_port_while_a_job_it_took_still_runs(server, cluster, connect, tmp_path):
    port = server()
    pid = server_pid(cluster, port)
    _ready_jobs(pid)
    gate = str(tmp_path / "gate")
    job = Background(connect(port), gate_job(gate), "finished")  # the connection's first job: its spare
    wait_until(lambda: any(state == "running" for state, _ in job.states), what="the job to run")
    os.kill(pid, signal.SIGKILL)  # no shutdown() of the listening socket: only closing every descriptor frees it
    server_process(cluster, port).popen.wait(10)
    # The spares die with the server; the job process must not hold its listening socket either.
    wait_until(lambda: _bindable(port), timeout=2.0, what="the port to be free")
    open_gate(gate)
    wait_until(lambda: job.done, what="the job to finish")
    assert job.value == "finished", job.error


PIDS_CGROUPS = Path("/sys/fs/cgroup/pids")
"""cgroup v1's pids controller, where the development machine and CI have it."""


@contextlib.contextmanager
def _forks_fail(pid: int) -> Iterator[Callable[[], None]]:
    """Put process `pid` alone in a pids cgroup that allows it no task more than it has, so that
    its forks fail with EAGAIN, as on a machine out of processes (root ignores RLIMIT_NPROC).
    Yields a function that lifts the limit; afterwards `pid` and whatever it forked meanwhile go
    back to the root cgroup."""
    assert (PIDS_CGROUPS / "cgroup.procs").exists(), f"this test needs cgroup v1's pids controller at {PIDS_CGROUPS}"
    group = PIDS_CGROUPS / f"rpycdl-test-{os.getpid()}-{pid}"
    group.mkdir()
    try:
        (group / "pids.max").write_text(str(len(os.listdir(f"/proc/{pid}/task"))))
        (group / "cgroup.procs").write_text(str(pid))
        yield lambda: (group / "pids.max").write_text("max")
    finally:
        def emptied() -> bool:
            for member in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):  # gone meanwhile
                    (PIDS_CGROUPS / "cgroup.procs").write_text(member)
            return not (group / "cgroup.procs").read_text().split()

        wait_until(emptied, what="the test cgroup to empty")
        group.rmdir()


def test_a_server_that_cannot_fork_refuses_clearly_and_recovers(server, cluster, connect):
    port = server()
    pid = server_pid(cluster, port)
    _ready_jobs(pid)
    with _forks_fail(pid) as lift:
        taken = [connect(port) for _ in range(SPARE_CONNECTIONS)]  # each takes a spare; none can be replaced
        assert [conn.root.run_code(lambda x: x * 2, n) for n, conn in enumerate(taken)] == [0, 2]
        assert spare_processes(pid) == []
        error = refusal(lambda: connect(port))
        assert isinstance(error, rpycdl.LimitError) and "could not start a process" in str(error), repr(error)
        log = server_process(cluster, port).lines
        assert any("could not fork a connection process" in line for line in log)
        assert all(conn.root.run_code(lambda x: x, "still served") == "still served" for conn in taken)
        lift()
        _ready_jobs(pid, holding=len(taken))  # the parent forks spares again on its next turn
        assert connect(port).root.run_code(lambda x: x + 1, 1) == 2
        wait_until(lambda: idle(taken[0]), what="every GPU free, nobody waiting")  # released just after the reply


def test_a_connection_whose_job_cannot_be_forked_refuses_the_call_clearly_and_goes_on(server, cluster, connect):
    port = server()
    pid = server_pid(cluster, port)
    _ready_jobs(pid)
    conn = connect(port)
    assert conn.root.run_code(lambda x: x, "in the spare job") == "in the spare job"
    (serving,) = wait_until(lambda: connection_processes(pid), what="the connection process")
    # The second job's process is forked as it comes; as it takes it, the third job's is started.
    assert conn.root.run_code(lambda x: x, "forked for it") == "forked for it"
    wait_until(lambda: idle(conn), what="the second job's end")
    with _forks_fail(forkserver(pid)) as lift:  # the next job takes the process started for it
        assert conn.root.run_code(lambda x: x, "in the one made ready") == "in the one made ready"
        wait_until(lambda: idle(conn), what="the third job's end")
        descriptors = len(os.listdir(f"/proc/{serving}/fd"))
        error = refusal(lambda: conn.root.run_code(lambda x: x, "refused", ngpus=2))
        assert isinstance(error, rpycdl.LimitError) and "could not start a process for the job" in str(error), \
            repr(error)
        assert idle(conn)
        assert len(os.listdir(f"/proc/{serving}/fd")) == descriptors, "the job's pipes were left open"
        lift()
        assert conn.root.run_code(lambda x: x, "served again", ngpus=2) == "served again"
