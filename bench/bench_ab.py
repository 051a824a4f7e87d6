"""A/B of two checkouts' servers in one run: round trip and hand-off (bench_core's measures) against
a server of each, measured in alternating rounds, so that the machine's drift from one minute to
the next falls on both alike. The client is this checkout's.

    python bench/bench_ab.py OLD_CHECKOUT [NEW_CHECKOUT] [--rounds 10]

NEW_CHECKOUT defaults to this one. Each server runs `python -m rpycdl serve` from its checkout
(PYTHONPATH and working directory), with a simulated fake:4 inventory and a lock directory of its own.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_core import hand_off, percentile, rpycdl_round_trip


def start_server(tree: Path, lock_dir: str) -> tuple[subprocess.Popen[str], int]:
    """A fake:4 server running `tree`'s rpycdl; returns it and its port."""
    argv = [sys.executable, "-m", "rpycdl", "serve", "--service", "pytorch", "--gpus", "fake:4", "--port", "0",
            "--registry", "none", "--lock-dir", lock_dir]
    if os.geteuid() == 0 and "--one-account" in "".join(p.read_text() for p in (tree / "rpycdl").rglob("serving.py")):
        argv.append("--one-account")  # as root, a tree that runs jobs as their owners: one account, as before
    server = subprocess.Popen(argv, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert server.stdout is not None
    for line in server.stdout:
        match = re.search(r"on 127\.0\.0\.1:(\d+) as", line)
        if match:
            return server, int(match.group(1))
    raise SystemExit(f"the server of {tree} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path, help="the checkout to compare against")
    parser.add_argument("new", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent,
                        help="the checkout measured (default: this one)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (default: %(default)s)")
    parser.add_argument("--per-round", type=int, default=20, help="round trips per server per round")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    trips: dict[str, list[float]] = {name: [] for name in trees}
    gaps: dict[str, list[float]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory() as scratch:
        servers = {name: start_server(tree, os.path.join(scratch, name)) for name, tree in trees.items()}
        try:
            for _, port in servers.values():
                rpycdl_round_trip(port, 5)  # warm up
            for round_ in range(args.rounds):
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:
                    port = servers[name][1]
                    trips[name] += rpycdl_round_trip(port, args.per_round)[0]
                    gaps[name] += hand_off(port, 4)
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait()
    print(f"{args.rounds} alternating rounds; client from {Path(__file__).resolve().parent.parent}")
    for name, tree in trees.items():
        commit = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True,
                                text=True).stdout.strip()
        print(f"  {name}: {tree} ({commit or 'not a git checkout'})")
    print("\n| benchmark | old p50 | new p50 | new / old | old p99 | new p99 |")
    print("|---|---|---|---|---|---|")
    for label, samples in (("round trip (connect, run ngpus=1, close)", trips),
                           ("hand-off (release to next job's start)", gaps)):
        old50, new50 = percentile(samples["old"], 50) * 1e3, percentile(samples["new"], 50) * 1e3
        old99, new99 = percentile(samples["old"], 99) * 1e3, percentile(samples["new"], 99) * 1e3
        print(f"| {label} | {old50:.2f} ms | {new50:.2f} ms | {new50 / old50:.3f} | {old99:.1f} ms | {new99:.1f} ms |")
    print(f"\nmeans: round trip old {statistics.mean(trips['old']) * 1e3:.2f} ms, new "
          f"{statistics.mean(trips['new']) * 1e3:.2f} ms; hand-off old {statistics.mean(gaps['old']) * 1e3:.2f} ms, "
          f"new {statistics.mean(gaps['new']) * 1e3:.2f} ms ({len(gaps['old'])} hand-offs each)")


if __name__ == "__main__":
    main()
