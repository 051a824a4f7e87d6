"""rpycdl.connect: discovery through the registry, choosing a server, going direct."""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import socket
import time

import pytest
from helpers import Background, connection_processes, gate_job, open_gate, running, wait_idle, wait_until

import rpycdl
from rpycdl.client import connect_to
from rpycdl.registry import discover


def test_connect_by_service_name_finds_the_server(cluster, server):
    port = server("pytorch", "fake:2")
    for name in ("pytorch", "PYTORCH"):
        with rpycdl.connect(name, registry_address=cluster.registry_address) as conn:
            assert conn.address == ("127.0.0.1", port)
            assert conn.root.run_code(lambda x: x * 2, 21) == 42
            assert conn.root.gpu_status()["server"]["port"] == port
        assert conn.closed


def test_connect_uses_the_registry_from_the_environment(cluster, server, monkeypatch):
    port = server("pytorch", "fake:1")
    monkeypatch.setenv("RPYCDL_REGISTRY", cluster.registry_address)
    with rpycdl.connect("pytorch") as conn:
        assert conn.address == ("127.0.0.1", port)


def test_connect_chooses_the_server_with_more_free_gpus(cluster, server, connect, tmp_path):
    ports = [server("pytorch", "fake:2", "--lock-dir", str(tmp_path / name)) for name in ("a", "b")]
    listed = [port for _, port in discover("pytorch", cluster.registry_address)]
    assert sorted(listed) == sorted(ports)
    # occupy one of the two GPUs of the server the registry lists first, so that taking the
    # first one listed, or any one with a free GPU, would be the wrong choice
    busy, idle = listed
    gate = str(tmp_path / "gate")
    holder = Background(connect(busy), gate_job(gate), None, ngpus=1)
    try:
        holder.wait_state("running")
        assert connect(busy).root.load()[0] == 1 and connect(idle).root.load()[0] == 2
        for _ in range(3):
            with rpycdl.connect("pytorch", registry_address=cluster.registry_address) as conn:
                assert conn.address == ("127.0.0.1", idle)
                assert conn.root.run_code(lambda x: x, "ran", ngpus=2, queue_timeout=5) == "ran"
            wait_idle(connect(idle))  # its reply came before its GPUs went back (promise 3: within a second)
    finally:
        open_gate(gate)
    holder.result()
    # with both idle again, either will do, and the busy one is chosen once the other is the busier
    gate2 = str(tmp_path / "gate2")
    holder2 = Background(connect(idle), gate_job(gate2), None, ngpus=2)
    try:
        holder2.wait_state("running")
        with rpycdl.connect("pytorch", registry_address=cluster.registry_address) as conn:
            assert conn.address == ("127.0.0.1", busy)
    finally:
        open_gate(gate2)
    holder2.result()


def test_connect_prefers_the_shorter_queue_when_no_gpu_is_free(cluster, server, connect, tmp_path):
    ports = [server("pytorch", "fake:1", "--lock-dir", str(tmp_path / name)) for name in ("a", "b")]
    first, second = [port for _, port in discover("pytorch", cluster.registry_address)]
    assert sorted((first, second)) == sorted(ports)
    gate = str(tmp_path / "gate")
    running = [Background(connect(port), gate_job(gate), None) for port in (first, second)]
    try:
        for job in running:
            job.wait_state("running")
        waiting = Background(connect(first), gate_job(gate), None)
        waiting.wait_state("pending")
        with rpycdl.connect("pytorch", registry_address=cluster.registry_address) as conn:
            assert conn.address == ("127.0.0.1", second)
    finally:
        open_gate(gate)
    for job in (*running, waiting):
        job.result()


def test_unknown_service_raises_discovery_error(cluster, server):
    server("pytorch", "fake:1")
    start = time.monotonic()
    with pytest.raises(rpycdl.DiscoveryError, match="NOSUCHSERVICE") as info:
        rpycdl.connect("nosuchservice", registry_address=cluster.registry_address)
    assert cluster.registry_address.split(":")[1] in str(info.value)  # says which registry it asked
    assert time.monotonic() - start < 5


def test_registered_server_that_is_down_raises_discovery_error(cluster, server):
    process, port = cluster.add_server("jax", "fake:1")
    process.popen.kill()  # no clean unregistering: it stays listed until the registry prunes it
    process.popen.wait(10)
    assert ("127.0.0.1", port) in discover("jax", cluster.registry_address)
    with pytest.raises(rpycdl.DiscoveryError, match="down"):
        rpycdl.connect("jax", registry_address=cluster.registry_address)


def test_connect_needs_a_service_or_a_host():
    with pytest.raises(rpycdl.InvalidRequestError, match="service"):
        rpycdl.connect()


