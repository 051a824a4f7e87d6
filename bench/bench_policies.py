"""Scheduling policies on a makespan workload: 200 jobs from 8 clients that each wait for a job before sending
the next, on fake:4, every job declaring a timeout of twice its run time and each client connecting as a user
of its own. `uniform` is bench_core's workload (every job 50 ms, asking for 1, 1, 2, 1, 4, 1, 2, 1 GPUs in
turn); `mixed` gives the same GPU counts run times of 300, 20, 20, 20, 100, 20, 300 and 20 ms, so that short
jobs have gaps to fill while long ones hold GPUs.

For each policy (fcfs, fcfs-backfill, fair): the makespan measured with real servers, in rounds that rotate
the order; against the packing ideal (GPU-seconds / 4) and fcfs measured in the same run; and the same
schedule with zero overhead (rpycdl.scheduler.policies.decide on a simulated clock), with grants at the same
instant and with grants 1 ms apart (as real grants are). Ray with workers reused on the uniform workload,
measured in the same run where Ray imports.

    python bench/bench_policies.py [--rounds 3] [--workload uniform|mixed|both] [--no-ray]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_core import JOB_SECONDS, PATTERN, ray_makespan, timed_clients  # noqa: E402

import rpycdl  # noqa: E402
from rpycdl.scheduler import fairshare, policies  # noqa: E402
from rpycdl.scheduler.fairshare import FairShare, Snapshot  # noqa: E402
from rpycdl.scheduler.policies import Board, Hold, Rules, Want  # noqa: E402
from rpycdl.site.local import LocalCluster  # noqa: E402

GPUS, TOTAL, CLIENTS = 4, 200, 8
WORKLOADS = {
    "uniform": [(ngpus, JOB_SECONDS) for ngpus in PATTERN],
    "mixed": list(zip(PATTERN, (0.3, 0.02, 0.02, 0.02, 0.1, 0.02, 0.3, 0.02), strict=True)),
}
"""(GPUs, seconds) of the jobs in turn; each client takes every CLIENTS-th job."""


def _job(seconds: float) -> None:
    """The workload's job (defined in __main__, so that dill sends it by value: the server cannot import
    this benchmark's modules)."""
    import time as clock

    clock.sleep(seconds)


def _jobs(workload: str) -> list[tuple[int, float]]:
    pattern = WORKLOADS[workload]
    return [pattern[i % len(pattern)] for i in range(TOTAL)]


def _client(port: int, index: int, jobs: list[tuple[int, float]], out: multiprocessing.Queue) -> None:
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        conn.root.identify(f"user{index}")
        for ngpus, seconds in jobs:
            conn.root.run_code(_job, seconds, ngpus=ngpus, timeout=2 * seconds)
    out.put(len(jobs))


def measured(policy: str, workload: str) -> float:
    """Seconds for the whole workload on a fresh fake:4 server of `policy`."""
    jobs = _jobs(workload)
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        _, port = cluster.add_server("pytorch", f"fake:{GPUS}", "--policy", policy)
        return timed_clients(_client, [(port, i, jobs[i::CLIENTS]) for i in range(CLIENTS)], TOTAL)


