"""Detached jobs and the job ledger, each against a baseline measured in the same run:

1. submit latency (`conn.root.submit` returning: the job is in the ledger then) against an attached
   `run_code` round trip on the same open connection, and submit to `job.result()` against that
   round trip; each job measured ends, and its supervisor has exited, before the next is submitted,
   so nothing piles up in the queue; the two kinds alternate, so the machine's drift falls on both.
2. `conn.root.jobs(...)` and the `rpycdl jobs` CLI on a ledger of --rows finished jobs (written
   before its server starts) against the same calls on an empty ledger (a server of its own).

    python bench/bench_jobs.py [--samples 300] [--rows 100000] [--calls 100] [--cli-runs 10]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench_core import percentile, timed, trivial

import rpycdl
from rpycdl.defaults import JOBS_SHOWN, STATE_SUBDIR
from rpycdl.scheduler.ledger import JobRecord, JobState, Ledger
from rpycdl.server.jobcalls import window
from rpycdl.site.local import LocalCluster

Row = tuple[str, list[float], list[float], str]
"""A line of the table: label, samples, baseline samples, what the baseline is."""


def supervisor_gone(pid: int, timeout: float = 2.0) -> None:
    """Wait until process `pid` has exited (gone, or a zombie)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.002)


def submit_vs_run(port: int, n: int, warmup: int) -> tuple[list[Row], dict[str, list[float]]]:
    """Alternate an attached round trip and a detached submit (then its result) on one open connection.
    Returns the table's rows, and where a detached job's time goes (from its ledger row's times)."""
    runs: list[float] = []
    submits: list[float] = []
    results: list[float] = []
    waited = "submitted -> started (supervisor start, grant, job process)"
    ran, seen_after = "started -> ended", "ended -> result() returned"
    parts: dict[str, list[float]] = {waited: [], ran: [], seen_after: []}
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        for i in range(warmup + n):
            start = time.perf_counter()
            conn.root.run_code(trivial, 1, ngpus=1)
            run = time.perf_counter() - start
            start = time.perf_counter()
            job = conn.root.submit(trivial, 1, ngpus=1)
            submitted = time.perf_counter() - start
            assert job.result() == 2
            done, seen = time.perf_counter() - start, time.time()
            supervisor_gone(job.info["owner_pid"])
            if i < warmup:
                continue
            runs.append(run)
            submits.append(submitted)
            results.append(done)
            row = job.refresh()
            parts[waited].append((row["started"] - row["submitted"]).total_seconds())  # rows' times: datetimes
            parts[ran].append((row["ended"] - row["started"]).total_seconds())
            parts[seen_after].append(seen - row["ended"].timestamp())
    baseline = "run_code(trivial, 1, ngpus=1), open connection"
    return [("submit(trivial, 1, ngpus=1) returns", submits, runs, baseline),
            ("submit to job.result() returned", results, runs, baseline)], parts


USERS = [f"user{i:02d}" for i in range(20)]
USER_WEIGHTS = [1 / (rank + 1) for rank in range(len(USERS))]  # Zipf-like: a few users submit most
STATES = {JobState.SUCCEEDED: 70, JobState.FAILED: 15, JobState.CANCELLED: 8, JobState.TIMED_OUT: 4,
          JobState.LOST: 3}
SPAN = 6.9 * 24 * 3600
"""Rows are submitted over the last 6.9 days: the server's default --keep (7 days) prunes none of them."""


