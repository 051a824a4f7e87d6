"""Payload throughput: random bytes and a NumPy array of random floats, as argument and as return
value, against a raw loopback TCP socket measured in the same run; and the server's peak memory
(its connection process and job process together) against the payload size.

    python bench/bench_payload.py [--mib 1024] [--runs 3] [--urandom]

Argument: from run_code's call to the function starting with its argument in hand (the function
returns time.monotonic(), the same clock on this machine). Result: from the function returning
(its value was made before the clock is read) to run_code returning the value. So neither
includes the job's own work of making or using the data, and each includes everything else on
its way: pickling, the transfer, the connection and job processes, unpickling. MB/s are 10^6
bytes per second. Memory is measured in separate runs (sampling costs CPU): the peak, over the
same span, of the proportional set size (Pss, so pages the job shares with the connection process
after the fork count once) of the connection process and its children.

Random bytes come from NumPy's generator, written in user space. With --urandom they come from
os.urandom, as in earlier runs: on the development VM, memory the kernel's getrandom wrote makes
a bytes result several times slower, and a process holding such memory at times faults in new
memory at a fifth of the usual rate (bench_fault_in.py; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import rpycdl
from rpycdl.scheduler import procs
from rpycdl.site.local import LocalCluster

MB = 1e6


def raw_socket_rate(payload: bytes) -> float:
    """MB/s of sending `payload` over loopback TCP with sendall to recv_into in another process
    (as client and server are), whose buffer is allocated and touched before the clock starts;
    the clock stops when the receiver acknowledges the last byte."""
    size = len(payload)
    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()
    pid = os.fork()
    if pid == 0:  # the receiver
        received = bytearray(size)
        conn, _ = server.accept()
        conn.sendall(b"r")  # ready
        view, done = memoryview(received), 0
        while done < size:
            done += conn.recv_into(view[done:], min(size - done, 1 << 24))
        conn.sendall(b"!")
        os._exit(0)
    server.close()  # the receiver has it
    client = socket.create_connection(address)
    assert client.recv(1) == b"r"
    start = time.perf_counter()
    client.sendall(payload)
    assert client.recv(1) == b"!"
    elapsed = time.perf_counter() - start
    client.close()
    os.waitpid(pid, 0)
    return size / MB / elapsed


def _started(data: Any) -> float:
    import time

    return time.monotonic()


def _random_bytes(size: int) -> tuple[float, bytes]:
    import time

    import numpy

    data = numpy.random.default_rng().bytes(size)
    return time.monotonic(), data


def _urandom_bytes(size: int) -> tuple[float, bytes]:
    import os
    import time

    data = os.urandom(size)
    return time.monotonic(), data


def _random_array(size: int) -> tuple[float, Any]:
    import time

    import numpy

    data = numpy.random.default_rng().random(size // 8)
    return time.monotonic(), data


def argument_span(conn: rpycdl.Connection, data: Any) -> tuple[float, float]:
    """(start, end) on the monotonic clock: from the call to the function starting."""
    start = time.monotonic()
    return start, conn.root.run_code(_started, data)


def result_span(conn: rpycdl.Connection, make: Callable[[int], Any], size: int) -> tuple[float, float]:
    """(start, end) on the monotonic clock: from the function returning to run_code returning."""
    returned, value = conn.root.run_code(make, size)
    done = time.monotonic()
    assert len(value) * value.itemsize == size if isinstance(value, np.ndarray) else len(value) == size
    return returned, done


class PssPeak:
    """Samples the summed Pss of a process and its children in a thread; `peak(start, end)` is the
    largest sample taken between two monotonic times, in bytes."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float, end: float) -> int:
        return max((pss for at, pss in self.samples if start <= at <= end), default=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), sum(pss_of(pid) for pid in process_tree(self.pid))))
            time.sleep(self.interval)


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    pids = [pid]
    for child in procs.children(pid):
        pids.extend(process_tree(child))
    return pids


def pss_of(pid: int) -> int:
    """A process's proportional set size in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="payload size in MiB (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each case (default: %(default)s)")
    parser.add_argument("--urandom", action="store_true", help="make the random bytes with os.urandom")
    args = parser.parse_args()
    size = args.mib << 20
    random_bytes = os.urandom(size) if args.urandom else np.random.default_rng().bytes(size)
    payloads = {"bytes": (random_bytes, _urandom_bytes if args.urandom else _random_bytes),
                "NumPy float64": (np.random.default_rng(0).random(size // 8), _random_array)}
    raw: list[float] = []
    rates: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        _, port = cluster.add_server("pytorch", "fake:1")
        for _ in range(args.runs):
            raw.append(raw_socket_rate(random_bytes))
            for kind, (data, make) in payloads.items():
                with rpycdl.connect(host="127.0.0.1", port=port) as conn:
                    for way, (start, end) in (("argument", argument_span(conn, data)),
                                              ("result", result_span(conn, make, size))):
                        rates.setdefault((kind, way), []).append(size / MB / (end - start))
                print(f"raw {raw[-1]:.0f} MB/s; {kind}: argument {rates[kind, 'argument'][-1]:.0f} MB/s, result "
                      f"{rates[kind, 'result'][-1]:.0f} MB/s", file=sys.stderr, flush=True)
        for kind, (data, make) in payloads.items():
            for way, call in (("argument", lambda c, data=data: argument_span(c, data)),
                              ("result", lambda c, make=make: result_span(c, make, size))):
                with rpycdl.connect(host="127.0.0.1", port=port) as conn:
                    pid = json.loads(conn.root.server_info())["pid"]  # answered by this connection's own process
                    with PssPeak(pid) as sampler:
                        start, end = call(conn)
                    peaks[kind, way] = sampler.peak(start, end)
    client_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    raw_median = statistics.median(raw)
    print(f"{args.mib} MiB, {args.runs} runs; raw loopback socket {min(raw):.0f} to {max(raw):.0f} MB/s, "
          f"median {raw_median:.0f}\n")
    print("| payload | way | MB/s (median) | MB/s (min to max) | ratio to raw (median) | server peak | x payload |")
    print("|---|---|---|---|---|---|---|")
    for (kind, way), values in rates.items():
        median = statistics.median(values)
        print(f"| {args.mib} MiB {kind} | {way} | {median:.0f} | {min(values):.0f} to {max(values):.0f} | "
              f"{median / raw_median:.2f} | {peaks[kind, way] / 2**20:.0f} MiB | {peaks[kind, way] / size:.2f} |")
    print(f"\nclient peak RSS {client_peak:.0f} MiB")


if __name__ == "__main__":
    main()
