"""The monitor's cost (issue 16), each against a baseline measured in the same run:

1. Scrape: GET /metrics of the monitor of a loaded host (a fake:8 server whose 8 GPUs one detached job
   holds, --waiting detached jobs of one GPU each waiting behind it, a ledger of --rows finished jobs
   written before the server starts) against the same of the monitor of an idle host (an idle fake:8
   server, an empty ledger), alternating, on HTTP connections kept open (keep-alive, as Prometheus
   scrapes; --no-keep-alive: a new connection each). A monitor serves a collection again for a second
   (rpycdl.monitor.web.SCRAPE_REUSE), so each monitor is scraped at most once a second, and the scrapes
   go round --monitors monitors of each host: every one measured makes a collection. Each is followed,
   PAUSE later, by a scrape of the same monitor served from that collection (the HTTP side alone). Then
   20 scrapes back to back, on one connection kept open and on a new connection each.
2. In-process, on the loaded host: the parts of one collection (HostCollector.collect() and
   generate_latest timed alone, and the top functions of cProfile over --profile collections), and
   what a collection costs where many jobs ended in the last 5 minutes (the monitor reads those again
   each time: rpycdl.monitor.metrics.LATE_COMMIT).
3. Grants: run_code(trivial, 1, ngpus=1) round trips on an open connection to an idle fake:8 server, in
   alternating rounds of --calls with nobody scraping its host's monitor, with a scraper scraping one
   monitor every SCRAPE_REUSE + 0.05 s (so each scrape is a collection), and with one scraping another
   monitor as fast as it can; the scraper is a process of its own, as Prometheus is.

    python bench/bench_monitor.py [--scrapes 200] [--rows 100000] [--waiting 100] [--rounds 80] [--calls 25]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import http.client
import multiprocessing
import multiprocessing.connection
import os
import platform
import pstats
import re
import shutil
import sqlite3
import statistics
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from bench_core import busy_seconds, percentile, timed, trivial
from bench_jobs import fill_ledger, ms
from prometheus_client import CollectorRegistry, generate_latest

import rpycdl
from rpycdl.defaults import STATE_SUBDIR
from rpycdl.gpu.inventory import load_inventory
from rpycdl.monitor.metrics import LATE_COMMIT, HostCollector
from rpycdl.monitor.web import SCRAPE_REUSE
from rpycdl.site.local import LocalCluster

FRESH_AFTER = SCRAPE_REUSE + 0.02
"""Seconds after the answer of a monitor's last collection that a scrape surely makes a new one (the
monitor records a collection's time before it answers)."""

EVERY_SECOND = SCRAPE_REUSE + 0.05
"""The A/B's periodic scraper's interval: each of its scrapes makes a collection."""


def hold_until(gate: str) -> None:
    """A job that holds its GPUs until the file `gate` exists (sent by value: defined in __main__)."""
    import os as o
    import time as t

    while not o.path.exists(gate):
        t.sleep(0.05)


