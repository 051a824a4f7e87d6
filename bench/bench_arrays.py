"""Job arrays (issue 37 item 1), each against a baseline measured in the same run:

1. submit_array of --size trivial elements (one request) against one plain `submit` on the same connection, and
   the disk a pending element costs (state and lock directories, ledger included, measured with `du` while every
   element waits behind a job that holds the server's one GPU), then every result back in order;
2. the makespan of --elements elements of --seconds each on `fake:4` against their zero-overhead schedule
   (elements x seconds / 4), and Ray's `ray.get([f.remote(x) ...])` on the same workload (4 CPUs as the slots) in
   the same run where Ray imports.

    python bench/bench_arrays.py [--size 10000] [--elements 1000] [--seconds 0.05] [--no-results]

The submit's line also gives the CPU seconds the servers' processes used meanwhile (its connection process, the
dispatchers and sweeps that read the new rows): on a busy machine its wall-clock time varies with the load.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import rpycdl
from rpycdl.defaults import STATE_SUBDIR
from rpycdl.site.local import LocalCluster


def _made():
    """The jobs, made in a function so that dill sends them by value."""

    def trivial(x):
        return x

    def sleeper(seconds):
        import time

        time.sleep(seconds)
        return seconds

    def gated(gate):
        import os
        import time

        while not os.path.exists(gate):
            time.sleep(0.05)

    return trivial, sleeper, gated


trivial, sleeper, gated = _made()


def disk(*paths: Path) -> int:
    """Bytes the paths take on disk (du)."""
    out = subprocess.run(["du", "-s", "-B1", *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines())


def tree_cpu() -> float:
    """CPU seconds (user and system) of this process's live descendants, and of the children they reaped: the
    servers' processes (their connection processes, dispatchers, sweeps)."""
    stats: dict[int, tuple[int, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(pid)] = (int(fields[1]), sum(map(int, fields[11:15])) / os.sysconf("SC_CLK_TCK"))
    mine, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, (parent, _) in stats.items() if parent in mine} - mine
        grew, mine = bool(found), mine | found
    return sum(stats[pid][1] for pid in mine - {os.getpid()} if pid in stats)


def submit_and_results(size: int, results: bool = True) -> None:
    with tempfile.TemporaryDirectory() as locks, LocalCluster(locks) as cluster:
        port = cluster.add_server("pytorch", "fake:1", "--max-queued-per-user", str(size + 10),
                                  "--max-queued", str(size + 10))[1]
        gate = os.path.join(locks, "gate")
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            blocker = conn.root.submit(gated, gate)
            while blocker.status().state is not rpycdl.JobState.RUNNING:
                time.sleep(0.05)
            began = time.perf_counter()
            one = conn.root.submit(trivial, 0)
            single = time.perf_counter() - began
            one.cancel()
            time.sleep(1.0)
            before = disk(Path(locks))
            began, cpu = time.perf_counter(), tree_cpu()
            array = conn.root.submit_array(trivial, list(range(size)))
            submitted, cpu = time.perf_counter() - began, tree_cpu() - cpu
            time.sleep(1.0)  # the dispatcher's first pass over the new rows
            per_element = (disk(Path(locks)) - before) / size
            print(f"submit_array of {size}: {submitted:.2f} s (one request; {submitted / size * 1e3:.3f} ms an "
                  f"element), a plain submit {single * 1e3:.1f} ms: {submitted / single:.0f}x one submit for "
                  f"{size} jobs; the servers' processes used {cpu:.2f} s of CPU meanwhile")
            print(f"a pending element costs {per_element / 1024:.1f} KiB on disk (state dir {STATE_SUBDIR}/ and lock "
                  "directory, ledger included)")
            Path(gate).touch()
            if not results:
                array.cancel()
                return
            began = time.perf_counter()
            values = array.results(timeout=3600)
            took = time.perf_counter() - began
            print(f"results of {size} in order: {values == list(range(size))}, {took:.1f} s from the gate to the "
                  f"last ({took / size * 1e3:.1f} ms an element)")


def metadata_cost(directory: str, count: int = 200) -> float:
    """Seconds a directory and a file in it take to make on `directory`'s file system (what an element's start and a
    row's place in line are made of), on average."""
    began = time.perf_counter()
    for index in range(count):
        os.mkdir(f"{directory}/{index}")
        os.close(os.open(f"{directory}/{index}/file", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return (time.perf_counter() - began) / count


def makespan(elements: int, seconds: float) -> float:
    ideal = elements * seconds / 4
    with tempfile.TemporaryDirectory() as scratch:
        print(f"the state directory's file system ({tempfile.gettempdir()}): a directory and a file in it made in "
              f"{metadata_cost(scratch) * 1e6:.0f} us")
    with tempfile.TemporaryDirectory() as locks, LocalCluster(locks) as cluster:
        port = cluster.add_server("pytorch", "fake:4")[1]
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            began = time.perf_counter()
            values = conn.root.submit_array(sleeper, [seconds] * elements).results(timeout=3600)
            took = time.perf_counter() - began
    assert values == [seconds] * elements
    print(f"makespan of {elements} elements of {seconds * 1e3:.0f} ms on fake:4: {took:.1f} s, zero-overhead "
          f"schedule {ideal:.1f} s: {took / ideal:.2f}x")
    return took


def ray_makespan(elements: int, seconds: float, ours: float) -> None:
    try:
        import ray
    except ImportError:
        print("Ray: not installed here, not measured")
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=1)(sleeper)
        began = time.perf_counter()
        ray.get([remote.remote(seconds) for _ in range(elements)])
        took = time.perf_counter() - began
    finally:
        ray.shutdown()
    print(f"Ray ray.get([f.remote(x) ...]) of the same: {took:.1f} s; rpycdl's array {ours / took:.2f}x Ray's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--elements", type=int, default=1000, help="0: no makespan")
    parser.add_argument("--seconds", type=float, default=0.05)
    parser.add_argument("--no-results", action="store_true", help="cancel the large array once submitted and measured")
    args = parser.parse_args()
    submit_and_results(args.size, not args.no_results)
    if not args.elements:
        return
    ours = makespan(args.elements, args.seconds)
    ray_makespan(args.elements, args.seconds, ours)


if __name__ == "__main__":
    main()
