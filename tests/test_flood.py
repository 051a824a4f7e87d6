"""A flood of silent connections, or one huge frame, cannot keep users out (issue 27): a TLS server holds 1000
connections that say nothing (opened again as soon as it closes them) without a process for any, serves a user
meanwhile, sums the drops up in a few log lines and counts them in /metrics; a frame header announcing more than
the frame limit is refused before its body is read. Real servers, real sockets on loopback."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import flood as flooding
from helpers import children, connection_processes, scrape, server_pid, server_process, wait_until
from rpyc.core.channel import Channel

import rpycdl
from rpycdl.client import credentials
from rpycdl.defaults import PER_SOURCE_STARTUPS
from rpycdl.security import auth, tls

MiB = 1 << 20


def _make_job():
    def job(n: int) -> int:
        return n * 2

    return job


_job = _make_job()


@contextmanager
def flood(source: str, port: int, count: int = 1000) -> Iterator[subprocess.Popen[str]]:
    """`count` silent connections from `source` to the server, opened again whenever it closes one, in a process
    of their own (tests/flood.py), from the moment the server has dropped as many until the block ends."""
    process = flooding.start(source, "127.0.0.1", port, count)
    try:
        yield process
    finally:
        process.communicate("", timeout=30)  # stdin closed: it stops


def _tree(pid: int) -> list[int]:
    return [pid] + [each for child in children(pid) for each in _tree(child)]


def pss(pid: int) -> int:
    """The proportional memory of a process and all its descendants, in bytes (smaps_rollup)."""
    total = 0
    for each in _tree(pid):
        try:
            rollup = Path(f"/proc/{each}/smaps_rollup").read_text()
        except OSError:  # gone meanwhile
            continue
        total += next((int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return total


def _user_runs(port: int, credentials: dict[str, str], jobs: int, pid: int,
               until: Callable[[], bool] = lambda: True) -> tuple[list[int], int]:
    """`jobs` times at least, and until `until()`: connect as alice, run a one-GPU job, close; the values, and the
    server tree's largest PSS seen after each."""
    values: list[int] = []
    peak = 0
    while len(values) < jobs or not until():
        with rpycdl.connect(host="127.0.0.1", port=port, **credentials) as conn:
            values.append(conn.root.run_code(_job, len(values), ngpus=1))
        peak = max(peak, pss(pid))
    return values, peak


def _flood_while_a_user_works(server, cluster, team, monitor, source: str) -> None:
    port = server("pytorch", "fake:2", *team.server_args())
    pid = server_pid(cluster, port)
    alice = team.user("alice")
    assert _user_runs(port, alice, 1, pid)[0] == [0]  # warm: spares and caches as the user finds them
    before = pss(pid)
    with flood(source, port) as hostile:
        # 20 jobs, and more until the flood has come round once more meanwhile (the kernel lets its silent
        # connections through to the server in waves: rpycdl.defaults.ACCEPT_DEFER)
        round_done = flooding.connected(hostile) + 1000
        values, peak = _user_runs(port, alice, 20, pid, lambda: flooding.connected(hostile) >= round_done)
        assert values == [2 * n for n in range(len(values))]
        assert len(connection_processes(pid)) <= 1, "a silent connection got a process"
        reconnects = flooding.connected(hostile) - 1000  # each after a drop
    assert peak - before < 256 * MiB, f"the server's tree grew by {(peak - before) / MiB:.0f} MiB of PSS"

    def dropped() -> float:
        return sum(count for labels, count in scrape(monitor).get("rpycdl_connections_dropped_total", [])
                   if labels["service"] == "pytorch")

    wait_until(lambda: dropped() >= reconnects, 15, f"the {reconnects} drops to be counted in /metrics")
    log = server_process(cluster, port).lines
    wait_until(lambda: any(f"more connections from {source} in " in line for line in log), 15, "the summing line")
    assert len(log) < 100, "\n".join(log[-30:])
    assert not any("Traceback" in line for line in log)


def test_a_flood_from_another_address_keeps_no_user_out(server, cluster, team, monitor):
    _flood_while_a_user_works(server, cluster, team, monitor, "127.0.0.2")


def test_a_flood_from_the_users_own_address_keeps_the_user_out_for_a_moment_at_most(server, cluster, team, monitor):
    _flood_while_a_user_works(server, cluster, team, monitor, "127.0.0.1")


