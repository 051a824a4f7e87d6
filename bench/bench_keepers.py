"""What a job's keeper costs (issue 35): the proportional memory (Pss: pages shared after a fork count once) of
each running job's keeper against that of its job process, measured in the same run, with --jobs attached jobs
running at once on a fake server; and the server's whole process tree per running job.

    python bench/bench_keepers.py [--jobs 16] [--preload MODULES]

Each job sleeps until the measure is taken. Prints a Markdown table (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench_payload import process_tree, pss_of

import rpycdl
from rpycdl.scheduler import procs
from rpycdl.site.local import LocalCluster

KiB = 1 << 10


def sleeper(path: str) -> int:
    """A job that waits until `path` exists."""
    import os
    import time

    while not os.path.exists(path):
        time.sleep(0.05)
    return os.getpid()


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=16, help="attached jobs running at once (default: %(default)s)")
    parser.add_argument("--preload", default="", help="the server's --preload (default: none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        release = str(Path(lock_dir, "release"))
        process, port = cluster.add_server("pytorch", f"fake:{args.jobs}", "--preload", args.preload)
        server = process.popen.pid
        time.sleep(2)  # its spares ready
        idle = sum(map(pss_of, process_tree(server)))
        conns = [rpycdl.connect(host="127.0.0.1", port=port) for _ in range(args.jobs)]
        threads = [threading.Thread(target=conn.root.run_code, args=(sleeper, release), daemon=True)
                   for conn in conns]
        for thread in threads:
            thread.start()

        def running() -> list[int]:
            return [pid for pid in process_tree(server) if comm(pid) == "rpycdl-job"
                    and comm(procs.stat(pid).ppid if procs.stat(pid) else 0) == "rpycdl-keeper"]

        while len(running()) < args.jobs + 2:  # its jobs, and the spares' job processes
            time.sleep(0.1)
        time.sleep(1)
        jobs = running()
        keepers = [procs.stat(pid).ppid for pid in jobs]
        busy = sum(map(pss_of, process_tree(server)))
        keeper_pss, job_pss = [pss_of(pid) for pid in keepers], [pss_of(pid) for pid in jobs]
        Path(release).touch()
        for thread in threads:
            thread.join(30)
        for conn in conns:
            conn.close()
    print(f"Machine: {platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}; "
          f"--preload {args.preload!r}; {args.jobs} jobs running\n")
    print("| Pss | median | max |")
    print("|---|---|---|")
    for name, values in (("a keeper", keeper_pss), ("its job process (the baseline)", job_pss)):
        print(f"| {name} | {statistics.median(values) / KiB:.0f} KiB | {max(values) / KiB:.0f} KiB |")
    print(f"| server tree per running job ({len(jobs)} job processes, spares included) | "
          f"{(busy - idle) / args.jobs / KiB:.0f} KiB | |")
    print(f"\na keeper: {statistics.median(keeper_pss) / statistics.median(job_pss):.2f}x its job process's Pss "
          "(median)")


if __name__ == "__main__":
    main()
