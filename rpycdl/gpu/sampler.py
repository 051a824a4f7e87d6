"""The load sampler of `--placement least-busy`: a process of its own beside a server (NVML stays out of the
forking server parent), which every LOAD_PERIOD seconds asks NVML how busy each GPU is and writes the average
of the last LOAD_WINDOW samples to the lock directory (rpycdl.scheduler.load); it ends with its server.

Run as `python -m rpycdl.gpu.sampler LOCK_DIR` (rpycdl.server.app starts it)."""

from __future__ import annotations

import collections
import os
import sys
import time

from rpycdl.defaults import LOAD_PERIOD, LOAD_WINDOW
from rpycdl.gpu.inventory import NvmlInventory
from rpycdl.scheduler.load import write_load


def sample(lock_dir: str, parent: int) -> None:
    """Sample until `parent` (the server) is gone."""
    inventory = NvmlInventory()
    history: dict[str, collections.deque[float]] = collections.defaultdict(
        lambda: collections.deque(maxlen=LOAD_WINDOW))
    while os.getppid() == parent:
        for uuid, busy in inventory.load().items():
            if busy is None:  # a GPU that did not answer: its old figures age out (LOAD_STALE)
                history.pop(uuid, None)
            else:
                history[uuid].append(busy)
        write_load(lock_dir, {uuid: sum(samples) / len(samples) for uuid, samples in history.items()}, time.time())
        time.sleep(LOAD_PERIOD)


if __name__ == "__main__":
    sample(sys.argv[1], os.getppid())
