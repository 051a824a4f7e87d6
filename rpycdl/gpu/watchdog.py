"""The memory watchdog: holds a job on a share of a GPU to its grant from outside the job,
whatever framework (or none) it allocates with.

The connection process running the job asks the inventory for the GPU's per-process memory
(NVML's compute processes, or the simulated inventory's records) every WATCH_INTERVAL
seconds, adds up the job's processes (its process group and its descendants), and stops the
job when they use more than the grant plus the allowance for the CUDA context.

Limits: NVML reports host pids, so a server in a container sees its jobs' memory only when the
container shares the host's pid namespace (`docker run --pid=host`); memory is sampled, so a
job can exceed its grant for up to one interval before it is stopped.
"""

from __future__ import annotations

import time

from rpycdl.defaults import WATCH_INTERVAL
from rpycdl.gpu.inventory import GPU, Inventory

_ANCESTRY_DEPTH = 32


class MemoryWatch:
    """Watches a job's use of `gpu`, granted `grant` bytes of it (check() names the job by its
    process group).

    Args:
        inventory: where per-process memory comes from.
        gpu: the job's GPU.
        grant: bytes granted; `allowance` more are tolerated.
        interval: seconds between looks (check() is cheap in between).
    """

    def __init__(self, inventory: Inventory, gpu: GPU, grant: int, allowance: int,
                 interval: float = WATCH_INTERVAL) -> None:
        self._inventory, self._gpu = inventory, gpu
        self._grant, self._allowance, self._interval = grant, allowance, interval
        self._next = time.monotonic() + interval

    def check(self, pgid: int) -> str | None:
        """Why the job must stop (it uses too much of its GPU), or None; looks once per interval."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self._interval
        used = sum(size for pid, size in (self._inventory.process_memory(self._gpu.uuid) or {}).items()
                   if in_job(pid, pgid))
        if used <= self._grant + self._allowance:
            return None
        return (f"the job used {_mib(used)} of GPU {self._gpu.index} ({self._gpu.uuid}), over its grant of "
                f"{_mib(self._grant)} plus the {_mib(self._allowance)} allowance for the CUDA context, "
                "and was stopped")


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
