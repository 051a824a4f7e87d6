"""What preloading a framework buys and costs (issue 28): a job that imports MODULE, through run_code on an
open connection, against a server whose job forkserver preloaded it (`--preload MODULE`) and one that did
not (`--preload ''`), in alternating rounds; and the proportional memory (Pss, so pages shared after a fork
count once) of each server's process tree, idle, once its forkserver and spare job process are ready.

    python bench/bench_preload.py [--module torch] [--rounds 5]

Each job is a fresh process: without the preload it pays the import every time, with it the module is in
sys.modules already. Prints a Markdown table (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import platform
import sys
import tempfile
import time

from bench_core import percentile
from bench_payload import process_tree, pss_of

import rpycdl
from rpycdl.site.local import LocalCluster

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", default="torch", help="the module preloaded (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds of 5 jobs each (default: %(default)s)")
    args = parser.parse_args()
    if importlib.util.find_spec(args.module) is None:
        sys.exit(f"{args.module} is not installed here: the servers could not preload it")
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        servers = {name: cluster.add_server("pytorch", "fake:2", "--preload", modules)
                   for name, modules in (("preloaded", args.module), ("not preloaded", ""))}
        conns = {name: rpycdl.connect(host="127.0.0.1", port=port) for name, (_, port) in servers.items()}
        job = _importer(args.module)
        for conn in conns.values():  # the first job of each connection, and the spares ready after it
            conn.root.run_code(job, None)
        time.sleep(2)
        memory = {name: sum(pss_of(pid) for pid in process_tree(process.popen.pid))
                  for name, (process, _) in servers.items()}
        times: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(args.rounds):
            for name, conn in conns.items():
                for _ in range(5):
                    start = time.perf_counter()
                    conn.root.run_code(job, None)
                    times[name].append(time.perf_counter() - start)
        for conn in conns.values():
            conn.close()
    print(f"rpycdl from {rpycdl.__file__.rsplit('/', 1)[0]}; {args.module} {_version(args.module)}")
    print(f"Machine: {platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}\n")
    print(f"| run_code of a job that imports {args.module}, open connection | p50 | p99 | server tree Pss, idle |")
    print("|---|---|---|---|")
    for name in servers:
        p50, p99 = percentile(times[name], 50), percentile(times[name], 99)
        print(f"| {name} | {p50 * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | {memory[name] / MiB:.0f} MiB |")
    ratio = percentile(times["not preloaded"], 50) / percentile(times["preloaded"], 50)
    print(f"\npreloaded: {ratio:.1f}x faster (p50); its tree holds "
          f"{(memory['preloaded'] - memory['not preloaded']) / MiB:+.0f} MiB more")


def _importer(module: str):
    """A job that imports `module` and returns how long the import took in it."""
    def job(_):
        import importlib
        import time

        start = time.perf_counter()
        importlib.import_module(module)
        return time.perf_counter() - start

    return job


def _version(module: str) -> str:
    return getattr(__import__(module), "__version__", "")


if __name__ == "__main__":
    main()
