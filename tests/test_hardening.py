"""Bad input never hurts the server: arbitrary run_code arguments and payload bytes get a clear
error or run, bursts of connections are served, and nothing is left behind."""

from __future__ import annotations

import math
import socket
import threading

from helpers import wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rpycdl
from rpycdl import wire

ANY = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.floats(allow_nan=True, allow_infinity=True),
                st.text(max_size=5))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid(ngpus, timeout, queue_timeout) -> bool:
    def seconds(value) -> bool:
        return value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                                 and math.isfinite(value) and 0 < value <= 366 * 24 * 3600)

    return (ngpus is None or not isinstance(ngpus, bool) and isinstance(ngpus, int) and (ngpus == -1 or 1 <= ngpus <= 2)
            ) and seconds(timeout) and seconds(queue_timeout)


MEMORY = {"1GiB": True, "16GiB": True, "16385MiB": False, "0": False, "lots": False, "1.5GiB": True}


def _valid_share(gpus, gpu_memory) -> bool:
    """The share arguments of the shared fake:2 server (two 16 GiB GPUs); ngpus is not given."""
    if gpus is not None and gpu_memory is not None:
        return False
    if gpus is not None:
        return (not isinstance(gpus, bool) and isinstance(gpus, (int, float)) and math.isfinite(gpus)
                and (0 < gpus < 1 or gpus in (1, 2)))
    if isinstance(gpu_memory, str):
        return MEMORY[gpu_memory]
    return gpu_memory is None or (not isinstance(gpu_memory, bool) and isinstance(gpu_memory, int)
                                  and 0 < gpu_memory <= 16 * 1024**3)


@SETTINGS
@given(ngpus=ANY, timeout=ANY, queue_timeout=ANY)
def test_any_arguments_run_or_get_invalid_request(conn, ngpus, timeout, queue_timeout):
    try:
        value = conn.root.run_code(lambda x: x, "ok", ngpus=ngpus, timeout=timeout, queue_timeout=queue_timeout)
    except rpycdl.InvalidRequestError:
        assert not _valid(ngpus, timeout, queue_timeout)
    except rpycdl.JobTimeoutError:  # a valid but tiny timeout: the job cannot start in time
        assert _valid(ngpus, timeout, queue_timeout) and timeout < 1
    else:
        assert _valid(ngpus, timeout, queue_timeout) and value == "ok"
    status = conn.root.gpu_status()
    assert [gpu["holders"] for gpu in status["gpus"]] == [[], []] and status["queue"] == []


@SETTINGS
@given(gpus=ANY, gpu_memory=st.one_of(st.none(), st.booleans(), st.integers(-2, 2**35), st.floats(),
                                      st.sampled_from(sorted(MEMORY))))
def test_any_share_arguments_run_or_get_invalid_request(conn, gpus, gpu_memory):
    try:
        value = conn.root.run_code(lambda x: x, "ok", gpus=gpus, gpu_memory=gpu_memory)
    except rpycdl.InvalidRequestError:
        assert not _valid_share(gpus, gpu_memory)
    else:
        assert _valid_share(gpus, gpu_memory) and value == "ok"
    status = conn.root.gpu_status()
    assert [gpu["holders"] for gpu in status["gpus"]] == [[], []] and status["queue"] == []


@SETTINGS
@given(junk=st.binary(max_size=200))
def test_any_payload_bytes_get_a_clear_error(conn, junk):
    for payload in (junk, wire.MAGIC + bytes(wire.PYTHON) + junk):
        outcome = conn._conn.root.run(payload, 1)
        try:
            wire.decode_outcome(outcome)
        except (rpycdl.InvalidRequestError, rpycdl.VersionMismatchError):
            pass
    assert conn.root.run_code(lambda x: x, 1) == 1


def test_a_burst_of_connections_is_served_and_leaves_nothing(shared_port, conn):
    silent = [socket.create_connection(("127.0.0.1", shared_port)) for _ in range(200)]  # connect, say nothing
    results: list[object] = []

    def client() -> None:
        with rpycdl.connect(host="127.0.0.1", port=shared_port) as own:
            results.append(own.root.run_code(lambda x: x, 1, queue_timeout=60))

    threads = [threading.Thread(target=client) for _ in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for sock in silent:
        sock.close()
    assert results == [1] * 30
    wait_idle(conn)
