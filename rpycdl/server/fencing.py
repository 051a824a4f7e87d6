"""How the server fences a job (rpycdl.security.fence): the limits of its cgroup and the size of its private /tmp,
chosen from its request and the server's options; what a job the kernel stopped at its memory limit is told; what
its cgroup measured, in its row; the thread that removes the cgroups of jobs whose keeper and requester died."""

from __future__ import annotations

import logging
import threading

from rpycdl.defaults import CGROUP_SWEEP_INTERVAL
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.security import cgroups, devices
from rpycdl.security.fence import Fence
from rpycdl.server.context import ServerContext, job_memory, max_job_memory
from rpycdl.units import format_size

log = logging.getLogger("rpycdl.server")


def job_fence(context: ServerContext, record: JobRecord, memory: int | None, cpus: float | None,
              granted: set[int]) -> Fence | None:
    """How the job of `record` is fenced where this server fences jobs (a cgroup each), else None: its host memory
    (`memory`, else --job-memory), processes (--job-pids), CPU cores (`cpus`, else --job-cpus), no device node of
    a GPU but those of the minors `granted`, its /tmp (--job-tmp)."""
    if isinstance(cgroups.hierarchy(), str):
        return None
    limits = context.limits
    memory = memory or job_memory(limits, record.ngpus, len(context.gpus))
    deny = devices.gpu_nodes_denied(granted, {gpu.minor for gpu in context.gpus})
    tmp = {0: memory, -1: 0}.get(limits.job_tmp, limits.job_tmp)
    return Fence(cgroups.Limits(memory, limits.job_pids, cpus or limits.job_cpus or None, deny), tmp)


def over_memory(context: ServerContext, usage: cgroups.Usage | None, asked: bool) -> str | None:
    """Why a job whose process (or command) SIGKILL ended was stopped, if the kernel's OOM killer did it at its
    cgroup's memory limit (`asked`: its memory=, else --job-memory): its peak and its limit."""
    if usage is None or not usage.oom_kills:
        return None
    most = format_size(max_job_memory(context.limits))
    source = "its memory=" if asked else "this server's --job-memory"
    return (f"used {format_size(usage.peak_memory or 0)} of host memory, its limit "
            f"({format_size(usage.memory_limit or 0)}, {source}), and the kernel "
            f"stopped it; ask for more with memory=, up to {most} (--max-job-memory)")


def record_usage(record: JobRecord, usage: cgroups.Usage | None) -> None:
    """Put what the job's cgroup measured in its row."""
    if usage is not None:
        record.peak_memory, record.cpu_seconds, record.max_procs = usage.peak_memory, usage.cpu_seconds, usage.max_procs


def sweep_cgroups(stop: threading.Event) -> None:
    """Until `stop`: remove the cgroups of jobs whose keeper and requester died, killing what is in them, every
    CGROUP_SWEEP_INTERVAL (a fencing server's thread; its routine sweep does too, first, before it frees a dead
    job's GPUs, but a loaded ledger can make that pass take longer than a second). Returns at once where this
    server fences no job."""
    while not isinstance(cgroups.hierarchy(), str) and not stop.wait(CGROUP_SWEEP_INTERVAL):
        try:
            if cgroups.sweep():
                log.warning("removed the cgroups of jobs whose keeper died")
        except Exception:  # a sweep must never take the server down
            log.exception("cgroup sweep failed")