def test_connect_direct_by_host_and_port(server):
    port = server("pytorch", "fake:2")
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        assert conn.address == ("127.0.0.1", port)
        assert repr(conn) == f"<rpycdl.Connection 127.0.0.1:{port}>"
        assert conn.root.run_code(lambda x: sorted(x), [3, 1, 2], ngpus=2) == [1, 2, 3]
        assert conn.root.gpu_status()["server"]["port"] == port
    assert conn.closed


def test_connect_direct_to_nothing_fails_naming_the_address_as_an_rpycdl_and_an_os_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        address = ("127.0.0.1", port)
        for attempt in (lambda: rpycdl.connect(host="127.0.0.1", port=port),
                        lambda: connect_to(address, None, None)):
            with pytest.raises(ConnectionRefusedError) as info:  # what callers caught before, still caught
                attempt()
            error = info.value
            assert isinstance(error, rpycdl.ConnectionFailedError) and isinstance(error, rpycdl.RpycdlError)
            assert isinstance(error, ConnectionError) and error.errno == errno.ECONNREFUSED
            assert error.address == address and str(error).startswith(f"cannot reach the server at 127.0.0.1:{port}: ")
            assert "Connection refused" in str(error) and not isinstance(error, EOFError)
            assert pickle.loads(pickle.dumps(error)).address == address  # as a worker process hands it back
        with pytest.raises(rpycdl.InvalidRequestError, match=rf"^no server knows job '0123456789ab'; could not ask "
                                                             rf"127\.0\.0\.1:{port}: Connection refused") as unknown:
            rpycdl.job("0123456789ab", host="127.0.0.1", port=port)
        assert str(unknown.value).count(f":{port}") == 1  # the address, said once
    with pytest.raises(rpycdl.ConnectionFailedError, match="cannot reach the server at no-such-host.invalid:18861") \
            as unresolved:
        rpycdl.connect(host="no-such-host.invalid")
    assert isinstance(unresolved.value, socket.gaierror)


def test_a_dropped_connection_fails_naming_the_server_then_reopens_and_a_job_handle_whose_server_is_gone(
        cluster, connect, tmp_path):
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    running = Background(conn, gate_job(str(tmp_path / "gate")), None)
    job_id = running.wait_state("running")["job_id"]
    os.kill(connect(port).root.job(job_id).info["owner_pid"], signal.SIGKILL)  # its connection process
    running.join()
    lost = running.error
    assert isinstance(lost, rpycdl.ConnectionLostError), repr(lost)
    assert isinstance(lost, EOFError) and isinstance(lost, ConnectionError) and isinstance(lost, rpycdl.RpycdlError)
    assert lost.address == ("127.0.0.1", port)
    assert str(lost).startswith(f"the connection to 127.0.0.1:{port} closed while calling run_buffers ("), lost
    assert str(lost).endswith("; the job was cancelled"), lost
    assert conn.closed  # it died: the next call that starts something opens it again
    assert [gpu["index"] for gpu in conn.root.gpu_status()["gpus"]] == [0] and not conn.closed

    other = connect(port)
    job = other.root.submit_command(["true"])
    assert job.wait(30).finished
    other.close()
    process.popen.kill()
    process.popen.wait()
    wait_until(lambda: not _listening(port), 10, "the killed server's port to refuse connections")
    for call in (job.status, job.wait, lambda: list(job.logs()), job.artifacts, job.download):
        with pytest.raises(rpycdl.ConnectionFailedError, match=f"cannot reach the server at 127.0.0.1:{port}"):
            call()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_any_other_method_of_the_server_fails_as_an_rpycdl_error_once_its_connection_died(cluster, connect):
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    server_info = conn.root.server_info  # no method of the client's own: the server's, through RPyC
    assert json.loads(server_info())["port"] == port
    with pytest.raises(AttributeError):
        conn.root.no_such_method  # noqa: B018 - the lookup is what is tested
    serving = wait_until(lambda: connection_processes(process.popen.pid), what="the connection's process")
    os.kill(serving[0], signal.SIGKILL)
    wait_until(lambda: not running(serving[0]), what="the connection's process to die")
    with pytest.raises(rpycdl.ConnectionLostError, match=rf"^the connection to 127\.0\.0\.1:{port} closed while "
                                                         "calling server_info"):
        server_info()
    assert json.loads(conn.root.server_info())["port"] == port  # the next lookup opens it again


def test_a_job_the_client_is_told_runs_is_in_the_ledger_already(server, connect):
    """The "running" a client hears comes after the job's row is saved: another connection finds the job at once
    (it used to come before, and `conn.root.job(id)` then said "no job ... here")."""
    port = server("pytorch", "fake:1")
    conn, other = connect(port), connect(port)
    found: list[str] = []

    def on_state(state: str, info: dict) -> None:
        if state == "running":
            found.append(other.root.job(info["job_id"]).id)

    ids = [conn.root.run_code(lambda _: __import__("os").environ["RPYCDL_JOB_ID"], None, on_state=on_state)
           for _ in range(20)]
    assert found == ids