def fill_ledger(state_dir: str, rows: int, seed: int = 1) -> None:
    """Write `rows` finished jobs to the ledger of `state_dir` (created by Ledger), with executemany over
    the columns of JobRecord, converted as the ledger does: JSON text for lists and dicts, 0/1 for
    booleans; users, states and submitted times (uniform over SPAN) drawn at random, rows in the order of
    their submitted times, as a server writes them."""
    ledger = Ledger(state_dir)
    rng, now = random.Random(seed), time.time()
    columns = [field.name for field in dataclasses.fields(JobRecord)]
    states = rng.choices(list(STATES), weights=list(STATES.values()), k=rows)
    users = rng.choices(USERS, weights=USER_WEIGHTS, k=rows)
    times = sorted(now - SPAN * rng.random() for _ in range(rows))  # written in the order they were submitted

    def row(i: int) -> tuple[Any, ...]:
        submitted = times[i]
        started = submitted + rng.expovariate(1 / 30)
        record = JobRecord(
            job_id=f"{i:012x}", server_id="0123456789ab", client="10.0.0.7:40000", ngpus=rng.choice((1, 1, 2, 4)),
            state=states[i], owner_pid=1000 + i % 30000, gpu_uuids=["GPU-00000000-0000-4000-8000-000000000000"],
            submitted=submitted, started=started, ended=min(now, started + rng.expovariate(1 / 600)), user=users[i],
            name=f"run-{i}" if i % 5 == 0 else None, detached=i % 2 == 0, service="pytorch", server="10.0.0.2:18861",
            request={"timeout": None, "queue_timeout": None}, log_bytes=rng.randrange(10**6),
            error="" if states[i] is JobState.SUCCEEDED else "it ended badly")
        data = record.to_dict()
        return tuple(json.dumps(value) if isinstance(value, (list, dict)) else int(value) if isinstance(value, bool)
                     else value for value in (data[column] for column in columns))

    with contextlib.closing(sqlite3.connect(ledger.path)) as db, db:
        db.executemany(f"INSERT INTO jobs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                       (row(i) for i in range(rows)))
    assert ledger.count() == rows and ledger.get(f"{rows - 1:012x}") is not None  # readable as the server reads it
    ledger.close()


QUERIES: dict[str, dict[str, Any]] = {
    "jobs() (default: unfinished or ended in the last day, 100)": {},
    "jobs(all=True) (100 newest)": {"all": True},
    f"jobs(all=True, users=[{USERS[3]!r}])": {"all": True, "users": [USERS[3]]},
    "jobs(all=True, states=['FAILED'], since=3600)": {"all": True, "states": ["FAILED"], "since": 3600},
}


def in_process(state_dir: str, calls: int) -> dict[str, list[float]]:
    """Each query as the server's Ledger.query runs it (SQL and rows, without encoding nor the call)."""
    ledger = Ledger(state_dir)

    def query(asked: dict[str, Any]) -> list[JobRecord]:
        return ledger.query(users=asked.get("users"), states=asked.get("states"), limit=JOBS_SHOWN,
                            **window(asked.get("all"), asked.get("since"), time.time()))

    samples = {label: timed(lambda asked=asked: query(asked), calls) for label, asked in QUERIES.items()}
    ledger.close()
    return samples


def cli(*args: str) -> list[str]:
    """The argv of the `rpycdl` command this Python runs."""
    script = os.path.join(os.path.dirname(sys.executable), "rpycdl")
    return [script, *args] if os.path.exists(script) else [sys.executable, "-m", "rpycdl", *args]


def listing(full: int, empty: int, calls: int, cli_runs: int) -> tuple[list[Row], dict[str, int]]:
    """Each query on the full ledger's server and on the empty one's, alternating in rounds of 10 calls,
    and the CLI's wall time on each; returns the rows and how many rows each query answered (full)."""
    rows: list[Row] = []
    answered: dict[str, int] = {}
    with rpycdl.connect(host="127.0.0.1", port=full) as big, rpycdl.connect(host="127.0.0.1", port=empty) as small:
        for label, query in QUERIES.items():
            answered[label] = len(big.root.jobs(**query))
            small.root.jobs(**query)  # warm up
            samples: dict[str, list[float]] = {"full": [], "empty": []}
            for _ in range(max(1, calls // 10)):
                samples["full"] += timed(lambda q=query: big.root.jobs(**q), 10)
                samples["empty"] += timed(lambda q=query: small.root.jobs(**q), 10)
            rows.append((label, samples["full"], samples["empty"], "the same on an empty ledger"))
    runs: dict[str, list[float]] = {"full": [], "empty": [], "version": []}
    for _ in range(cli_runs):
        for key, argv in (("full", cli("jobs", "--host", "127.0.0.1", "--port", str(full))),
                          ("empty", cli("jobs", "--host", "127.0.0.1", "--port", str(empty))),
                          ("version", cli("--version"))):
            start = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            runs[key].append(time.perf_counter() - start)
    rows.append(("CLI `rpycdl jobs --host --port` wall time", runs["full"], runs["empty"],
                 "the same on an empty ledger"))
    rows.append(("CLI `rpycdl jobs` on the empty ledger", runs["empty"], runs["version"],
                 "`rpycdl --version` (process start)"))
    return rows, answered


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_table(rows: list[Row]) -> None:
    print("| benchmark | p50 | p99 | baseline p50 | baseline p99 | ratio p50 | ratio p99 | baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for label, samples, base, what in rows:
        p50, p99, b50, b99 = (percentile(values, q) for values in (samples, base) for q in (50, 99))
        print(f"| {label} | {ms(p50)} | {ms(p99)} | {ms(b50)} | {ms(b99)} | {p50 / b50:.2f}x | {p99 / b99:.2f}x | "
              f"{what} (n={len(samples)}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300, help="submits and round trips (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=10, help="of each, not counted (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=100_000, help="finished jobs (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=100, help="jobs() calls a query a server (default: %(default)s)")
    parser.add_argument("--cli-runs", type=int, default=10, help="CLI runs per server (default: %(default)s)")
    args = parser.parse_args()
    began = time.perf_counter()
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, fake:4 servers; {args.samples} samples after "
          f"{args.warmup} warm-up, {args.rows} rows, {args.calls} calls, {args.cli_runs} CLI runs\n")
    scratch = tempfile.mkdtemp(prefix="bench-jobs-")
    try:
        with LocalCluster(os.path.join(scratch, "submit")) as cluster:
            rows, parts = submit_vs_run(cluster.add_server("pytorch", "fake:4")[1], args.samples, args.warmup)
        start = time.perf_counter()
        fill_ledger(os.path.join(scratch, "full", STATE_SUBDIR), args.rows)
        filled = time.perf_counter() - start
        with LocalCluster(os.path.join(scratch, "full")) as full, LocalCluster(os.path.join(scratch, "empty")) as empty:
            ports = full.add_server("pytorch", "fake:4")[1], empty.add_server("pytorch", "fake:4")[1]
            listed, answered = listing(*ports, args.calls, args.cli_runs)
            direct = in_process(os.path.join(scratch, "full", STATE_SUBDIR), args.calls)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(rows + listed)
    print("\nA detached job's time, from its ledger row (p50 / p99): "
          + "; ".join(f"{label} {ms(percentile(v, 50))} / {ms(percentile(v, 99))}" for label, v in parts.items()))
    print("Ledger.query in this process on the full ledger (p50 / p99): " + "; ".join(
        f"{label.split(' (')[0]} {ms(percentile(v, 50))} / {ms(percentile(v, 99))}" for label, v in direct.items()))
    print(f"Ledger of {args.rows} rows written in {filled:.1f} s; rows answered on it: "
          + ", ".join(f"{label.split(' (')[0]} {count}" for label, count in answered.items()))
    print(f"Means: submit {statistics.mean(rows[0][1]) * 1e3:.2f} ms, run_code "
          f"{statistics.mean(rows[0][2]) * 1e3:.2f} ms; whole run {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