def simulated(policy: str, workload: str, gap: float) -> float:
    """The workload's makespan with no overhead but `gap` seconds between two grants: every waiting request
    asks policies.decide whenever something changed, a client sends its next job the moment its last ended."""
    uuids = tuple(f"GPU-{i}" for i in range(GPUS))
    sizes = {uuid: 16 for uuid in uuids}
    queues = [_jobs(workload)[index::CLIENTS] for index in range(CLIENTS)]
    waiting: list[Want] = []
    running: list[tuple[Want, float, tuple[str, ...]]] = []  # (request, start, GPUs)
    ended: list[tuple[str, float, float, float]] = []
    runs: dict[int, float] = {}
    settings = FairShare(3600.0)

    def submit(index: int) -> None:
        if queues[index]:
            ngpus, seconds = queues[index].pop(0)
            want = Want(len(runs), ngpus, 0, uuids, 2 * seconds, f"user{index}")
            runs[want.ticket] = seconds
            waiting.append(want)

    for index in range(CLIENTS):
        submit(index)
    now = 0.0
    while waiting or running:
        usage = None
        if policy == policies.FAIR:
            snapshot = fairshare.step(Snapshot(0.0, {}), ended, now, settings.half_life)
            usage = fairshare.usage(snapshot, [(w.account, start, w.ngpus) for w, start, _ in running], settings, now)
        granted = True
        while granted:
            granted = False
            ordered = policies.order(waiting, policy, usage)
            holds = [Hold(uuid, 0, start + want.seconds) for want, start, gpus in running for uuid in gpus]
            rooms = policies.rooms_at(sizes, [Hold(hold.uuid, 0, math.inf) for hold in holds], now)
            for want in ordered:
                decision = policies.decide(rooms, ordered, want, Rules(policy), board=Board(sizes, tuple(holds)),
                                           now=now)
                if decision.uuids:
                    waiting.remove(want)
                    running.append((want, now, decision.uuids))
                    granted = True
                    now += gap
                    break
        now = max(now, min(start + runs[want.ticket] for want, start, _ in running))
        for entry in [entry for entry in running if entry[1] + runs[entry[0].ticket] <= now + 1e-12]:
            running.remove(entry)
            ended.append((entry[0].account, entry[1], now, float(entry[0].ngpus)))
            submit(int(entry[0].account[4:]))
    return now


def _ray(rounds: int) -> list[float] | None:
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_gpus=GPUS, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        return [ray_makespan(TOTAL, CLIENTS) for _ in range(rounds)]
    finally:
        ray.shutdown()


def report(workload: str, runs: dict[str, list[float]], ray: list[float] | None) -> None:
    ideal = sum(ngpus * seconds for ngpus, seconds in _jobs(workload)) / GPUS
    fcfs = statistics.median(runs[policies.FCFS])
    print(f"\n`{workload}` workload (ideal, GPU-seconds / {GPUS}: {ideal:.2f} s)\n")
    print("| schedule | makespan, median (runs) | x ideal | x fcfs | zero overhead | with grants 1 ms apart |")
    print("|---|---|---|---|---|---|")
    for name, times in runs.items():
        median, zero, spaced = statistics.median(times), simulated(name, workload, 0), simulated(name, workload, 1e-3)
        shown = ", ".join(f"{value:.2f}" for value in times)
        print(f"| {name} | {median:.2f} s ({shown}) | {median / ideal:.2f}x | {median / fcfs:.2f}x | {zero:.2f} s "
              f"({zero / ideal:.2f}x) | {spaced:.2f} s ({spaced / ideal:.2f}x) |")
    if ray is not None:
        median = statistics.median(ray)
        shown = ", ".join(f"{value:.2f}" for value in ray)
        print(f"| Ray, workers reused (ignores arrival order) | {median:.2f} s ({shown}) | {median / ideal:.2f}x "
              f"| {median / fcfs:.2f}x | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each policy, in rotating order")
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray even where it is installed")
    args = parser.parse_args()
    names = list(policies.POLICIES)
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    runs = {workload: {name: [] for name in names} for workload in workloads}
    for round_ in range(args.rounds):
        for workload in workloads:
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                runs[workload][name].append(measured(name, workload))
                print(f"round {round_ + 1}, {workload}: {name} {runs[workload][name][-1]:.2f} s", file=sys.stderr,
                      flush=True)
    ray = None if args.no_ray or "uniform" not in workloads else _ray(args.rounds)
    print(f"Machine: {platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.rounds} rounds; every job declares a timeout of twice its run time")
    for workload in workloads:
        report(workload, runs[workload], ray if workload == "uniform" else None)


if __name__ == "__main__":
    main()
