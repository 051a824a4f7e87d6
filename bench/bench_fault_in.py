"""How fast a process faults in fresh memory, depending on what else it holds: nothing, a buffer the
kernel's getrandom wrote (os.urandom), or a buffer written in user space (NumPy's generator). No
rpycdl code runs (only its madvise constant is borrowed): this measures the machine, to explain
bench_payload's `--urandom` numbers.

Each case runs in a fresh forked process: it makes what it holds, then times MADV_POPULATE_WRITE
(Linux 5.14) of a fresh private anonymous mapping, the way rpycdl's receiver faults in a buffer.

    python bench/bench_fault_in.py [--mib 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time

import numpy as np

from rpycdl.wire.bulk import MADV_POPULATE_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

HOLDINGS = {
    "nothing": lambda size: None,
    "os.urandom bytes": os.urandom,
    "NumPy Generator.bytes": lambda size: np.random.default_rng().bytes(size),
}


def fault_in_rate(size: int) -> float:
    """MB/s of faulting in `size` bytes of fresh private memory."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    start = time.perf_counter()
    if _libc.madvise(address, size, MADV_POPULATE_WRITE):
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE) needs Linux 5.14")
    return size / 1e6 / (time.perf_counter() - start)


def in_child(holding: str, size: int) -> float:
    """fault_in_rate in a forked process holding `size` bytes made the way `holding` names."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        held = HOLDINGS[holding](size)  # noqa: F841 - held while the fault-in is timed
        os.write(write, str(fault_in_rate(size)).encode())
        os._exit(0)
    os.close(write)
    rate = float(os.read(read, 64))
    os.close(read)
    os.waitpid(pid, 0)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="size held and faulted in (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each case, alternating (default: %(default)s)")
    args = parser.parse_args()
    size = args.mib << 20
    rates: dict[str, list[float]] = {holding: [] for holding in HOLDINGS}
    for _ in range(args.runs):
        for holding in HOLDINGS:
            rates[holding].append(in_child(holding, size))
    baseline = statistics.median(rates["nothing"])
    print(f"{args.mib} MiB faulted in, {args.runs} runs of each case\n")
    print("| the process holds | MB/s (median) | MB/s (min to max) | ratio to holding nothing |")
    print("|---|---|---|---|")
    for holding, values in rates.items():
        print(f"| {holding} | {statistics.median(values):.0f} | {min(values):.0f} to {max(values):.0f} | "
              f"{statistics.median(values) / baseline:.2f} |")


if __name__ == "__main__":
    main()
