"""Payload throughput: random bytes as argument and as return value, against a raw loopback TCP
socket measured in the same run, and the server's peak memory against the payload size.

    python bench/bench_payload.py [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import tempfile
import threading
import time

import rpycdl
from rpycdl.local import LocalCluster


def raw_socket_rate(size: int) -> float:
    """MiB/s of sending `size` bytes over loopback TCP with sendall/recv_into."""
    payload = os.urandom(size)
    server = socket.create_server(("127.0.0.1", 0))
    received = bytearray(size)

    def sink() -> None:
        conn, _ = server.accept()
        view, done = memoryview(received), 0
        while done < size:
            done += conn.recv_into(view[done:])
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(server.getsockname())
    start = time.perf_counter()
    client.sendall(payload)
    thread.join()
    elapsed = time.perf_counter() - start
    client.close()
    server.close()
    return size / 2**20 / elapsed


def connection_peak_mib(_: object) -> float:
    """Runs on the server: the peak memory of the connection process serving this client."""
    import os

    with open(f"/proc/{os.getppid()}/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM")).split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB (default: %(default)s)")
    args = parser.parse_args()
    size = args.mib << 20
    data = os.urandom(size)
    raw = raw_socket_rate(size)
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        _, port = cluster.add_server("pytorch", "fake:1")
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            start = time.perf_counter()
            conn.root.run_code(lambda blob: len(blob), data)
            up = args.mib / (time.perf_counter() - start)
            start = time.perf_counter()
            back = conn.root.run_code(lambda n: bytes(n), size)
            down = args.mib / (time.perf_counter() - start)
            assert len(back) == size
            server_peak = conn.root.run_code(connection_peak_mib, None)
    client_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"| payload {args.mib} MiB | argument {up:.0f} MiB/s | result {down:.0f} MiB/s | raw loopback socket "
          f"{raw:.0f} MiB/s | ratio {up / raw:.3f} / {down / raw:.3f} |")
    print(f"peak memory: server connection process {server_peak:.0f} MiB ({server_peak / args.mib:.1f}x the "
          f"payload), client {client_peak:.0f} MiB")


if __name__ == "__main__":
    main()
