"""Data in and out of jobs (issue 17), each against a baseline measured in the same run:

1. A working directory of --size bytes (16 MiB files) reaching a job, sent the first time, against the
   same bytes as an argument of run_code (the payload path): both as the extra time over a trivial
   run_code on the same connection, so the figures are bandwidths of the data alone. Apart: the send
   alone (the archive into the server's cache), and a new file of --size bytes written and kept on the
   same disk (what the cache's copy costs at least: no more memory is recycled than the cache does).
2. The same directory again (the server has it: only its hash is asked), and a small project
   (100 files of 10 KiB) again: the extra time over a trivial run_code.
3. A job leaving --size bytes in its output directory: the upload to the default local store, from
   the job's end to the ledger saying "uploaded", against copying the same file on the same disk.

Each timed call starts after os.sync(), so that it does not pay for writing back what the one before
wrote (a disk of the development machine writes about 800 MB/s: once a few GiB wait in the page cache,
every writer is throttled to that); --back-to-back leaves the syncs out.

Everything (the directories, the server's state with its cache and the jobs' copies, the local store)
goes under the temporary directory: TMPDIR=/mnt/xfs measures on a filesystem with reflinks, where a
cached working directory is cloned for a job instead of copied.

    python bench/bench_data.py [--size 1GiB] [--samples 5] [--back-to-back]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_core import trivial

import rpycdl
from rpycdl.site.local import LocalCluster
from rpycdl.units import format_size, parse_size

FILE = 16 * 1024**2


def _make_writer() -> Any:
    def write_output(size: int) -> float:
        import os
        import time

        import rpycdl

        block = os.urandom(16 * 1024**2)
        with open(os.path.join(rpycdl.output_dir(), "model.bin"), "wb") as out:
            for _ in range(size // len(block)):
                out.write(block)
        return time.time()

    return write_output


def tree(root: Path, files: int, size: int) -> Path:
    root.mkdir(parents=True)
    for number in range(files):
        (root / f"f{number:04d}.bin").write_bytes(os.urandom(size))
    return root


SYNC = True


def timed_call(fn: Any) -> float:
    if SYNC:
        os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--back-to-back", action="store_true", help="no os.sync() before each timed call")
    args = parser.parse_args()
    global SYNC
    SYNC = not args.back_to_back
    size = parse_size(args.size)
    scratch = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        big = tree(scratch / "big", size // FILE, FILE)
        small = tree(scratch / "small", 100, 10 * 1024)
        with LocalCluster(str(scratch / "locks")) as cluster:
            port = cluster.add_server("pytorch", "fake:2", "--max-working-dir", "4GiB",
                                      "--max-payload", "8GiB")[1]
            conn = rpycdl.connect(host="127.0.0.1", port=port)
            root = conn.root
            base = lambda: root.run_code(trivial, 1)  # noqa: E731 - the baseline call
            for _ in range(3):
                base()
            payload = bytes(size)
            rows = {"trivial run_code": [], "payload of the size": [], "working dir, first": [],
                    "working dir, again": [], "small project, again": []}
            sends, writes = [], []

            def first() -> None:  # a run_code with a new working directory, its send timed apart
                start = time.perf_counter()
                root._working_dir(big)
                sends.append(time.perf_counter() - start)
                root.run_code(trivial, 1, working_dir=big)  # the client remembers it: only named

            for sample in range(args.samples):
                (big / "salt").write_text(str(sample))  # a new content: sent again
                rows["trivial run_code"].append(timed_call(base))
                rows["payload of the size"].append(timed_call(lambda: root.run_code(len, payload)))
                rows["working dir, first"].append(timed_call(first))
                writes.append(timed_call(lambda n=sample: (scratch / f"kept{n}").write_bytes(payload)))
                rows["working dir, again"].append(timed_call(lambda: root.run_code(trivial, 1, working_dir=big)))
                root.run_code(trivial, 1, working_dir=small)
                rows["small project, again"].append(timed_call(lambda: root.run_code(trivial, 1,
                                                                                     working_dir=small)))
            floor = statistics.median(rows["trivial run_code"])
            print(f"size {format_size(size)}, {args.samples} samples{'' if SYNC else ', back to back'}; medians, "
                  f"extra = minus a trivial run_code ({floor * 1000:.1f} ms)\n")
            print("| what | median | extra | bandwidth of the data |")
            print("|---|---|---|---|")
            for label, values in rows.items():
                middle = statistics.median(values)
                extra = middle - floor
                rate = f"{size / extra / 1024**2:.0f} MiB/s" if label in ("payload of the size",
                                                                            "working dir, first") else ""
                print(f"| {label} | {middle * 1000:.1f} ms | {extra * 1000:.1f} ms | {rate} |")
            payload_rate = size / (statistics.median(rows["payload of the size"]) - floor)
            dir_rate = size / (statistics.median(rows["working dir, first"]) - floor)
            print(f"\nworking dir / payload bandwidth: {dir_rate / payload_rate:.2f} (target: at least 0.5); the same "
                  f"directory again: {(statistics.median(rows['working dir, again']) - floor) * 1000:.0f} ms extra "
                  f"(target: under 50)\nof the first time, the send alone: {statistics.median(sends) * 1000:.0f} ms; "
                  f"a new file of the size written and kept on the same disk: "
                  f"{statistics.median(writes) * 1000:.0f} ms")

            uploads, copies = [], []
            for _ in range(args.samples):
                job = root.submit(_make_writer(), size)
                ended = job.result(timeout=600)
                while job.artifacts()["state"] == "uploading" or job.artifacts()["state"] == "none":
                    time.sleep(0.01)
                entry = job.artifacts()
                uploads.append(entry["updated"] - ended)
                stored = Path(entry["store"]) / job.info["user"] / job.id / "model.bin"
                copies.append(timed_call(lambda source=stored: shutil.copyfile(source, scratch / "copy.bin")))
                (scratch / "copy.bin").unlink()
            up, cp = statistics.median(uploads), statistics.median(copies)
            print(f"\noutput of {format_size(size)} to the local store: upload {up * 1000:.0f} ms "
                  f"({size / up / 1024**2:.0f} MiB/s, from the job's return to 'uploaded'), a copy of it on the same "
                  f"disk {cp * 1000:.0f} ms ({size / cp / 1024**2:.0f} MiB/s); ratio {up / cp:.2f}")
            conn.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