def test_a_client_that_said_hello_stays_while_the_flood_of_its_address_is_dropped_around_it(server, team):
    """However slow the client is to go on after its hello, the gate drops only the flood's silent connections
    of its address to make room, never this one: the user's place does not hang on the machine's speed."""
    port = server("pytorch", "fake:2", *team.server_args())
    context = credentials.resolve(**team.user("alice")).tls_context()
    with flood("127.0.0.1", port) as hostile:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(auth.HELLO)
        assert auth.read_banner(sock) == {"tls"}  # the gate took it
        after = flooding.connected(hostile) + 2 * PER_SOURCE_STARTUPS
        wait_until(lambda: flooding.connected(hostile) >= after, 60, "the flood of its address to be dropped again")
        tls.connect(sock, context, "localhost").close()  # dropped meanwhile: ConnectionDroppedError


# -- frames that announce more than the limit -------------------------------------------------------------------


def _rss(pid: int) -> int:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmRSS:")), 0)


def _secret_client(port: int, secret: bytes) -> socket.socket:
    """A raw socket that has passed the server's secret handshake, as rpycdl's client does."""
    sock = socket.create_connection(("127.0.0.1", port))
    assert auth.read_banner(sock) == {"secret"}
    auth.client_handshake(sock, secret)
    return sock


def _refused_at_once(sock: socket.socket, body: int) -> None:
    """Announce a frame of 0xFFFFFFF0 bytes and send `body` bytes of it: the server must close the connection
    without reading them all."""
    sock.sendall(Channel.FRAME_HEADER.pack(0xFFFFFFF0, False))
    sock.settimeout(10)
    sent = 0
    try:
        while sent < body:
            sent += sock.send(bytes(min(MiB, body - sent)))
    except OSError:  # reset: it closed without reading
        pass
    try:
        while sock.recv(65536):  # a greeting, a nonce: then the end
            pass
    except ConnectionResetError:
        pass
    assert sent < body, "the server read the whole body of a frame over its limit"


def test_a_frame_over_the_limit_is_refused_on_its_header_authenticated_or_not(server, cluster, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("the team's shared secret, long enough")
    secret.chmod(0o600)
    port = server("pytorch", "fake:1", "--secret-file", str(secret), "--max-frame", "16MiB")
    pid = server_pid(cluster, port)
    parent = _rss(pid)
    stranger = socket.create_connection(("127.0.0.1", port))  # not authenticated: the gate reads its 64 bytes
    _refused_at_once(stranger, 256 * MiB)
    stranger.close()
    assert _rss(pid) - parent < 64 * MiB
    sock = _secret_client(port, secret.read_bytes().strip())
    (serving,) = wait_until(lambda: connection_processes(pid), what="the authenticated connection's process")
    baseline = _rss(serving)
    peak = 0

    def watch() -> None:
        nonlocal peak
        while rss := _rss(serving):
            peak = max(peak, rss)
            time.sleep(0.005)

    import threading

    watcher = threading.Thread(target=watch)
    watcher.start()
    _refused_at_once(sock, 1024 * MiB)
    sock.close()
    watcher.join(10)
    assert peak - baseline < 64 * MiB, f"{(peak - baseline) / MiB:.0f} MiB to refuse a frame"
    log = server_process(cluster, port).lines
    wait_until(lambda: any("over this server's limit of 16777216 (--max-frame)" in line for line in log),
               what="the log line")
    with rpycdl.connect(host="127.0.0.1", port=port, secret_file=str(secret)) as conn:
        assert conn.root.run_code(lambda x: x, "still serving") == "still serving"


def test_a_frame_at_the_limit_goes_through(server, cluster):
    """An original client (plain RPyC) sends its arguments in RPyC frames: one of the frame limit arrives."""
    import dill
    import rpyc

    port = server("pytorch", "fake:1", "--max-frame", "16MiB")
    conn = rpyc.connect("127.0.0.1", port, config={"allow_public_attrs": True})
    try:
        conn._channel.compress = False  # so that the frame is as long as the call

        def size(blob):
            return len(blob)

        code = dill.dumps(size, recurse=True)
        blob = b"x" * (16 * MiB - 64 * 1024)  # the frame: the blob, the code and RPyC's call around them
        assert conn.root.run_code(code, blob) == len(blob)
    finally:
        conn.close()
