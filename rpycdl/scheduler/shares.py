"""What a request asks for: whole GPUs (`ngpus`), or a share of one GPU (`gpus=0.25` or
`gpu_memory="6GiB"`), rounded up to the server's unit (`--gpu-unit`). Refusals name an argument as
Python's `name=value` (or `name=`), which the `rpycdl` command says as its flag (rpycdl.cli.common.in_flags)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rpycdl.defaults import GPU_UNIT, MEMORY_ALLOWANCE
from rpycdl.errors import InvalidRequestError
from rpycdl.units import MiB, format_size, parse_size


@dataclass(frozen=True)
class ShareRules:
    """A server's rules for fractional grants.

    Attributes:
        unit: the granularity, a fraction of a GPU ("1/8") or a memory size ("256MiB").
        allowance: bytes a fractional job may use beyond its grant (the CUDA context) before
            the watchdog stops it.
    """

    unit: str = GPU_UNIT
    allowance: int = MEMORY_ALLOWANCE

    def __post_init__(self) -> None:
        self.unit_bytes(1024 * MiB)  # check it
        if self.allowance < 0:
            raise InvalidRequestError(f"the memory allowance cannot be negative: {self.allowance}")

    def unit_bytes(self, gpu_bytes: int) -> int:
        """The unit in bytes (a whole number of MiB, the lock files' unit), for GPUs of `gpu_bytes`
        (the server's smallest)."""
        match = re.fullmatch(r"\s*1\s*/\s*(\d+)\s*", self.unit)
        if match:
            parts = int(match.group(1))
            if not 1 <= parts <= 1024:
                raise InvalidRequestError(f"--gpu-unit {self.unit}: a GPU is split into 1 to 1024 parts")
            return max(1, gpu_bytes // MiB // parts) * MiB
        size = parse_size(self.unit)
        if size < MiB:
            raise InvalidRequestError(f"--gpu-unit {self.unit}: the smallest unit is 1MiB (or a fraction like 1/8)")
        return size // MiB * MiB

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_unit": self.unit, "memory_allowance": self.allowance}


@dataclass(frozen=True)
class GPURequest:
    """Whole GPUs (`share_bytes` 0), or `share_bytes` of one GPU (`ngpus` 1), a whole number of MiB."""

    ngpus: int
    share_bytes: int = 0


def parse_request(ngpus: Any, gpus: Any, gpu_memory: Any, sizes: Sequence[int], rules: ShareRules) -> GPURequest:
    """Check a request's GPU arguments against the server's GPUs, or raise InvalidRequestError.

    Args:
        ngpus: whole GPUs, -1 for all; None means 1 unless a share is asked for.
        gpus: a fraction of one GPU (0 < gpus < 1), or a whole number of GPUs like Ray's num_gpus.
        gpu_memory: memory of one GPU, "6GiB" or bytes.
        sizes: the memory of each of the server's GPUs, in bytes.
        rules: the server's share rules (the unit requests are rounded up to).
    """
    if gpus is not None and gpu_memory is not None:
        raise InvalidRequestError("give gpus= (a fraction of one GPU) or gpu_memory=, not both")
    if ngpus is not None and (gpus is not None or gpu_memory is not None):
        raise InvalidRequestError("ngpus= asks for whole GPUs; for a share of one GPU give gpus= or gpu_memory= "
                                  "without ngpus=")
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not math.isfinite(gpus) or gpus <= 0:
            raise InvalidRequestError(f"gpus={gpus!r}: must be a positive number (0.25 for a quarter of one GPU)")
        if gpus >= 1:
            if gpus != int(gpus):
                raise InvalidRequestError(f"gpus={gpus:g} is neither a share of one GPU (below 1) nor whole GPUs: "
                                          "a job runs on a share of one GPU, or on whole GPUs")
            return GPURequest(check_ngpus(int(gpus), len(sizes)))
        return _share(math.ceil(gpus * min(sizes)), sizes, rules, f"gpus={gpus:g}")
    if gpu_memory is not None:
        if isinstance(gpu_memory, str):
            size = parse_size(gpu_memory)
        elif isinstance(gpu_memory, int) and not isinstance(gpu_memory, bool):
            size = gpu_memory
        else:
            raise InvalidRequestError(f"gpu_memory={gpu_memory!r}: must be a size like '6GiB' or a number of bytes")
        if size <= 0:
            raise InvalidRequestError(f"gpu_memory={gpu_memory!r}: must be positive")
        return _share(size, sizes, rules, f"gpu_memory={gpu_memory!r}")
    return GPURequest(check_ngpus(1 if ngpus is None else ngpus, len(sizes)))


def _share(size: int, sizes: Sequence[int], rules: ShareRules, asked: str) -> GPURequest:
    """A share of `size` bytes, rounded up to the unit, that fits on the server's largest GPU."""
    largest = max(sizes) // MiB * MiB
    if size > largest:
        raise InvalidRequestError(f"{asked} asks for {format_size(size)} of one GPU, but the largest GPU here has "
                                  f"{format_size(largest)}; for several GPUs use ngpus=")
    unit = rules.unit_bytes(min(sizes))
    return GPURequest(1, min(largest, math.ceil(size / unit) * unit))


def check_ngpus(ngpus: Any, total: int) -> int:
    """Turn a request's ngpus into a GPU count, or raise InvalidRequestError at once."""
    if isinstance(ngpus, bool) or not isinstance(ngpus, int):
        raise InvalidRequestError(f"ngpus={ngpus!r}: must be an integer (or -1 for all GPUs)")
    if ngpus == -1:
        return total
    if ngpus < 1:
        raise InvalidRequestError(f"ngpus={ngpus}: must be at least 1, or -1 for all GPUs")
    if ngpus > total:
        raise InvalidRequestError(f"asked for {ngpus} GPUs but this server has {total}")
    return ngpus
