"""The GPUs' measured load, for least-busy placement: how busy each GPU has been over the last seconds
(the larger of its SM and memory-bandwidth utilisation, 0 to 1), written to the lock directory's
`gpu-load.json` by each server's sampler (rpycdl.gpu.sampler) and read by every grant."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from rpycdl.scheduler import lockdir

LOAD_FILE = "gpu-load.json"
LOAD_STALE = 10.0
"""Seconds after which a sample is not trusted (its sampler died): least-busy then places as pack does."""


def write_load(lock_dir: str | os.PathLike[str], load: Mapping[str, float], at: float) -> None:
    """Say how busy each GPU (by UUID) was, as of `at`; the GPUs other samplers wrote stay as they were."""
    path = Path(lock_dir) / LOAD_FILE
    known = lockdir.read_json(path) or {}
    gpus = {uuid: sample for uuid, sample in known.get("gpus", {}).items() if isinstance(sample, dict)}
    gpus.update({uuid: {"busy": float(busy), "at": at} for uuid, busy in load.items()})
    lockdir.write_json(path, {"gpus": gpus})


def read_load(lock_dir: str | os.PathLike[str], now: float) -> dict[str, float]:
    """How busy each GPU was, for those measured in the last LOAD_STALE seconds."""
    found = {}
    for uuid, sample in ((lockdir.read_json(Path(lock_dir) / LOAD_FILE) or {}).get("gpus") or {}).items():
        try:
            if now - float(sample["at"]) <= LOAD_STALE:
                found[uuid] = min(max(float(sample["busy"]), 0.0), 1.0)
        except (TypeError, KeyError, ValueError):
            continue
    return found
