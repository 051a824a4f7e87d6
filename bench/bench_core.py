"""Core benchmarks: round trip, GPU hand-off, makespan, and status under load, each with a baseline
measured in the same run. Prints a Markdown table (see BENCHMARKS.md). Where Ray imports (the
optional `bench` extra), also a Ray task with num_gpus=1 on ray.init(num_gpus=4), and Ray on the
makespan workload, measured after rpycdl's servers are stopped.

    python bench/bench_core.py [--quick] [--no-ray]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import rpyc

import rpycdl
from rpycdl.security import cgroups
from rpycdl.site.local import LocalCluster


def ms(milliseconds: float) -> str:
    """Milliseconds as the tables show them: to 0.01 ms under 1 ms, to 0.1 ms above."""
    return f"{milliseconds:.2f} ms" if milliseconds < 1 else f"{milliseconds:.1f} ms"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def busy_seconds() -> float:
    """CPU seconds this machine has spent busy, all processes together (Linux's /proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def timed_cpu(fn: Callable[[], object], n: int) -> tuple[list[float], float]:
    """timed(fn, n), and the machine's busy CPU seconds per call while it ran."""
    start = busy_seconds()
    samples = timed(fn, n)
    return samples, (busy_seconds() - start) / n


def _process_cpu() -> dict[int, tuple[float, float, str]]:
    """Each process's CPU seconds, its reaped children's, and its command line (Linux's /proc)."""
    found = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat, open(f"/proc/{pid}/cmdline") as cmdline:
                fields, command = stat.read().rsplit(")", 1)[1].split(), cmdline.read().replace("\0", " ")
        except OSError:  # gone meanwhile
            continue
        found[int(pid)] = ((int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick,
                           command)
    return found


def cpu_by_process(before: dict[int, tuple[float, float, str]], n: int) -> dict[str, float]:
    """CPU seconds per call of the `n` calls made since `before` (_process_cpu()), by who spent them: this client,
    rpycdl's server and connection processes, its forkserver (forking), and the job processes it forked (counted
    as it reaps them)."""
    spent = {"client": 0.0, "server and connection processes": 0.0, "forkserver": 0.0, "job processes": 0.0}
    for pid, (own, reaped, command) in _process_cpu().items():
        was = before.get(pid, (0.0, 0.0, ""))
        if pid == os.getpid():
            spent["client"] += own - was[0]
        elif "rpycdl.server.forkserver" in command and pid in before:  # not a job forked meanwhile
            spent["forkserver"] += own - was[0]
            spent["job processes"] += reaped - was[1]
        elif "rpycdl serve" in command:
            spent["server and connection processes"] += own - was[0]
    return {who: seconds / n for who, seconds in spent.items()}


def timed(fn: Callable[[], object], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


ECHO_SERVER = """
import rpyc
from rpyc.utils.server import ForkingServer

class EchoService(rpyc.Service):
    def exposed_echo(self, value):
        return value

server = ForkingServer(EchoService, hostname="127.0.0.1", port=0)
server.listener.listen(server.backlog)  # before the port is printed, so the client can connect at once
print(server.port, flush=True)
server.start()
"""


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A plain RPyC ForkingServer (in its own process) with one trivial method; its port."""
    server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        yield int(server.stdout.readline())
    finally:
        server.terminate()
        server.wait()


def bare_rpyc_round_trip(n: int) -> tuple[list[float], float]:
    """Baseline: connect to a plain RPyC ForkingServer (in its own process), call a trivial method,
    close; the times, and CPU seconds per call (timed_cpu)."""
    with echo_server() as port:
        def call() -> None:
            conn = rpyc.connect("127.0.0.1", port)
            conn.root.echo(1)
            conn.close()

        return timed_cpu(call, n)


SESSION_BLOCK = 100
"""Calls per block when a session call and its baseline alternate (session_call)."""


def session_call(port: int, n: int) -> tuple[list[float], list[float], float]:
    """A trivial function called on a session kept open (its GPU and process held between calls), and its
    baseline, a trivial method of a plain RPyC ForkingServer called on a connection kept open: `n` of each, in
    alternating blocks of SESSION_BLOCK, so that the machine's drift falls on both alike. Their times, and the
    machine's CPU seconds per session call."""
    session_times: list[float] = []
    bare_times: list[float] = []
    cpu = 0.0
    with (echo_server() as echo_port, rpycdl.connect(host="127.0.0.1", port=port) as conn,
          conn.root.session(ngpus=1) as session):
        bare = rpyc.connect("127.0.0.1", echo_port)
        try:
            session.run(trivial, 1)  # their first calls are like no other: measured from the second
            bare.root.echo(1)
            for _ in range(max(1, n // SESSION_BLOCK)):
                times, per_call = timed_cpu(lambda: session.run(trivial, 1), SESSION_BLOCK)
                session_times += times
                cpu += per_call * SESSION_BLOCK
                bare_times += timed(lambda: bare.root.echo(1), SESSION_BLOCK)
        finally:
            bare.close()
    return session_times, bare_times, cpu / len(session_times)


def _jobs() -> tuple[Callable[[int], int], Callable[[float], tuple[float, float]]]:
    """The jobs the round trip and the hand-off run, defined here so that dill sends them by value
    (a module-level function of an importable module travels by name: bench_ab imports this one)."""

    def trivial(x: int) -> int:
        return x + 1

    def hold(seconds: float) -> tuple[float, float]:
        import time as t

        start = t.time()
        t.sleep(seconds)
        return start, t.time()

    return trivial, hold


trivial, _hold = _jobs()


def rpycdl_round_trip(port: int, n: int) -> tuple[list[float], float]:
    """Connect, run a trivial function with ngpus=1, close; the times, and CPU seconds per call."""
    def call() -> None:
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            conn.root.run_code(trivial, 1, ngpus=1)

    return timed_cpu(call, n)


def open_connection_round_trip(port: int, n: int) -> tuple[list[float], float, dict[str, float]]:
    """Run a trivial function with ngpus=1 on a connection kept open; the times, the machine's CPU seconds per
    call, and those by process (cpu_by_process)."""
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        before = _process_cpu()
        samples, cpu = timed_cpu(lambda: conn.root.run_code(trivial, 1, ngpus=1), n)
        return samples, cpu, cpu_by_process(before, n)


def fence_cost(ports: dict[str, int], n: int, block: int = 10) -> dict[str, list[float]]:
    """run ngpus=1 on an open connection to each server of `ports` (by name), `n` calls each, in alternating blocks of
    `block` calls so that each sees the same machine; the times by name."""
    conns = {name: rpycdl.connect(host="127.0.0.1", port=port) for name, port in ports.items()}
    try:
        for conn in conns.values():
            timed(lambda conn=conn: conn.root.run_code(trivial, 1, ngpus=1), 5)  # warm up
        samples: dict[str, list[float]] = {name: [] for name in conns}
        for _ in range(n // block):
            for name, conn in conns.items():
                samples[name] += timed(lambda conn=conn: conn.root.run_code(trivial, 1, ngpus=1), block)
        return samples
    finally:
        for conn in conns.values():
            conn.close()


def hand_off(port: int, n: int) -> list[float]:
    """From one job's function returning to the next waiting job's function starting (ngpus=-1)."""
    def run(spans: dict[int, tuple[float, float]], i: int) -> None:
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            spans[i] = conn.root.run_code(_hold, 0.1, ngpus=-1)

    gaps = []
    for _ in range(n):
        spans: dict[int, tuple[float, float]] = {}
        first = threading.Thread(target=run, args=(spans, 0))
        first.start()
        time.sleep(0.03)
        second = threading.Thread(target=run, args=(spans, 1))
        second.start()
        first.join()
        second.join()
        gaps.append(spans[1][0] - spans[0][1])
    return gaps


def _makespan_client(port: int, jobs: list[int], timeout: float | None, out: multiprocessing.Queue) -> None:
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        for ngpus in jobs:
            conn.root.run_code(_sleep_job, JOB_SECONDS, ngpus=ngpus, timeout=timeout)
    out.put(len(jobs))


def _sleep_job(seconds: float) -> None:
    import time as t

    t.sleep(seconds)


def fcfs_schedule(jobs: list[int], seconds: float, gpus: int = 4) -> float:
    """Makespan of `jobs` (GPU counts) granted strictly first come, first served with no overhead."""
    free_at = [0.0] * gpus
    start = 0.0
    for n in jobs:
        free_at.sort()
        start = max(start, free_at[n - 1])  # FCFS: never before the job ahead started
        for i in range(n):
            free_at[i] = start + seconds
    return max(free_at)


JOB_SECONDS = 0.05
PATTERN = [1, 1, 2, 1, 4, 1, 2, 1]
"""The makespan workload: jobs of JOB_SECONDS asking for these GPU counts in turn."""


def makespan(port: int, total: int, clients: int, timeout: float | None = None) -> tuple[float, float, float]:
    """(measured, ideal, FCFS ideal) seconds for `total` 50 ms jobs of mixed ngpus from `clients`
    processes on 4 GPUs, each declaring `timeout`. Ideal packs GPU-seconds perfectly; FCFS ideal keeps
    arrival order."""
    jobs = [PATTERN[i % len(PATTERN)] for i in range(total)]
    ideal = sum(JOB_SECONDS * n for n in jobs) / 4
    arrival = [jobs[c + clients * k] for k in range(total // clients + 1) for c in range(clients)
               if c + clients * k < total]  # every client's k-th job before anyone's (k+1)-th
    elapsed = timed_clients(_makespan_client, [(port, jobs[i::clients], timeout) for i in range(clients)], total)
    return elapsed, ideal, fcfs_schedule(arrival, JOB_SECONDS)


def timed_clients(client: Callable[..., None], args: list[tuple[object, ...]], total: int) -> float:
    """Seconds from starting a client process per `args` (each calls client(*args, out) and puts the number
    of jobs it ran on `out`) until all `total` jobs are done. Forked: the children keep __main__, so dill
    sends the jobs by value."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=client, args=(*each, out)) for each in args]
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    done = sum(out.get() for _ in procs)
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join()
    assert done == total, f"{done} of {total} jobs ran"
    return elapsed


def status_under_load(port: int, waiting: int) -> tuple[list[float], list[float]]:
    """Latency of gpu_status with `waiting` queued requests, and with none (baseline)."""
    def status() -> None:
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            conn.root.gpu_status()

    idle = timed(status, 20)
    stop = threading.Event()
    holder = threading.Thread(target=lambda: _hold_all(port, stop))
    holder.start()
    time.sleep(0.5)
    conns = [rpycdl.connect(host="127.0.0.1", port=port) for _ in range(waiting)]
    threads = [threading.Thread(target=_quiet_run, args=(c,)) for c in conns]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            if len(conn.root.gpu_status()["queue"]) >= waiting:
                break
        time.sleep(0.2)
    loaded = timed(status, 20)
    stop.set()
    for conn in conns:
        conn.close()
    holder.join()
    return idle, loaded


def _hold_all(port: int, stop: threading.Event) -> None:
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        try:
            conn.root.run_code(_wait_for_file, None, ngpus=-1, timeout=120)
        except Exception:  # noqa: BLE001 - ended by the benchmark
            pass


def _wait_for_file(_: None) -> None:
    import time as t

    t.sleep(8)


def _quiet_run(conn: rpycdl.Connection) -> None:
    try:
        conn.root.run_code(trivial, 1, ngpus=1)
    except Exception:  # noqa: BLE001 - closed by the benchmark
        pass


def ray_benchmarks(n: int, total: int, clients: int) -> dict[str, object] | None:
    """Ray on this machine, if installed: ray.init seconds, the first task's seconds, task round
    trips after warm-up as Ray runs GPU tasks by default (a new worker process per task: max_calls=1)
    and with workers reused (max_calls=0), and the makespan workload with workers reused
    (`clients` threads, each waiting for its task before submitting the next, as rpycdl's clients do)."""
    try:
        import ray
    except ImportError:
        return None
    start = time.perf_counter()
    ray.init(num_gpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    init = time.perf_counter() - start
    try:
        # num_cpus=0: GPUs are the only resource a task waits for, as with rpycdl (Ray's default
        # of one CPU per task would let only 2 tasks run at once on this 2-core machine).
        task = ray.remote(num_gpus=1, num_cpus=0)(trivial)
        start = time.perf_counter()
        ray.get(task.remote(1))
        first = time.perf_counter() - start
        timed(lambda: ray.get(task.remote(1)), 3)  # warm up
        default = timed(lambda: ray.get(task.remote(1)), min(n, 30))  # ~0.5 s each here
        reused = ray.remote(num_gpus=1, num_cpus=0, max_calls=0)(trivial)
        timed(lambda: ray.get(reused.remote(1)), 20)  # warm up
        samples = timed(lambda: ray.get(reused.remote(1)), n)
        return {"init": init, "first": first, "default": default, "round_trip": samples,
                "makespan": ray_makespan(total, clients)}
    finally:
        ray.shutdown()


def ray_makespan(total: int, clients: int) -> float:
    """Ray (initialised) on the makespan workload, workers reused: `clients` threads, each waiting for its
    task before submitting the next, as rpycdl's clients do."""
    import ray

    sleep_task = ray.remote(num_cpus=0, max_calls=0)(_sleep_job)
    jobs = [PATTERN[i % len(PATTERN)] for i in range(total)]

    def client(mine: list[int]) -> None:
        for ngpus in mine:
            ray.get(sleep_task.options(num_gpus=ngpus).remote(JOB_SECONDS))

    ray.get([sleep_task.options(num_gpus=1).remote(0) for _ in range(8)])  # workers started
    threads = [threading.Thread(target=client, args=(jobs[i::clients],)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--no-ray", action="store_true", help="skip Ray even where it is installed")
    parser.add_argument("--round-trip", action="store_true",
                        help="the round trips alone, without Ray (for A/B runs: PYTHONPATH=OTHER_CHECKOUT picks "
                             "the rpycdl measured)")
    parser.add_argument("--preload", default=None, metavar="MODULES",
                        help="the server's --preload ('' for none; default: the server's, torch where installed)")
    args = parser.parse_args()
    n = 30 if args.quick else 200
    rows = []
    with tempfile.TemporaryDirectory() as lock_dir, LocalCluster(lock_dir) as cluster:
        preload = () if args.preload is None else ("--preload", args.preload)  # every server alike
        server, port = cluster.add_server("pytorch", "fake:4", *preload)
        print(next(line for line in server.lines if "preloaded:" in line).split("preloaded: ")[1].split(";")[0],
              "preloaded by the server's forkserver")
        rpycdl_round_trip(port, 5)  # warm up
        base, base_cpu = bare_rpyc_round_trip(n)
        ours, ours_cpu = rpycdl_round_trip(port, n)
        rows.append(("round trip (connect, run ngpus=1, close)", ours, base, "bare RPyC connect+call+close"))
        kept, kept_cpu, by_process = open_connection_round_trip(port, n)
        rows.append(("run ngpus=1 on an open connection", kept, base, "bare RPyC connect+call+close"))
        in_session, open_call, session_cpu = session_call(port, 10 * n)  # 0.5 ms each: 10 times as many
        rows.append(("call on an open session (ngpus=1)", in_session, open_call, "bare RPyC call, open connection"))
        if not isinstance(cgroups.detect(), str):  # a root server fences its jobs: what it costs, against none
            bare = cluster.add_server("pytorch", "fake:4", "--no-fence", *preload)[1]
            private = cluster.add_server("pytorch", "fake:4", "--job-tmp", "64MiB", *preload)[1]
            cost = fence_cost({"fenced": port, "bare": bare, "tmp": private}, n)
            rows.append(("run ngpus=1 on an open connection, in a cgroup of its own", cost["fenced"], cost["bare"],
                         "the same, --no-fence"))
            rows.append(("the same with a private /tmp (--job-tmp)", cost["tmp"], cost["bare"], "the same, --no-fence"))
        if not args.round_trip:
            gaps = hand_off(port, 10 if args.quick else 40)
            rows.append(("hand-off (release to next job's start)", gaps, None, "original: 1 s polling"))
            measured, ideal, fcfs = makespan(port, 200, 8)
            idle, loaded = status_under_load(port, 100)
            rows.append(("status, 100 waiting", loaded, idle, "status with an empty queue"))
    print(f"rpycdl from {os.path.dirname(rpycdl.__file__)}")
    print(f"Machine: {platform.machine()}, {multiprocessing.cpu_count()} cores, Python {platform.python_version()}\n")
    print("| benchmark | p50 | p99 | baseline p50 | ratio | baseline |")
    print("|---|---|---|---|---|---|")
    for name, samples, baseline, what in rows:
        p50, p99 = percentile(samples, 50) * 1e3, percentile(samples, 99) * 1e3
        if baseline is None:
            print(f"| {name} | {ms(p50)} | {ms(p99)} | | | {what} |")
        else:
            b50 = percentile(baseline, 50) * 1e3
            print(f"| {name} | {ms(p50)} | {ms(p99)} | {ms(b50)} | {p50 / b50:.2f}x | {what} |")
    if not args.round_trip:
        print(f"| makespan, 200 x 50 ms jobs, 8 clients, fake:4, mixed ngpus | {measured:.2f} s | | {ideal:.2f} s "
              f"| {measured / ideal:.2f}x | ideal (GPU-seconds / 4) |")
        print(f"| the same against strict FCFS with zero overhead | {measured:.2f} s | | {fcfs:.2f} s "
              f"| {measured / fcfs:.2f}x | same arrival order, no overhead |")
        print(f"\nGPU idle fraction over the makespan (1 - the jobs' GPU-seconds / (4 GPUs x makespan)): "
              f"{1 - ideal / measured:.1%}; the zero-overhead FCFS schedule's: {1 - ideal / fcfs:.1%}")
        print(f"mean hand-off {statistics.mean(gaps) * 1e3:.1f} ms over {len(gaps)} hand-offs")
    print(f"\nCPU per round trip, every process of the machine: rpycdl {ours_cpu * 1e3:.1f} ms, bare RPyC "
          f"{base_cpu * 1e3:.1f} ms ({ours_cpu / base_cpu:.2f}x), rpycdl on an open connection "
          f"{kept_cpu * 1e3:.1f} ms, a call on an open session {session_cpu * 1e3:.1f} ms; "
          f"{multiprocessing.cpu_count()} cores")
    print("CPU per run ngpus=1 on an open connection, by process: " +
          ", ".join(f"{who} {seconds * 1e3:.2f} ms" for who, seconds in by_process.items()))
    theirs = None if args.no_ray or args.round_trip else ray_benchmarks(n, 200, 8)
    if theirs is None:
        return
    o50, o99 = percentile(ours, 50) * 1e3, percentile(ours, 99) * 1e3
    print("\n| Ray (same machine, after rpycdl) | p50 | p99 | rpycdl p50 | Ray / rpycdl |")
    print("|---|---|---|---|---|")
    for name, key in (("task num_gpus=1, Ray's default (new worker per GPU task)", "default"),
                      ("task num_gpus=1, max_calls=0 (workers reused), warm", "round_trip")):
        r50, r99 = percentile(theirs[key], 50) * 1e3, percentile(theirs[key], 99) * 1e3
        print(f"| {name} | {r50:.1f} ms | {r99:.1f} ms | {o50:.1f} ms | {r50 / o50:.2f}x p50, {r99 / o99:.2f}x p99 |")
    s50 = percentile(in_session, 50) * 1e3
    r50 = percentile(theirs["round_trip"], 50) * 1e3
    print(f"| Ray's reused worker against a call on an open session | {r50:.1f} ms | | {ms(s50)} (session) "
          f"| {r50 / s50:.2f}x |")
    first = theirs["first"] * 1e3
    print(f"| first task after ray.init | {first:.0f} ms | | {o50:.1f} ms | {first / o50:.0f}x |")
    print(f"| ray.init(num_gpus=4) | {theirs['init'] * 1e3:.0f} ms | | | |")
    print(f"| makespan, same workload, 8 client threads, workers reused | {theirs['makespan']:.2f} s | "
          f"| {measured:.2f} s "
          f"| {theirs['makespan'] / measured:.2f}x (ideal {ideal:.2f} s) |")


if __name__ == "__main__":
    main()
