"""Connect-and-run under a flood of silent connections (issue 27): a user connects to a TLS server, runs a
one-GPU job and closes, again and again; first with nothing else going on, then while 1000 connections that
say nothing (opened again as soon as the server closes one: tests/flood.py) come from another address
(127.0.0.2), then from the user's own, from the moment the server has dropped as many as the flood holds. The
kernel lets silent connections through to the server in waves, one a second (rpycdl.defaults.ACCEPT_DEFER):
the default 300 calls last several of them. One run, one server, so the three compare. Prints a Markdown table
(see BENCHMARKS.md); calls that failed are counted, not timed.

    python bench/bench_flood.py [--calls 300] [--connections 1000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import tempfile
import time

from bench_core import percentile, trivial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import flood as flooding  # noqa: E402 - the flood of tests/flood.py, started and asked as the tests do

import rpycdl
from rpycdl import cli
from rpycdl.site.local import LocalCluster


def connect_and_run(port: int, credentials: dict[str, str], calls: int) -> tuple[list[float], int]:
    """The seconds of each connect, run (ngpus=1), close that succeeded, and how many failed."""
    times, failed = [], 0
    for _ in range(calls):
        start = time.perf_counter()
        try:
            with rpycdl.connect(host="127.0.0.1", port=port, **credentials) as conn:
                conn.root.run_code(trivial, 1, ngpus=1)
        except rpycdl.RpycdlError as exc:
            failed += 1
            print(f"  failed: {exc}", file=sys.stderr)
            continue
        times.append(time.perf_counter() - start)
    return times, failed


def flooded(source: str, port: int, connections: int, measure):
    """`measure()` while `connections` silent connections come from `source`."""
    flood = flooding.start(source, "127.0.0.1", port, connections)
    try:
        return measure()
    finally:
        out, _ = flood.communicate("", timeout=60)
        print(f"  flood from {source}: {out.strip()}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--connections", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as team, tempfile.TemporaryDirectory() as lock_dir, \
            LocalCluster(lock_dir) as cluster:
        for argv in (["ca", team], ["server", team, "--name", "localhost", "--ip", "127.0.0.1"],
                     ["user", team, "alice"]):
            assert cli.main(["certs", *argv]) == 0
        credentials = {"tls_cert": f"{team}/user-alice.crt", "tls_key": f"{team}/user-alice.key",
                       "tls_ca": f"{team}/ca.crt"}
        server, port = cluster.add_server("pytorch", "fake:2", "--tls-cert", f"{team}/server-localhost.crt",
                                     "--tls-key", f"{team}/server-localhost.key", "--tls-ca", f"{team}/ca.crt")
        connect_and_run(port, credentials, 5)  # warm up
        rows = [("no flood", *connect_and_run(port, credentials, args.calls))]
        for source in ("127.0.0.2", "127.0.0.1"):
            rows.append((f"{args.connections} silent connections from {source}",
                         *flooded(source, port, args.connections,
                                  lambda: connect_and_run(port, credentials, args.calls))))
        if any(failed for _, _, failed in rows):  # what the server said, for whoever looks into it
            code = server.popen.poll()
            print(f"  the server {'still runs' if code is None else f'exited with {code}'}; its last lines:",
                  *server.lines[-20:], sep="\n    ", file=sys.stderr)
    print(f"rpycdl from {os.path.dirname(rpycdl.__file__)}")
    print(f"Machine: {platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}\n")
    print("| connect (TLS), run ngpus=1, close | p50 | p99 | x no flood (p50) | failed |")
    print("|---|---|---|---|---|")
    base = percentile(rows[0][1], 50)
    for name, times, failed in rows:
        if not times:
            print(f"| {name} | | | | {failed} of {args.calls} |")
            continue
        p50, p99 = percentile(times, 50), percentile(times, 99)
        print(f"| {name} | {p50 * 1e3:.1f} ms | {p99 * 1e3:.1f} ms | {p50 / base:.2f}x | {failed} of {args.calls} |")


if __name__ == "__main__":
    main()
