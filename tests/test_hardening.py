"""Bad input never hurts the server: arbitrary run_code arguments and payload bytes get a clear
error or run, bursts of connections are served, frames that announce or inflate to more than
they are cost no memory, and nothing is left behind."""

from __future__ import annotations

import math
import socket
import threading
import time
import zlib
from pathlib import Path

import dill
import rpyc
from helpers import connection_processes, server_pid, server_process, wait_idle, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rpyc.core.channel import Channel

import rpycdl
from rpycdl.wire import codec

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
    for payload in (junk, codec.MAGIC + bytes(codec.PYTHON) + junk):
        outcome = conn._conn.root.run(payload, 1)
        try:
            codec.decode_outcome(outcome)
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


# -- frames that claim more than they carry -----------------------------------------------------

MiB = 1 << 20
RECVFROM = {"x86_64": 45, "aarch64": 207}  # what /proc/PID/syscall shows while a recv(2) blocks


def _memory(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (VmRSS), or its peak (VmHWM), in bytes; 0 once it has exited."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:")), 0)  # 0: a zombie


def _receiving(pid: int) -> bool:
    """Whether a process is blocked reading its socket: inside a frame, past its header (waiting for
    the next frame, a connection process blocks in select instead)."""
    import platform

    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(RECVFROM[platform.machine()])
    except (OSError, IndexError):
        return False


def _raw_client(port: int, server: int, first: bytes) -> tuple[socket.socket, int]:
    """A raw socket connected to the server (no authentication on loopback) that has sent `first` (a connection
    gets a process once it has said something), and the pid of the connection process serving it."""
    before = set(connection_processes(server))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(first)
    pid = wait_until(lambda: (set(connection_processes(server)) - before or {0}).pop(), what="its connection process")
    return sock, pid


def test_a_header_announcing_a_huge_frame_costs_no_memory_until_the_bytes_come(server, cluster):
    port = server("pytorch", "fake:1")  # --max-payload 8GiB by default: 1 GiB is within the limit
    pid = server_pid(cluster, port)
    stalled = []
    try:
        for number in range(50):
            header = Channel.FRAME_HEADER.pack(1 << 30, False)
            sock, conn_pid = _raw_client(port, pid, header[:1])
            stalled.append(sock)
            before = _memory(conn_pid)
            sock.sendall(header[1:])
            if number == 0:  # a trickle of the body, as a slow client would send it
                for _ in range(10):
                    sock.sendall(b"x" * 1000)
                    time.sleep(0.01)
            wait_until(lambda pid=conn_pid: _receiving(pid), what="the connection process to read the frame's body")
            grown = _memory(conn_pid) - before
            assert grown < 16 * MiB, f"connection {number}: {grown / MiB:.0f} MiB for a frame not sent"
        with rpycdl.connect(host="127.0.0.1", port=port) as other:
            assert other.root.run_code(lambda x: x, "still serving") == "still serving"
    finally:
        for sock in stalled:
            sock.close()
    wait_until(lambda: not connection_processes(pid), what="the stalled connections' processes to exit")


def test_a_frame_that_stops_halfway_is_dropped_after_the_idle_timeout(server, cluster):
    # A header, a few bytes of the body, then nothing: the connection process waits inside the frame,
    # where the idle timeout between requests does not look; it must not wait for ever.
    port = server("pytorch", "fake:1", "--idle-timeout", "1")
    sock, conn_pid = _raw_client(port, server_pid(cluster, port), Channel.FRAME_HEADER.pack(1000, False) + b"x" * 10)
    wait_until(lambda: _receiving(conn_pid), what="the connection process to read the frame's body")
    sock.settimeout(10)
    started = time.monotonic()
    assert sock.recv(1) == b""  # dropped
    assert time.monotonic() - started < 5
    wait_until(lambda: not _memory(conn_pid), what="its connection process to exit")
    sock.close()


def _bomb(inflated: int) -> bytes:
    """A zlib stream of `inflated` zero bytes (about a thousandth of that), made without holding them."""
    deflater, zeros = zlib.compressobj(9), bytes(MiB)
    return b"".join(deflater.compress(zeros) for _ in range(inflated // MiB)) + deflater.flush()


def test_a_compressed_frame_inflating_over_the_limit_drops_the_connection_unread(server, cluster, connect):
    port = server("pytorch", "fake:1", "--max-payload", "1MiB")
    bomb = _bomb(512 * MiB)
    assert len(bomb) < MiB  # well under the frame limit: only its inflated size is over
    frame = Channel.FRAME_HEADER.pack(len(bomb), True) + bomb + Channel.FLUSHER
    sock, conn_pid = _raw_client(port, server_pid(cluster, port), frame[:1])
    before = _memory(conn_pid, "VmHWM")
    sock.sendall(frame[1:])
    peak, ended = before, time.monotonic() + 10
    while (now := _memory(conn_pid, "VmHWM")) and time.monotonic() < ended:  # sampled until it exits
        peak = max(peak, now)
        time.sleep(0.002)
    assert peak - before < 32 * MiB, f"{(peak - before) / MiB:.0f} MiB to refuse a frame"
    sock.settimeout(10)
    assert sock.recv(1) == b""  # dropped
    sock.close()
    log = server_process(cluster, port).lines
    wait_until(lambda: any("inflates" in line and "--max-frame" in line for line in log), what="the log line")
    assert connect(port).root.run_code(lambda x: x, "still serving") == "still serving"


def test_compressed_frames_of_original_clients_still_arrive(shared_port):
    """Plain RPyC compresses every frame over 3000 bytes."""
    conn = rpyc.connect("127.0.0.1", shared_port, config={"allow_public_attrs": True})
    try:
        text = "compressible " * 100_000

        def fn(args):
            return len(args[0]), args[0][:12], args[1]

        blob = b"\0" * 50_000
        assert conn.root.run_code(dill.dumps(fn, recurse=True), [text, blob], ngpus=1) == (len(text), "compressible",
                                                                                           blob)
    finally:
        conn.close()
