"""What running each job as its owner's account costs (issue 26): round trip, a run on an open connection
and the GPU hand-off (bench_core's measures) against two root servers of this checkout, one running every
job as its owner's account (here the guest account of unverified clients, --guest-user) and one running
every job as root (--one-account), in alternating rounds, so that the machine's drift falls on both alike.

    sudo python bench/bench_isolation.py [--rounds 10]

Needs root (the server switches accounts) and makes the account rpycdl-bench if it is missing.
"""

from __future__ import annotations

import argparse
import os
import pwd
import statistics
import subprocess
import sys
import tempfile

from bench_core import hand_off, open_connection_round_trip, percentile, rpycdl_round_trip

from rpycdl.site.local import LocalCluster

ACCOUNT = "rpycdl-bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (default: %(default)s)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_isolation needs root: the servers switch each job to its account")
    try:
        pwd.getpwnam(ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", ACCOUNT], check=True)
    results: dict[str, dict[str, list[float]]] = {"owner accounts": {}, "one account": {}}
    with tempfile.TemporaryDirectory() as base:
        os.chmod(base, 0o755)
        with LocalCluster(os.path.join(base, "one")) as cluster:
            _, isolated = cluster.add_server("pytorch", "fake:4", "--guest-user", ACCOUNT, isolated=True,
                                             lock_dir=os.path.join(base, "owner"))
            _, shared = cluster.add_server("pytorch", "fake:4")
            for port in (isolated, shared):
                rpycdl_round_trip(port, 5)  # warm up
            for _ in range(args.rounds):
                for mode, port in (("owner accounts", isolated), ("one account", shared)):
                    measured = results[mode]
                    measured.setdefault("round trip", []).extend(rpycdl_round_trip(port, 20)[0])
                    measured.setdefault("open connection", []).extend(open_connection_round_trip(port, 20)[0])
                    measured.setdefault("hand-off", []).extend(hand_off(port, 3))
    print(f"{args.rounds} alternating rounds; p50 (p99) in ms")
    print("| measure | owner accounts | one account | difference of p50 |")
    print("|---|---|---|---|")
    for measure in ("round trip", "open connection", "hand-off"):
        mine, theirs = results["owner accounts"][measure], results["one account"][measure]
        cells = [f"{percentile(values, 50) * 1e3:.2f} ({percentile(values, 99) * 1e3:.2f})"
                 for values in (mine, theirs)]
        difference = (statistics.median(mine) - statistics.median(theirs)) * 1e3
        print(f"| {measure} | {cells[0]} | {cells[1]} | {difference:+.2f} ms |")


if __name__ == "__main__":
    main()
