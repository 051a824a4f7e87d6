"""How long a job's GPUs have shown no utilization (NVML's, through the inventory), for --idle-reclaim: the
process running the job (its connection process, or a detached job's supervisor) looks at its GPUs every
IDLE_RECLAIM_LOOK seconds, as the watchdog does (rpycdl.gpu.watchdog); the server parent never asks NVML.

A GPU whose utilization is unknown (a simulated GPU, a query that failed) counts as busy: nothing is reclaimed on
a guess. NVML's utilization is the whole GPU's: a job on a share of a GPU is idle only while every job on it is."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rpycdl.defaults import IDLE_RECLAIM_LOOK
from rpycdl.gpu.inventory import Inventory


class IdleWatch:
    """The idle time of the GPUs `uuids` of `inventory`, counted from the watch's start (the grant).

    Args:
        inventory: where the GPUs' utilization comes from.
        uuids: the job's GPUs.
        interval: seconds between looks (idle_for() is cheap in between).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, inventory: Inventory, uuids: Sequence[str], interval: float = IDLE_RECLAIM_LOOK,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inventory, self._uuids, self._interval, self._clock = inventory, tuple(uuids), interval, clock
        self.since = clock()
        self._next = self.since

    def idle_for(self) -> float:
        """Seconds since one of the GPUs last showed utilization (or its utilization was unknown), as of the
        latest look; looks once per interval."""
        now = self._clock()
        if now >= self._next:
            self._next = now + self._interval
            used = self._inventory.utilization()
            if any(used.get(uuid) is None or used[uuid] > 0 for uuid in self._uuids):  # type: ignore[operator]
                self.since = now
        return now - self.since
