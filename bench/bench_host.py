"""What a host charges for the operating-system steps a job is made of, each against the same step done the
cheapest way in the same run, to tell a slow host from slow code (why `run_code` on an open connection took 10
ms on a lent 16-core GPU machine and 4 ms on the 2-core development VM: BENCHMARKS.md). Each row times one step
many times and prints its median and p90:

- fork of a process of the job forkserver's size (a ~30 MB interpreter), its child exiting at once, reaped;
  the same with the child writing 1600 pages first (copy-on-write faults, as a connection process's life);
  and the first write of fresh pages (a page fault each);
- a one-byte pipe round trip between two processes (what every hand-off between them costs);
- reading one process's /proc/PID/stat, and listing /proc (a sweep, a job's processes found);
- a thread woken through a pipe (the server's sweeper, a connection's output pump);
- mkdir and rmdir of an empty directory in the state directory's filesystem (each job makes and removes two).

    python bench/bench_host.py [--n 2000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import rpyc  # noqa: F401 - imported for its size: a process the size of the job forkserver

import rpycdl  # noqa: F401
from rpycdl.server import forkserver  # noqa: F401


def timed(step: Callable[[], object], n: int) -> list[float]:
    """Each of `n` runs of `step`, in microseconds (after 10 untimed ones)."""
    for _ in range(10):
        step()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def fork_and_reap() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


PAGE = os.sysconf("SC_PAGE_SIZE")
COPIED = bytearray(1600 * PAGE)
"""Pages a forked child writes, as a connection process does in its life (ARCHITECTURE.md, Why ahead)."""


def fork_write_reap() -> None:
    """fork_and_reap, the child first writing one byte in each of COPIED's pages (copy-on-write faults)."""
    pid = os.fork()
    if pid == 0:
        for offset in range(0, len(COPIED), PAGE):
            COPIED[offset] = 1
        os._exit(0)
    os.waitpid(pid, 0)


def first_touch() -> None:
    """256 pages of fresh memory, each written once (a page fault each)."""
    with mmap.mmap(-1, 256 * PAGE) as fresh:
        for offset in range(0, 256 * PAGE, PAGE):
            fresh[offset] = 1


def pipe_round_trip() -> Callable[[], None]:
    """A child echoing each byte back: one round trip a call."""
    to_child, from_parent = os.pipe()
    from_child, to_parent = os.pipe()
    if os.fork() == 0:
        os.close(from_parent)  # so that the parent's exit ends it
        while os.read(to_child, 1):
            os.write(to_parent, b"!")
        os._exit(0)
    os.close(to_child)

    def step() -> None:
        os.write(from_parent, b"?")
        os.read(from_child, 1)

    return step


def thread_wakeup() -> Callable[[], None]:
    """A thread woken through a pipe, answering through another."""
    wake_r, wake_w = os.pipe()
    done_r, done_w = os.pipe()

    def serve() -> None:
        while os.read(wake_r, 1):
            os.write(done_w, b"!")

    threading.Thread(target=serve, daemon=True).start()

    def step() -> None:
        os.write(wake_w, b"?")
        os.read(done_r, 1)

    return step


def read_stat() -> None:
    with open(f"/proc/{os.getpid()}/stat", "rb") as stat:
        stat.read()


def mkdir_rmdir(directory: str) -> Callable[[], None]:
    path = os.path.join(directory, "d")

    def step() -> None:
        os.mkdir(path)
        os.rmdir(path)

    return step


def row(name: str, samples: list[float], baseline: list[float] | None = None) -> str:
    median, p90 = statistics.median(samples), sorted(samples)[int(0.9 * (len(samples) - 1))]
    ratio = f"{median / statistics.median(baseline):.1f}x" if baseline else ""
    return f"| {name} | {median:.1f} us | {p90:.1f} us | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="runs of each step (default: %(default)s)")
    parser.add_argument("--dir", default=None, help="where to make directories (default: the temporary directory)")
    args = parser.parse_args()
    with open("/proc/self/status") as status:
        rss = next(line.split()[1] for line in status if line.startswith("VmRSS"))
    print(f"{platform.node()}: {os.cpu_count()} cores, {platform.release()}, Python {platform.python_version()}; "
          f"this process {int(rss) // 1024} MiB resident\n")
    print("| step | median | p90 | against the pipe round trip |\n|---|---|---|---|")
    pipe = timed(pipe_round_trip(), args.n)
    print(row("pipe round trip between two processes", pipe))
    print(row("fork of this process, exit, reap", timed(fork_and_reap, max(200, args.n // 10)), pipe))
    print(row("the same, the child writing 1600 pages first", timed(fork_write_reap, max(200, args.n // 10)), pipe))
    print(row("first write of 256 fresh pages (mmap)", timed(first_touch, args.n // 4), pipe))
    print(row("thread woken through a pipe", timed(thread_wakeup(), args.n), pipe))  # after the forks: a thread
    print(row("read /proc/PID/stat", timed(read_stat, args.n), pipe))
    print(row(f"list /proc ({len(os.listdir('/proc'))} entries)", timed(lambda: os.listdir("/proc"), args.n // 4),
              pipe))
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        print(row("mkdir and rmdir", timed(mkdir_rmdir(directory), args.n), pipe))


if __name__ == "__main__":
    main()