class Scraper:
    """GETs of one monitor's /metrics, on a connection kept open (reopened if the monitor closed it),
    or on a new connection each."""

    def __init__(self, url: str, keep_alive: bool = True) -> None:
        self.url, parsed = url, urllib.parse.urlsplit(url)
        self.host, self.port, self.keep_alive = parsed.hostname or "127.0.0.1", parsed.port or 80, keep_alive
        self.conn: http.client.HTTPConnection | None = None
        self.done = -FRESH_AFTER
        """time.monotonic() of the last answer that came from a collection (get_fresh)."""

    def get(self) -> tuple[float, bytes]:
        """One scrape: seconds from sending the request to the body's last byte, and the body."""
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            start = time.perf_counter()
            try:
                self.conn.request("GET", "/metrics")
                response = self.conn.getresponse()
                body = response.read()
            except (ConnectionError, http.client.HTTPException):  # the monitor closed an idle connection
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
                continue
            elapsed = time.perf_counter() - start
            if response.status != 200:
                raise RuntimeError(f"GET /metrics answered {response.status}")
            if not self.keep_alive:
                self.conn.close()
                self.conn = None
            return elapsed, body
        raise AssertionError("unreachable")

    def get_fresh(self) -> tuple[float, bytes]:
        """A scrape that makes a collection: FRESH_AFTER after the last one's answer."""
        time.sleep(max(0.0, self.done + FRESH_AFTER - time.monotonic()))
        answer = self.get()
        self.done = time.monotonic()
        return answer

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def series(body: bytes, name: str) -> list[float]:
    """The values of the samples of metric `name` in an exposition."""
    return [float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", body.decode(), re.M)]


def settle(limit: float = 60.0, below: float = 0.3) -> float:
    """Wait until the machine's busy CPU over a second is below `below` cores (at most `limit` seconds);
    returns the last second's busy cores."""
    deadline, busy = time.monotonic() + limit, float("inf")
    while time.monotonic() < deadline:
        start = busy_seconds()
        time.sleep(1.0)
        busy = busy_seconds() - start
        if busy < below:
            break
    return busy


PAUSE = 0.3
"""Seconds between a collection's scrape and the scrape served again from it: back to back on one
connection, the second would wait for a delayed ACK (see back_to_back)."""


def scrape_cost(loaded: list[Scraper], idle: list[Scraper], n: int) -> dict[str, list[float]]:
    """`n` rounds, each on the next monitor of each host: a scrape making a collection of the loaded host's
    and of the idle host's (which goes first alternates), then, PAUSE later, one of each served again
    from that collection."""
    samples: dict[str, list[float]] = {"loaded": [], "idle": [], "loaded, reused": [], "idle, reused": []}
    for i in range(n):
        pair = [("loaded", loaded[i % len(loaded)]), ("idle", idle[i % len(idle)])]
        if i % 2:
            pair.reverse()
        for key, scraper in pair:
            samples[key].append(scraper.get_fresh()[0])
        time.sleep(PAUSE)
        for key, scraper in pair:
            samples[f"{key}, reused"].append(scraper.get()[0])
    return samples


def back_to_back(url: str, n: int) -> dict[str, list[float]]:
    """`n` scrapes one right after the other (all but the first served again from one collection), on one
    connection kept open, and on a new connection each."""
    samples = {}
    for label, keep_alive in (("one connection kept open", True), ("a new connection each", False)):
        scraper = Scraper(url, keep_alive)
        samples[label] = timed(scraper.get, n)
        scraper.close()
    return samples


def paused(fn: Callable[[], object], n: int, pause: float) -> list[float]:
    """timed(fn, 1), `n` times, each `pause` seconds after the last (as a monitor collects: its caches cold)."""
    samples = []
    for _ in range(n):
        time.sleep(pause)
        samples += timed(fn, 1)
    return samples


def breakdown(collector: HostCollector, n: int, cold: int) -> dict[str, list[float]]:
    """The parts of one collection, each timed alone `n` times in this process, one after the other; and
    the whole collection `cold` times, each 0.5 s after the last."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    generate_latest(registry)  # warm: queue entries and held/ records are read once per process
    return {
        "generate_latest (the whole scrape's body)": timed(lambda: generate_latest(registry), n),
        "the same, 0.5 s after the last": paused(lambda: generate_latest(registry), cold, 0.5),
        "HostCollector.collect()": timed(lambda: list(collector.collect()), n),
        "GPULockManager.snapshot() (held/, queue/)": timed(collector.locks.snapshot, n),
        "FakeInventory.memory_used()": timed(collector.inventory.memory_used, n),
        "Ledger.count_by_state()": timed(collector.ledger.count_by_state, n),
        "ended jobs (_ended: histograms)": timed(lambda: list(collector._ended()), n),
    }


def profile(collector: HostCollector, n: int, top: int) -> list[str]:
    """cProfile over `n` collections: the `top` functions by own time, as lines of a Markdown table
    (per collection)."""
    list(collector.collect())
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        list(collector.collect())
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    lines = [f"| all, under cProfile | {total / n * 1e3:.2f} ms | | |"]
    for (path, line, func), (_, calls, own, cumulative, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{os.path.basename(path)}:{line} {func}" if line else func
        lines.append(f"| `{where}` | {own / n * 1e3:.2f} ms | {cumulative / n * 1e3:.2f} ms | {calls / n:g} |")
    return lines


def recent_ends(scratch: str, counts: list[int], n: int) -> list[tuple[int, list[float]]]:
    """HostCollector.collect() where `count` jobs ended within the last LATE_COMMIT seconds, for each count:
    a ledger of that many finished rows whose ends are spread over those seconds, read by a collector that
    started before them (as one running for a while sees them), after its first collection counted them."""
    out = []
    for count in counts:
        lock_dir = os.path.join(scratch, f"ends-{count}")
        state_dir = os.path.join(lock_dir, STATE_SUBDIR)
        fill_ledger(state_dir, count)
        now = time.time()
        with contextlib.closing(sqlite3.connect(os.path.join(state_dir, "ledger.sqlite3"))) as db, db:
            db.execute("UPDATE jobs SET ended = ? - (rowid % 1000) * ? / 1000, started = ? - 400",
                       (now, LATE_COMMIT - 10, now))
        collector = HostCollector(load_inventory("fake:8"), lock_dir, state_dir)
        collector._since = now - LATE_COMMIT - 100  # as a monitor started before these jobs ended
        list(collector.collect())
        out.append((count, timed(lambda c=collector: list(c.collect()), n)))
        collector.ledger.close()
    return out


def scrape_loop(urls: tuple[str, str], mode: Any, seen: Any, out: multiprocessing.connection.Connection) -> None:
    """The A/B's scraper (a process of its own): while `mode` is 1, a scrape of urls[0] every EVERY_SECOND
    seconds of mode 1's time, on a connection kept open; while it is 2, scrapes of urls[1] one after the other,
    each on a new connection (faster here than back to back on one: see back_to_back); 0: nothing; -1: stop.
    `seen` says the mode it has seen, once any scrape of the one before has been answered. Sends each mode's
    scrape times."""
    scrapers = {1: Scraper(urls[0]), 2: Scraper(urls[1], keep_alive=False)}  # see back_to_back
    times: dict[int, list[float]] = {1: [], 2: []}
    clock, last = 0.0, time.monotonic()
    while (current := mode.value) >= 0:
        seen.value = current
        now = time.monotonic()
        if current == 1:
            clock += now - last
        last = now
        if current == 2 or (current == 1 and clock >= EVERY_SECOND):
            clock = 0.0 if current == 1 else clock
            times[current].append(scrapers[current].get()[0])
        else:
            time.sleep(0.01)
    out.send(times)


VARIANTS = ("not scraped", f"scraped every {EVERY_SECOND:g} s", "scraped flat out")


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used (all its threads; Linux's /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Variant:
    """What the A/B measured of one variant."""

    rounds: list[list[float]] = dataclasses.field(default_factory=list)
    """Each round's round trip times."""
    wall: float = 0.0
    busy: float = 0.0
    """The machine's busy CPU seconds, all processes."""
    monitors: float = 0.0
    """CPU seconds of the host's monitors."""
    scraper: float = 0.0
    """CPU seconds of the scraper process."""

    @property
    def samples(self) -> list[float]:
        return [value for one in self.rounds for value in one]


def grants_ab(port: int, urls: tuple[str, str], monitors: list[int], rounds: int, calls: int
              ) -> tuple[dict[str, Variant], dict[int, list[float]]]:
    """run_code round trips on an open connection in alternating rounds of the three VARIANTS (their order
    rotating each round), with the CPU the machine, the `monitors` (pids) and the scraper used meanwhile.
    Returns what each variant measured, and the scraper's scrape times by mode."""
    ctx = multiprocessing.get_context("fork")
    mode, seen = ctx.Value("i", 0), ctx.Value("i", -2)
    receiving, sending = ctx.Pipe(duplex=False)
    scraper = ctx.Process(target=scrape_loop, args=(urls, mode, seen, sending))
    scraper.start()
    assert scraper.pid is not None
    measured = {variant: Variant() for variant in VARIANTS}

    def clocks() -> tuple[float, float, float, float]:
        return (time.perf_counter(), busy_seconds(), sum(cpu_seconds(pid) for pid in monitors),
                cpu_seconds(scraper.pid))  # type: ignore[arg-type]

    try:
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            def call() -> None:
                conn.root.run_code(trivial, 1, ngpus=1)

            timed(call, 20)  # warm up
            for i in range(rounds):
                for index in (i % 3, (i + 1) % 3, (i + 2) % 3):
                    variant = measured[VARIANTS[index]]
                    mode.value = index
                    deadline = time.monotonic() + 10
                    while seen.value != index and time.monotonic() < deadline:  # the last round's scrape is over
                        time.sleep(0.001)
                    before = clocks()
                    variant.rounds.append(timed(call, calls))
                    after = clocks()
                    variant.wall += after[0] - before[0]
                    variant.busy += after[1] - before[1]
                    variant.monitors += after[2] - before[2]
                    variant.scraper += after[3] - before[3]
    finally:
        mode.value = -1
        scraped = receiving.recv() if receiving.poll(30) else {1: [], 2: []}
        scraper.join()
    return measured, scraped


def row(label: str, values: list[float]) -> str:
    return (f"| {label} | {ms(percentile(values, 50))} | {ms(percentile(values, 99))} | {ms(max(values))} "
            f"| {len(values)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes of each host (default: %(default)s)")
    parser.add_argument("--monitors", type=int, default=3,
                        help="monitors of each host the scrapes go round (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=100_000, help="finished jobs in the ledger (default: %(default)s)")
    parser.add_argument("--waiting", type=int, default=100, help="requests waiting (default: %(default)s)")
    parser.add_argument("--no-keep-alive", action="store_true", help="a new HTTP connection for each scrape")
    parser.add_argument("--profile", type=int, default=20, help="collections profiled (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=80, help="A/B rounds of each variant (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=25, help="round trips a round (default: %(default)s)")
    args = parser.parse_args()
    began = time.perf_counter()
    print(f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, fake:8 servers; "
          f"{args.scrapes} scrapes a host over {args.monitors} monitors each, "
          f"{'new connections' if args.no_keep_alive else 'keep-alive'}; {args.rows} rows, {args.waiting} waiting; "
          f"A/B {args.rounds} rounds x {args.calls} calls\n", flush=True)
    scratch = tempfile.mkdtemp(prefix="bench-monitor-")
    try:
        start = time.perf_counter()
        fill_ledger(os.path.join(scratch, "loaded", STATE_SUBDIR), args.rows)
        filled = time.perf_counter() - start
        with LocalCluster(os.path.join(scratch, "loaded")) as loaded, \
                LocalCluster(os.path.join(scratch, "idle")) as idle:
            port = loaded.add_server("pytorch", "fake:8", "--max-queued-per-user", str(args.waiting + 10))[1]
            idle.add_server("pytorch", "fake:8")
            scrapers = {name: [Scraper(cluster.add_monitor("fake:8")[1] + "/metrics", not args.no_keep_alive)
                               for _ in range(args.monitors)] for name, cluster in (("loaded", loaded), ("idle", idle))}
            gate = os.path.join(scratch, "gate")
            with rpycdl.connect(host="127.0.0.1", port=port) as conn:
                holder = conn.root.submit(hold_until, gate, ngpus=8)
                while holder.refresh()["state"] != "RUNNING":
                    time.sleep(0.1)
                start = time.perf_counter()
                waiters = [conn.root.submit(trivial, 1, ngpus=1) for _ in range(args.waiting)]
                submitted = time.perf_counter() - start
                body = b""
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    body = scrapers["loaded"][0].get_fresh()[1]
                    if sum(series(body, "rpycdl_queue_waiting_requests")) >= args.waiting:
                        break
                background = settle()
                waiting = sum(series(body, "rpycdl_queue_waiting_requests"))
                holding = len(series(body, "rpycdl_gpu_holder_info"))
                jobs = sum(series(body, "rpycdl_jobs"))
                print(f"Loaded host: {holding:.0f} holder series, {waiting:.0f} waiting, {jobs:.0f} jobs in the "
                      f"ledger ({args.rows} rows written in {filled:.1f} s, {args.waiting} submitted in "
                      f"{submitted:.1f} s); machine busy {background:.2f} cores before measuring", flush=True)
                for group in scrapers.values():  # warm up (and each now knows when its monitor last collected)
                    for scraper in group:
                        scraper.get_fresh()
                scraped = scrape_cost(scrapers["loaded"], scrapers["idle"], args.scrapes)
                sizes = {name: len(group[0].get()[1]) for name, group in scrapers.items()}
                stalls = back_to_back(scrapers["idle"][0].url, 20)
                collector = HostCollector(load_inventory("fake:8"), loaded.lock_dir,
                                          os.path.join(loaded.lock_dir, STATE_SUBDIR))
                parts = breakdown(collector, 50, 20)
                profiled = profile(collector, args.profile, 12)
                collector.ledger.close()
                for job in waiters:
                    job.cancel()
                open(gate, "w").close()
                holder.result(timeout=60)
            for group in scrapers.values():
                for scraper in group:
                    scraper.close()
        ends = recent_ends(scratch, [1000, 10_000], 20)
        with LocalCluster(os.path.join(scratch, "ab")) as ab:
            port = ab.add_server("pytorch", "fake:8")[1]
            monitors = [ab.add_monitor("fake:8") for _ in range(2)]
            urls = (monitors[0][1] + "/metrics", monitors[1][1] + "/metrics")
            settle()
            measured, by_mode = grants_ab(port, urls, [process.popen.pid for process, _ in monitors], args.rounds,
                                          args.calls)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\nScrapes, {'a new connection each' if args.no_keep_alive else 'keep-alive'} "
          f"(exposition: loaded {sizes['loaded']} bytes, idle {sizes['idle']} bytes)\n")
    print("| GET /metrics | p50 | p99 | max | n |")
    print("|---|---|---|---|---|")
    for key, values in scraped.items():
        print(row(key + (" (served again)" if "reused" in key else " (a collection)"), values))
    print("\nBack to back, 20 scrapes of the idle host's monitor (p50 / max): " + "; ".join(
        f"{label} {ms(percentile(values, 50))} / {ms(max(values))}" for label, values in stalls.items()))
    ratio = {q: percentile(scraped["loaded"], q) / percentile(scraped["idle"], q) for q in (50, 99)}
    print(f"\nloaded / idle: p50 {ratio[50]:.2f}x, p99 {ratio[99]:.2f}x; mean loaded "
          f"{ms(statistics.mean(scraped['loaded']))}, idle {ms(statistics.mean(scraped['idle']))}")

    print("\nOne collection of the loaded host, in this process (each part timed alone, 50 times one after the "
          "other, but the line marked 0.5 s: 20 times)\n")
    print("| part | p50 | p99 | max | n |")
    print("|---|---|---|---|---|")
    for label, values in parts.items():
        print(row(label, values))
    print(f"\ncProfile of {args.profile} collections (HostCollector.collect()), top functions by own time, "
          "per collection\n")
    print("| function | own | cumulative | calls |")
    print("|---|---|---|---|")
    print("\n".join(profiled))
    print(f"\nHostCollector.collect() with jobs ended in the last {LATE_COMMIT:g} s (read again at each "
          "collection), in this process:")
    for count, values in ends:
        print(f"  {count} ended: p50 {ms(percentile(values, 50))}, p99 {ms(percentile(values, 99))}")

    base = measured[VARIANTS[0]]
    print(f"\nGrants: run_code(trivial, 1, ngpus=1) on an open connection, {args.rounds} rounds x {args.calls} "
          "calls of each, alternating; ratios to not scraped; CPU: the machine's per round trip, the monitors' and "
          "the scraper's in cores (CPU seconds / the variant's seconds)\n")
    print("| variant | p50 | p99 | mean | ratio p50 / p99 / mean | per-round p50 ratio, quartiles | rounds slower "
          "| machine CPU per call | monitors | scraper |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, variant in measured.items():
        values, reference = variant.samples, base.samples
        paired = sorted(statistics.median(one) / statistics.median(other)
                        for one, other in zip(variant.rounds, base.rounds, strict=True))
        print(f"| {label} | {ms(percentile(values, 50))} | {ms(percentile(values, 99))} | "
              f"{ms(statistics.mean(values))} | {percentile(values, 50) / percentile(reference, 50):.3f} / "
              f"{percentile(values, 99) / percentile(reference, 99):.3f} / "
              f"{statistics.mean(values) / statistics.mean(reference):.3f} | "
              f"{percentile(paired, 25):.3f} / {percentile(paired, 50):.3f} / {percentile(paired, 75):.3f} | "
              f"{sum(1 for r in paired if r > 1)}/{len(paired)} | {ms(variant.busy / len(values))} | "
              f"{variant.monitors / variant.wall:.3f} | {variant.scraper / variant.wall:.3f} |")
    odd = [v for one in base.rounds[1::2] for v in one]
    even = [v for one in base.rounds[::2] for v in one]
    print(f"A/A, not scraped, odd rounds / even rounds: p50 {percentile(odd, 50) / percentile(even, 50):.3f}, "
          f"p99 {percentile(odd, 99) / percentile(even, 99):.3f}, "
          f"mean {statistics.mean(odd) / statistics.mean(even):.3f}")
    for index in (1, 2):
        times = by_mode.get(index, [])
        if times:
            print(f"The scraper, {VARIANTS[index]}: {len(times)} scrapes, p50 {ms(percentile(times, 50))}, "
                  f"p99 {ms(percentile(times, 99))}, max {ms(max(times))}")
    print(f"\nWhole run {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
