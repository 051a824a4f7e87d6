"""A flood of silent connections, as a hostile client makes them (a helper of tests/test_flood.py and
bench/bench_flood.py, run as a process of its own): COUNT connections from the source address SOURCE to
HOST:PORT that say nothing, each opened again as soon as the server closes it, until stdin closes. It
prints `holding COUNT` once all are open, `connected N` (how many times it connected so far) for each line it
reads, and the same at the end.

    python tests/flood.py SOURCE HOST PORT COUNT

Its drivers start it with `start` (which returns once the server has dropped as many connections as it holds)
and ask `connected` as they go.
"""

from __future__ import annotations

import errno
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time


def start(source: str, host: str, port: int, count: int, timeout: float = 60.0) -> subprocess.Popen[str]:
    """Run the flood in a process of its own, and return once the server has taken and dropped `count` of its
    connections (it sees silent ones only after the kernel has held them for rpycdl.defaults.ACCEPT_DEFER):
    from then on the flood is at the server's gate. End it by closing its stdin (`communicate("")`).

    Raises:
        TimeoutError: the server had not dropped as many after `timeout` seconds.
    """
    process = subprocess.Popen([sys.executable, __file__, source, host, str(port), str(count)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().startswith(f"holding {count}")
    deadline = time.monotonic() + timeout
    while connected(process) < 2 * count:
        if time.monotonic() > deadline:
            process.communicate("", timeout=30)
            raise TimeoutError(f"the server at {host}:{port} dropped fewer than {count} of the flood's connections "
                               f"in {timeout:g} s")
        time.sleep(0.05)
    return process


def connected(process: subprocess.Popen[str]) -> int:
    """How many times the flood running as `process` (started by `start`) has connected so far."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("\n")
    process.stdin.flush()
    return int(process.stdout.readline().split()[1])


def _open(source: str, host: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.setblocking(False)
    try:
        sock.connect((host, port))
    except BlockingIOError:
        pass
    except OSError as exc:
        if exc.errno != errno.EINPROGRESS:
            raise
    return sock


def main() -> None:
    source, host, port, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = threading.Event()
    selector = selectors.DefaultSelector()
    connects = 0

    def answer() -> None:
        for _ in sys.stdin:
            print(f"connected {connects}", flush=True)
        stop.set()

    threading.Thread(target=answer, daemon=True).start()
    for _ in range(count):
        selector.register(_open(source, host, port), selectors.EVENT_READ)
        connects += 1
    print(f"holding {count}", flush=True)
    while not stop.is_set():
        for key, _ in selector.select(0.2):
            sock = key.fileobj
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:  # a greeting or a BUSY line: read, never answered
                continue
            selector.unregister(sock)
            sock.close()
            try:
                selector.register(_open(source, host, port), selectors.EVENT_READ)
                connects += 1
            except OSError:  # out of ports for a moment: one fewer
                pass
    print(f"connected {connects}", flush=True)


if __name__ == "__main__":
    main()
