"""The GPU watchdog: holds a job to the GPUs it was granted from outside the job, whatever framework (or
none) it uses: no process of it on a GPU it was not granted (one that reset CUDA_VISIBLE_DEVICES), and on
a share of a GPU, no more memory than the grant.

The process running the job (its connection process, or a detached job's supervisor) asks the inventory
for every GPU's processes (NVML's compute processes, or the simulated inventory's records) every
WATCH_INTERVAL seconds, finds the job's among them (its process group and its descendants), and stops the
job when one uses a GPU it was not granted, or when they use more of a shared GPU than the grant plus the
allowance for the CUDA context.

Limits: NVML reports host pids, so a server in a container sees its jobs only when the container shares
the host's pid namespace (`docker run --pid=host`); the watchdog samples, so a job can misbehave for up to
one interval before it is stopped; it sees the GPUs the server's driver shows, which a container's runtime
may make fewer than the host's (a job cannot open the others either).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rpycdl.defaults import WATCH_INTERVAL
from rpycdl.gpu.inventory import GPU, Inventory

_ANCESTRY_DEPTH = 32

ELSEWHERE = "elsewhere"
"""Why a job was stopped: it used a GPU it was not granted."""
OVER_MEMORY = "over_memory"
"""Why a job was stopped: it used more of its share's GPU than the grant and the allowance."""


class GPUWatch:
    """Watches a job's use of the GPUs: `granted` maps each of its GPUs (by UUID) to its share's bytes (0
    for a whole GPU). check() names the job by its process group.

    Args:
        inventory: where every GPU's processes come from.
        gpus: the server's GPUs, by UUID (to name them in a refusal).
        granted: the job's GPUs, and each one's share (0: whole).
        allowance: bytes tolerated beyond a share.
        interval: seconds between looks (check() is cheap in between).
    """

    def __init__(self, inventory: Inventory, gpus: Mapping[str, GPU], granted: Mapping[str, int], allowance: int,
                 interval: float = WATCH_INTERVAL) -> None:
        self._inventory, self._gpus, self._granted = inventory, gpus, granted
        self._allowance, self._interval = allowance, interval
        self._next = time.monotonic() + interval

    def check(self, pgid: int) -> tuple[str, str] | None:
        """Why the job must stop (ELSEWHERE or OVER_MEMORY, and the reason in words), or None; looks once per
        interval."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self._interval
        for uuid, used_by in self._inventory.processes().items():
            used = sum(size for pid, size in used_by.items() if in_job(pid, pgid))
            if uuid not in self._granted and any(in_job(pid, pgid) for pid in used_by):
                return ELSEWHERE, (f"the job used {self._name(uuid)}, which it was not granted (it may use only "
                                   f"{', '.join(self._name(each) for each in self._granted)}), and was stopped")
            share = self._granted.get(uuid)
            if share and used > share + self._allowance:
                return OVER_MEMORY, (f"the job used {_mib(used)} of {self._name(uuid)}, over its grant of "
                                     f"{_mib(share)} plus the {_mib(self._allowance)} allowance for the CUDA context, "
                                     "and was stopped")
        return None

    def _name(self, uuid: str) -> str:
        gpu = self._gpus.get(uuid)
        return f"GPU {gpu.index} ({uuid})" if gpu is not None else f"the GPU {uuid}"


def in_job(pid: int, pgid: int) -> bool:
    """Whether process `pid` belongs to the job whose process group (and first process) is `pgid`:
    in its group, or descended from it."""
    if pid == pgid:  # the job process itself: no need to read /proc
        return True
    for _ in range(_ANCESTRY_DEPTH):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            return False
        ppid, group = int(fields[1]), int(fields[2])
        if pid == pgid or group == pgid:  # a descendant reached the job process, or is in its group
            return True
        if ppid <= 1:
            return False
        pid = ppid
    return False


def _mib(size: int) -> str:
    return f"{size / 1024**2:.0f} MiB"
