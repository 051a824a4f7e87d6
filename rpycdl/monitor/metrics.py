"""The host's metrics for Prometheus: a collector that reads the lock directory, the job ledger and the
GPUs when it is scraped (prometheus_client's custom collector; nothing is hand-written exposition).

It takes no lock a grant waits on: the lock directory's snapshot probes with F_GETLK, which takes
nothing, and the ledger is read in WAL mode, which never blocks a writer. Labels stay bounded: GPUs,
services, states, reasons, and users and groups (under --limits, their use against the limits: the users the file
names and those active in the last week); a job id appears only on `rpycdl_gpu_holder_info`, one series per
current holder. The histograms and the counters of the watchdog's stops and of CPU time count the jobs that ended
since the monitor started (peak memory and CPU time: those their server measured); the refusals and the
connections dropped before authenticating are the ledger's own counts, host-wide since it was made.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rpycdl.errors import IdleReclaimedError
from rpycdl.gpu.inventory import Inventory
from rpycdl.scheduler import limits, lockdir
from rpycdl.scheduler.ledger import DROPS, REFUSALS, JobRecord, Ledger
from rpycdl.scheduler.lockdir import host_fencing, host_isolation
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.scheduler.policyfiles import host_scheduling

BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0, math.inf)
"""Upper bounds of the queue wait and run time histograms, in seconds (a second to a day)."""

MEMORY_BUCKETS = (*(16.0 * 1024**2 * 4**power for power in range(9)), math.inf)
"""Upper bounds of the peak memory histogram, in bytes: 16 MiB, 64 MiB, ... 1 TiB."""

LATE_COMMIT = 300.0
"""Seconds of ends read again at each scrape: a job's end may be committed after a later one's."""

LIMIT_GAUGES = (
    ("gpus", "gpus_held", "GPUs held now (a share counts as its fraction)", False),
    ("gpus", "gpu_limit", "The limit of GPUs held at once (--limits; absent: none)", False),
    ("pending", "pending_requests", "Requests waiting for GPUs", False),
    ("pending", "pending_limit", "The limit of requests waiting at once (--limits; absent: none)", False),
    ("", "gpu_hours", "GPU-hours used in the rolling window", True),
    ("", "gpu_hours_limit", "The limit of GPU-hours in the rolling window (--limits; absent: none)", True),
)
"""The gauges of each user's and group's use against the limits in force: (the key of limits.standing's rows,
the name after rpycdl_user_ or rpycdl_group_, its help, whether by window: the key is then each of WINDOWS')."""

MEMORY_STOP = "GPUMemoryExceededError"
"""The error type of a job the watchdog stopped for using more GPU memory than its share."""


class _Histogram:
    """Counts of one histogram's observations by bucket (upper `bounds`, the last infinite), their sum."""

    def __init__(self, bounds: tuple[float, ...] = BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[next(index for index, bound in enumerate(self.bounds) if value <= bound)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, out = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            cumulative += count
            out.append((floatToGoString(bound), cumulative))  # "1.0", "+Inf": as prometheus_client's own
        return out


class HostCollector(Collector):
    """The metrics of one host: its GPUs (`inventory`), their grants and queue (`lock_dir`), its jobs
    (the ledger of `state_dir`)."""

    def __init__(self, inventory: Inventory, lock_dir: str, state_dir: str) -> None:
        self.inventory = inventory
        inventory.use_lock_dir(lock_dir)
        self.locks = GPULockManager(lock_dir)
        self.ledger = Ledger(state_dir, read_only=not lockdir.writable())  # a monitor's: a reader
        self._lock = threading.Lock()
        self._since = time.time()  # ends counted from here on
        self._counted: dict[str, float] = {}  # ids of the ends read within LATE_COMMIT of the newest
        self._waits: dict[str, _Histogram] = {}
        self._runs: dict[str, _Histogram] = {}
        self._stops: dict[str, int] = {}
        self._memory: dict[str, _Histogram] = {}
        self._cpu: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        snapshot = self.locks.snapshot()
        yield from self._gpus(snapshot["held"])
        waiting = GaugeMetricFamily("rpycdl_queue_waiting_requests", "Requests waiting for GPUs, by service",
                                    labels=["service"])
        for service, count in Counter(waiter.get("server", "") for waiter in snapshot["queue"]).items():
            waiting.add_metric([service], count)
        yield waiting
        jobs = GaugeMetricFamily("rpycdl_jobs", "Jobs in the host's ledger, by state", labels=["state"])
        for state, count in self.ledger.count_by_state().items():
            jobs.add_metric([state.value], count)
        yield jobs
        reclaimed = CounterMetricFamily("rpycdl_idle_reclaims", "Jobs and attempts of jobs the host's servers stopped "
                                        "with their GPUs idle past --idle-reclaim, since the ledger was made")
        reclaimed.add_metric([], self.ledger.ended_with(IdleReclaimedError.__name__))
        yield reclaimed
        refused = CounterMetricFamily("rpycdl_requests_refused", "Requests the host's servers refused, by service "
                                      "and reason, since the ledger was made", labels=["service", "reason"])
        counts = self.ledger.refusals()
        for service in sorted({service for service, _ in counts}):  # every reason of a service: rate() sees the first
            for reason in REFUSALS:
                refused.add_metric([service, reason], counts.get((service, reason), 0))
        yield refused
        dropped = CounterMetricFamily("rpycdl_connections_dropped", "Connections the host's servers dropped before "
                                      "they authenticated, by service and reason, since the ledger was made",
                                      labels=["service", "reason"])
        counts = self.ledger.drops()
        for service in sorted({service for service, _ in counts}):
            for reason in DROPS:
                dropped.add_metric([service, reason], counts.get((service, reason), 0))
        yield dropped
        preempted = CounterMetricFamily("rpycdl_preemptions", "Jobs preempted by a job of a higher priority "
                                        "(--preempt), by what became of them (requeued, ended), since the ledger was "
                                        "made",
                                        labels=["outcome"])
        counts = self.ledger.preemption_counts()
        for outcome in ("requeued", "ended"):
            preempted.add_metric([outcome], counts.get(outcome, 0))
        yield preempted
        scheduling = host_scheduling(self.locks.root)
        policy = InfoMetricFamily("rpycdl_scheduling", "The scheduling policy and placement of the host's live servers "
                                  "(absent while none lives)")
        if scheduling is not None:
            policy.add_metric([], {"policy": scheduling.policy, "placement": scheduling.placement})
        yield policy
        mode = host_isolation(self.locks.root)
        isolation = InfoMetricFamily("rpycdl_isolation", "Whose accounts the host's live servers run jobs as: "
                                     "'owner accounts' (root servers) or 'one account' (absent while none lives)")
        if mode is not None:
            isolation.add_metric([], {"mode": mode})
        yield isolation
        fencing = InfoMetricFamily("rpycdl_fencing", "How the host's live servers fence their jobs: 'cgroup v1', "
                                   "'cgroup v2' (root servers: a cgroup per job) or 'none'; one per kind that lives",
                                   labels=["fencing"])
        for kind in host_fencing(self.locks.root):
            fencing.add_metric([kind], {})
        yield fencing
        yield from self._limits(snapshot)
        yield from self._ended()

    def _gpus(self, held: dict[str, list[dict[str, Any]]]) -> Iterator[Metric]:
        labels = ["gpu", "uuid"]
        info = GaugeMetricFamily("rpycdl_gpu_info", "A GPU of the host (always 1)", labels=[*labels, "model"])
        total = GaugeMetricFamily("rpycdl_gpu_memory_total_bytes", "GPU memory", labels=labels)
        used = GaugeMetricFamily("rpycdl_gpu_memory_used_bytes", "GPU memory in use (NVML)", labels=labels)
        granted = GaugeMetricFamily("rpycdl_gpu_memory_granted_bytes", "GPU memory granted to jobs: all of it "
                                    "for a whole-GPU grant, the sum of the shares otherwise", labels=labels)
        busy = GaugeMetricFamily("rpycdl_gpu_utilization_ratio", "Share of the last sample period the GPU's "
                                 "kernels ran, 0 to 1 (NVML)", labels=labels)
        holders = GaugeMetricFamily("rpycdl_gpu_holder_info", "A job holding the GPU or a share of it (always 1)",
                                    labels=[*labels, "job", "user", "kind"])
        in_use, rates = self.inventory.memory_used(), self.inventory.utilization()
        for gpu in self.inventory.gpus():
            index, holding = [str(gpu.index), gpu.uuid], held.get(gpu.uuid, [])
            info.add_metric([*index, gpu.name], 1)
            total.add_metric(index, gpu.memory_total)
            if in_use.get(gpu.uuid) is not None:
                used.add_metric(index, in_use[gpu.uuid])
            if rates.get(gpu.uuid) is not None:
                busy.add_metric(index, rates[gpu.uuid])
            whole = any(not holder.get("share_bytes") for holder in holding)
            granted.add_metric(index, gpu.memory_total if whole else sum(h["share_bytes"] for h in holding))
            for holder in holding:
                kind = "share" if holder.get("share_bytes") else "whole"
                holders.add_metric([*index, holder.get("job_id", ""), holder.get("user", ""), kind], 1)
        yield from (info, total, used, granted, busy, holders)

    def _limits(self, snapshot: dict[str, Any]) -> Iterator[Metric]:
        """Each user's and group's use against the limits in force (limits.standing; no series while none are), a
        family of each of LIMIT_GAUGES for users (rpycdl_user_...) and for groups (rpycdl_group_...)."""
        rows = limits.standing(self.locks.root, snapshot, self.ledger, time.time()) or []
        for kind in ("user", "group"):
            for key, name, words, windowed in LIMIT_GAUGES:
                labels = [kind, "window"] if windowed else [kind]
                family = GaugeMetricFamily(f"rpycdl_{kind}_{name}", f"{words}, by {kind}" +
                                           (" and rolling window (day, week)" if windowed else ""), labels=labels)
                keys = [(each, [window]) for each, (_, window) in limits.WINDOWS.items()] if windowed else [(key, [])]
                for row in (row for row in rows if row["kind"] == kind):
                    for each, window in keys:
                        value = row["limits"].get(each) if name.endswith("limit") else row[each]
                        if value is not None:
                            family.add_metric([row["name"], *window], value)
                yield family

    def _ended(self) -> Iterator[Metric]:
        """The histograms of queue wait, run time and peak memory, the watchdog's stops and the CPU time of the
        jobs that ended since the monitor started, by service."""
        with self._lock:
            for record in self.ledger.ended_since(max(self._since, max(self._counted.values(), default=0.0)
                                                      - LATE_COMMIT), known=self._counted):
                self._count(record)
            newest = max(self._counted.values(), default=0.0)
            self._counted = {job: ended for job, ended in self._counted.items() if ended >= newest - LATE_COMMIT}
            waits = HistogramMetricFamily("rpycdl_job_queue_wait_seconds", "How long ended jobs waited for their "
                                          "GPUs, by service", labels=["service"])
            runs = HistogramMetricFamily("rpycdl_job_run_seconds", "How long ended jobs ran, by service",
                                         labels=["service"])
            memory = HistogramMetricFamily("rpycdl_job_peak_memory_bytes", "The peak host memory of ended jobs, "
                                           "by service (the jobs their server measured)", labels=["service"])
            for family, histograms in ((waits, self._waits), (runs, self._runs), (memory, self._memory)):
                for service, histogram in sorted(histograms.items()):
                    family.add_metric([service], histogram.buckets(), histogram.total)
            stops = CounterMetricFamily("rpycdl_gpu_memory_stops", "Jobs the watchdog stopped for using more GPU "
                                        "memory than their share, by service", labels=["service"])
            for service, count in sorted(self._stops.items()):
                stops.add_metric([service], count)
            cpu = CounterMetricFamily("rpycdl_job_cpu_seconds", "CPU time, user and system, of ended jobs' "
                                      "processes, by service (the jobs their server measured)", labels=["service"])
            for service, seconds in sorted(self._cpu.items()):
                cpu.add_metric([service], seconds)
        yield from (waits, runs, memory, stops, cpu)

    def _count(self, record: JobRecord) -> None:
        self._counted[record.job_id] = record.ended or 0.0
        if record.started is not None:
            self._waits.setdefault(record.service, _Histogram()).observe(record.started - record.submitted)
            self._runs.setdefault(record.service, _Histogram()).observe((record.ended or record.started)
                                                                        - record.started)
        if record.error_type == MEMORY_STOP:
            self._stops[record.service] = self._stops.get(record.service, 0) + 1
        if record.peak_memory is not None:
            self._memory.setdefault(record.service, _Histogram(MEMORY_BUCKETS)).observe(record.peak_memory)
        if record.cpu_seconds is not None:
            self._cpu[record.service] = self._cpu.get(record.service, 0.0) + record.cpu_seconds

