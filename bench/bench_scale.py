"""What pending detached jobs cost a server (issue 35), at each count of --counts, against the least count measured
in the same run: N trivial detached jobs submitted behind one running job, on a fake:1 server of its own for each
count.

- growth of the server's process tree while they wait: Pss (pages shared after a fork count once) and processes,
  per pending job;
- a submit's latency on an open connection (p50 over the N submits);
- `conn.root.jobs()` as `rpycdl jobs` asks it (its default view, the newest 100) and with `limit=0` (every row), and
  `conn.root.gpu_status()` (what `rpycdl status` asks) with N pending, p50;
- the hand-off with about N waiting: from the running job's function returning to the next job's function
  starting, the median of the first --handoffs hand-offs (each of those jobs runs --job-seconds and returns when
  its function started and ended).

    python bench/bench_scale.py [--counts 6,100,1000,10000] [--handoffs 5] [--job-seconds 0.5]

A count below --handoffs + 1 is raised to it (so many must wait for the hand-offs timed).

The issue's targets, for 10,000 pending: at most 64 KiB of Pss and no process a pending job, a submit in 10 ms,
jobs and status in 1 s, the hand-off at most 2x the one with none waiting. A pending detached job is a row (its
queue entry and ledger row): its supervisor starts when its turn comes. Prints a Markdown table (see
BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import statistics
import tempfile
import time

from bench_payload import process_tree, pss_of

import rpycdl
from rpycdl.site.local import LocalCluster

KiB, MiB = 1 << 10, 1 << 20


def hold_until(until: float) -> tuple[float, float]:
    """The running job: returns at `until` (time.time()); when its function started and ended."""
    import time

    start = time.time()
    while time.time() < until:
        time.sleep(min(0.01, max(0.0, until - time.time())))
    return start, time.time()


def stamp(seconds: float) -> tuple[float, float]:
    """A pending job: runs `seconds`; when its function started and ended."""
    import time

    now = time.time()
    time.sleep(seconds)
    return now, time.time()


def measure(count: int, handoffs: int, seconds: float) -> dict[str, float]:
    """One count, on a server of its own: the figures of the module's docstring."""
    limit = str(count + 50)
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        process, port = cluster.add_server("pytorch", "fake:1", "--preload", "", "--max-queued", limit,
                                           "--max-queued-per-user", limit)
        server = process.popen.pid
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            settle = 3.0
            holder = conn.root.submit(hold_until, time.time() + 3600, ngpus=1)  # released below, by a cancel
            time.sleep(2)
            tree = process_tree(server)
            before_pss, before_procs = sum(map(pss_of, tree)), len(tree)
            submits, jobs = [], []
            for _ in range(count):
                start = time.perf_counter()
                jobs.append(conn.root.submit(stamp, seconds if len(jobs) <= handoffs else 0.0, ngpus=1))
                submits.append(time.perf_counter() - start)
            time.sleep(settle)  # what each started has started
            tree = process_tree(server)
            grown_pss, grown_procs = sum(map(pss_of, tree)) - before_pss, len(tree) - before_procs
            default = _timed(conn.root.jobs, 5)
            listing = _timed(lambda: conn.root.jobs(limit=0), 3)
            status = _timed(conn.root.gpu_status, 5)
            holder.cancel()
            spans = [job.result(timeout=120) for job in jobs[:handoffs + 1]]
    gaps = [after[0] - before[1] for before, after in zip(spans, spans[1:], strict=False)]
    return {"pss": grown_pss / count, "procs": grown_procs / count, "submit": statistics.median(submits),
            "default": default, "jobs": listing, "status": status, "handoff": statistics.median(gaps)}


def _timed(call, times: int) -> float:
    taken = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        taken.append(time.perf_counter() - start)
    return statistics.median(taken)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="6,100,1000,10000",
                        help="pending jobs, comma-separated (default: %(default)s)")
    parser.add_argument("--handoffs", type=int, default=5, help="hand-offs timed at each count (default: %(default)s)")
    parser.add_argument("--job-seconds", type=float, default=0.5,
                        help="how long each job of the hand-offs runs (default: %(default)s; a job shorter than a "
                             "supervisor's start, about 0.2 s here, times that start instead)")
    args = parser.parse_args()
    counts = sorted({max(int(each), args.handoffs + 1) for each in args.counts.split(",")})  # enough for the hand-offs
    figures = {count: measure(count, args.handoffs, args.job_seconds) for count in counts}
    base = figures[min(figures)]
    print(f"Machine: {platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}\n")
    print("| pending | Pss per pending job | processes per pending job | submit p50 | jobs() p50 "
          "| jobs(limit=0) p50 | gpu_status() p50 | hand-off | hand-off / the least count's |")
    print("|---|---|---|---|---|---|---|---|---|")
    for count, each in figures.items():
        print(f"| {count} | {each['pss'] / KiB:.1f} KiB | {each['procs']:.3f} | {each['submit'] * 1e3:.1f} ms | "
              f"{each['default'] * 1e3:.1f} ms | {each['jobs'] * 1e3:.1f} ms | {each['status'] * 1e3:.1f} ms | "
              f"{each['handoff'] * 1e3:.1f} ms | {each['handoff'] / base['handoff']:.2f}x |")
    print("\ntargets at 10,000 pending: 64 KiB and 0 processes a pending job, submit 10 ms, jobs() and gpu_status() "
          "1 s, hand-off 2x")


if __name__ == "__main__":
    main()
