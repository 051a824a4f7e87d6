"""Chaos for promises 1, 3 and 8 (and 9, with isolation): clients, a killer, an independent observer of /proc, and
the end check."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import random
import re
import select
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

GIB = 1024**3
GPU_MEMORY = 16 * GIB  # each GPU of fake:4
GRACE = 1.0  # promise 3: a job's GPUs are free again within a second
PATIENCE = 6.0  # seconds after the last kill the end check keeps looking, to say when it got clean
OBSERVER_PERIOD = 0.001  # seconds: the observer's median time between looks must not exceed it
TOKEN_VAR = "RPYCDL_CHAOS_RUN"
JOB_VAR = "RPYCDL_JOB_ID"
HERE = Path(__file__).resolve()

REQUESTS: tuple[dict[str, Any], ...] = (
    {"ngpus": 1}, {"ngpus": 1}, {"ngpus": 2}, {"ngpus": -1},
    {"gpu_memory": "3GiB"}, {"gpu_memory": "6GiB"}, {"gpu_memory": "10GiB"}, {"gpus": 0.5},
)

STUBBORN_PYTHON = ("import signal, subprocess, time\n"
                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   "subprocess.Popen(['sleep', '1000'])\n"
                   "while True:\n"
                   "    time.sleep(1)\n")
CHILDREN: dict[str, tuple[float, list[str]]] = {  # kind: (weight, argv); "{python}" is the job's interpreter
    "plain": (0.4, ["sleep", "1000"]),
    "stubborn_shell": (0.45, ["sh", "-c", "trap '' TERM; sleep 1000 & while :; do sleep 1; done"]),
    "stubborn_python": (0.15, ["{python}", "-I", "-S", "-c", STUBBORN_PYTHON]),
}

CONN_KILLS = ("conn_after_grant", "conn", "orphan_conn", "supervisor", "session_conn")
SHARED_KILLS = ("server", "forkserver", "spare", "double_forkserver")
"""Kills of processes that carry no running job (a server parent, a forkserver, a spare): they must end none."""
KILLS: dict[str, float] = {  # the killer's actions and their weights
    "conn_after_grant": 3.0,  # kill -9 a job's connection process as soon as the job has a child
    "conn": 1.5,  # kill -9 the connection process of a running job
    "orphan_conn": 2.0,  # kill -9 a connection process whose server parent was killed
    "job": 1.5,  # kill -9 a job process
    "children_kill": 1.5,  # kill -9 some of a job's children and grandchildren
    "children_term": 1.5,  # SIGTERM them (some ignore it)
    "client": 0.3,  # kill -9 a client, start another
    "supervisor": 0.5,  # kill -9 the supervisor of a running detached job (which makes it LOST)
    "session_process": 1.0,  # kill -9 a session's job process (between its calls or during one)
    "session_conn": 1.0,  # kill -9 a session's connection process
    "session_client": 0.3,  # kill -9 a client holding a session, start another
    "forkserver": 0.5,  # kill -9 a server's job forkserver (it ends no job: the server starts another)
    "spare": 0.5,  # kill -9 a spare connection process, waiting for a client (its spare job process goes with it)
    "keeper": 1.0,  # kill -9 the keeper of a running attached job or session (its job alone ends)
}
DOUBLE_FAULTS = ("double_forkserver", "double_keeper", "double_job")
"""Right after a server parent's kill, while it is down, one of these (Killer._double_fault): its orphaned
forkserver, or the keeper (a detached job's: its supervisor) or job process of a running job."""
DOUBLE_FAULT_PATIENCE = 1.0
"""Seconds a double fault waits, at most, for a running job to kill."""


REQUIRED_KILLS = ("conn_after_grant", "conn", "job", "children_kill", "server", "supervisor", "session_process",
                  "session_conn", "session_client", "forkserver", "spare", "keeper", *DOUBLE_FAULTS)
"""The kinds of kill a run must have made to count (ChaosResult.tested): the killer tries those it has not made
yet in a run's second half."""
ENOUGH_JOBS, ENOUGH_DETACHED, ENOUGH_WORKING_DIRS, ENOUGH_SESSIONS = 50, 10, 10, 5
"""Jobs started, detached jobs submitted, jobs run in a working directory and sessions that ran a call that a run
must have made to count (with every kind of REQUIRED_KILLS, and two shares seen on one GPU at once): the chaos
goes on past its least duration until it has (shortfall)."""


def unhanded(settings: ChaosSettings, rows: Iterable[dict[str, Any]]) -> list[str]:
    """Why the run has not tested the handover of GPUs from an array's element to the next (rpycdl.server.handover),
    as the ledger's `rows` tell: no element was run by a supervisor that had run another element of its array."""
    owners = Counter((row["array_id"], row["owner_pid"]) for row in rows
                     if row.get("array_id") and row.get("owner_pid") and row.get("started"))
    handed = sum(count - 1 for count in owners.values())
    return ["no array's element ran on GPUs its last element's supervisor handed it"] if settings.arrays and not \
        handed else []


def shortfall(jobs: int, kills: Counter[str], submitted: int, working_dirs: int, shared: bool,
              sessions: int, required: tuple[str, ...] = REQUIRED_KILLS) -> list[str]:
    """What a run has not done yet of what it must to count (`required`: the kinds of kill); empty once it has done
    enough."""
    missing = [f"only {jobs} jobs ran"] if jobs < ENOUGH_JOBS else []
    if sessions < ENOUGH_SESSIONS:
        missing.append(f"only {sessions} sessions ran a call")
    missing += [f"no {kind} kill" for kind in required if not kills[kind]]
    if submitted < ENOUGH_DETACHED:
        missing.append(f"only {submitted} detached jobs were submitted")
    if working_dirs < ENOUGH_WORKING_DIRS:
        missing.append(f"only {working_dirs} jobs ran in a working directory")
    if not shared:
        missing.append("the observer never saw two shares on one GPU at once")
    return missing


@dataclass(frozen=True)
class ChaosSettings:
    """One chaos run. `server_args` go to every `rpycdl serve` (another scheduling policy, say). The chaos
    lasts `duration` seconds, and goes on until the run has done enough (shortfall), for `deadline` seconds at
    the most: a busy machine makes fewer jobs a second."""

    duration: float = 25.0
    deadline: float = 300.0
    clients: int = 6
    servers: int = 2
    gpus: str = "fake:4"
    server_args: tuple[str, ...] = ()
    requests: tuple[dict[str, Any], ...] = REQUESTS  # run_code keywords, drawn at random
    users: int = 1  # clients connect as one of this many users (fair share orders them), unless isolation names them
    isolation: Isolation | None = None  # jobs run as their owners' accounts (servers as root, a user map, TLS)
    queue_timeout: float = 3.0
    detached: float = 0.3  # the share of requests submitted as detached jobs
    arrays: float = 0.3  # the share of those submitted as an array of `elements` (their GPUs handed element to element)
    elements: tuple[int, int] = (2, 6)
    session: float = 0.12  # the share of requests that open a session instead (and make `calls` calls in it)
    calls: tuple[int, int] = (2, 4)
    working_dir: float = 0.3  # the share of requests that bring a working directory (one of WORKING_DIRS)
    hold: tuple[float, float] = (0.02, 0.25)  # seconds a job runs
    children: tuple[int, int] = (1, 2)  # children a job starts
    kill_every: tuple[float, float] = (0.02, 0.08)  # seconds between the killer's actions
    restart_every: tuple[float, float] = (3.0, 6.0)  # seconds between server kills
    kills: tuple[tuple[str, float], ...] = tuple(KILLS.items())
    observer_nice: int = -10  # the observer's niceness; below 0 (a higher priority) only as root
    seed: int = field(default_factory=lambda: int(os.environ.get("RPYCDL_CHAOS_SEED", random.randrange(1 << 30))))

    def identities(self) -> list[str]:
        """The users clients connect as."""
        return list(self.isolation.uids) if self.isolation else [f"user{n}" for n in range(self.users)]

    def required_kills(self) -> tuple[str, ...]:
        """The kinds of kill a run must make (REQUIRED_KILLS): no spare's under isolation, whose servers use TLS and
        so keep no spare connection process."""
        return tuple(kind for kind in REQUIRED_KILLS if not (self.isolation and kind == "spare"))

    def looker(self) -> dict[str, str]:
        """rpycdl.connect() keywords of the test's own looks (gpu_status): the admin's certificate, under isolation."""
        return self.isolation.certs[self.isolation.admin] if self.isolation else {}


@dataclass(frozen=True)
class Isolation:
    """Jobs run as their owners: servers started as root with `server_args` (TLS, --user-map), clients connecting
    as the identities of `uids` (identity: the uid of its account) with `certs` (rpycdl.connect() keywords by
    identity; the test's own looks use `admin`'s). The observer checks that every process of a job runs as its
    owner's uid and that its working copy and output directory are its owner's (OwnerWatch)."""

    uids: dict[str, int]
    certs: dict[str, dict[str, str]]
    server_args: tuple[str, ...]
    admin: str = "root"


# -- /proc ----------------------------------------------------------------------------------------


class Stat(NamedTuple):
    """What /proc/PID/stat says of a process (start: clock ticks after boot, with pid its identity)."""

    state: str
    ppid: int
    pgrp: int
    start: int


def read_stat(pid: int) -> Stat | None:
    """A process's state, parent, group and start time; None once it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 1024)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = data.rpartition(b")")[2].split()
    if len(fields) < 20:
        return None
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))


def read_environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment as it exec'd (empty for kernel threads and once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return {}
    return dict(entry.partition(b"=")[::2] for entry in data.split(b"\0") if entry)


def read_comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def alive(stat: Stat | None, start: int) -> bool:
    """Whether `stat` is of the process that started at `start` and is not a zombie."""
    return stat is not None and stat.start == start and stat.state not in "ZX"


def proc_pids() -> Iterator[int]:
    return (int(name) for name in os.listdir("/proc") if name.isdigit())


def marked_job(pid: int, token: bytes) -> str | None:
    """The job id in a process's environment, if it carries this run's token too."""
    environ = read_environ(pid)
    if environ.get(TOKEN_VAR.encode()) != token:
        return None
    job = environ.get(JOB_VAR.encode())
    return job.decode() if job else None


def signal_process(pid: int, start: int, sig: int) -> bool:
    """Send `sig` to the process `pid` only if it is still the one that started at `start`."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        stat = read_stat(pid)
        if stat is None or stat.start != start:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


_FLOCK = "hhqqi4x"  # struct flock on Linux x86-64: type, whence, start, len, pid


def lock_holder(path: str | Path, start: int = 0, length: int = 0) -> int | None:
    """The pid of a process holding an fcntl lock on bytes [start, start + length) of a file
    (length 0: to its end), asked with F_GETLK, which takes nothing; None if nobody does."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
        kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    finally:
        os.close(fd)
    return None if kind == fcntl.F_UNLCK else pid


def gpu_name(uuid: str) -> str:
    """A simulated GPU's index (its UUID ends in it), else the UUID."""
    return str(int(uuid[-12:])) if uuid[-12:].isdigit() else uuid


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


# -- reports ----------------------------------------------------------------------------------------


class Report(NamedTuple):
    """What a job process says of itself before it starts anything."""

    job_id: str
    pid: int
    ppid: int
    pgrp: int
    start: int
    uuids: tuple[str, ...]
    memory: int  # bytes of its share; 0: whole GPUs
    time: float
    user: str = ""  # the identity its client connected as
    session: bool = False  # a session's process (it reports on its first call)
    client: int = 0  # the pid of its client


def read_report(path: str | Path) -> Report | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return Report(data["job_id"], data["pid"], data["ppid"], data["pgrp"], data["start"], tuple(data["uuids"]),
                  data["memory"], data["time"], data.get("user", ""), data.get("session", False), data.get("client", 0))


def read_reports(directory: Path) -> dict[str, Report]:
    reports = (read_report(path) for path in directory.glob("*.json"))
    return {report.job_id: report for report in reports if report is not None}


def take_inbox(inbox: str) -> list[Report]:
    """The reports linked into `inbox` since the last call (each is removed once read)."""
    taken = []
    for name in os.listdir(inbox):
        path = os.path.join(inbox, name)
        report = read_report(path)
        if report is not None:
            taken.append(report)
            os.unlink(path)
    return sorted(taken, key=lambda report: report.time)


# -- clients ----------------------------------------------------------------------------------------


def child_kinds(settings: ChaosSettings) -> list[str]:
    """The kinds of CHILDREN jobs start: under isolation, a Python child only where the jobs' accounts may run
    this interpreter (one under root's home, as pyenv puts it, they may not)."""
    if settings.isolation is None or open_to_all(Path(sys.executable).resolve()):
        return list(CHILDREN)
    return [kind for kind, (_, argv) in CHILDREN.items() if "{python}" not in argv]


def open_to_all(path: Path) -> bool:
    """Whether any account may run the file `path` (it and every directory above it executable by others)."""
    return all(os.stat(part).st_mode & 0o001 for part in (path, *path.parents))


def make_job() -> Callable[[dict[str, Any]], str]:
    """The job every client sends (built in a function so that dill sends its code, not a reference).

    It writes its report to args["reports"] (linked into each of args["inboxes"] first), and what it found
    of its working directory if it has one, starts args["children"] by exec, sleeps args["hold"] seconds and
    returns its job id. A session's calls run it again and again in one process: the first reports (and
    marks the session, JOB.session), the others start children and sleep."""

    def job(args: dict[str, Any]) -> str:
        import json
        import os
        import subprocess
        import sys
        import time

        job_id = os.environ["RPYCDL_JOB_ID"]
        if os.environ.get("CHAOS_REPORTED") != job_id:  # a session's first call reports, its later ones do not
            os.environ["CHAOS_REPORTED"] = job_id
            with open("/proc/self/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
            try:  # a job's attempt runs once (a preemption requeues a detached job): a second run finds its mark
                attempt = os.environ.get("RPYCDL_ATTEMPT", "1")
                os.close(os.open(os.path.join(args["reports"], f"{job_id}.{attempt}.ran"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                open(os.path.join(args["reports"], f"{job_id}.twice"), "w").close()
            report = {"job_id": job_id, "pid": os.getpid(), "ppid": int(fields[1]), "pgrp": int(fields[2]),
                      "start": int(fields[19]), "uuids": os.environ["RPYCDL_GPU_UUIDS"].split(","),
                      "memory": int(os.environ.get(args["memory_var"], 0)), "time": time.time(),
                      "user": args["user"], "session": args["session"], "client": args["client"]}
            tmp = os.path.join(args["reports"], f".{job_id}.tmp")
            with open(tmp, "w") as f:
                json.dump(report, f)
            for inbox in args["inboxes"]:
                os.link(tmp, os.path.join(inbox, f"{job_id}.json"))
            os.replace(tmp, os.path.join(args["reports"], f"{job_id}.json"))
            if args["session"]:
                open(os.path.join(args["reports"], f"{job_id}.session"), "w").close()
            if "RPYCDL_WORKING_DIR" in os.environ:  # its copy of the project, whole: what it holds goes to the test
                # written whole or not at all (renamed into place), as a job killed meanwhile leaves no half mark
                with open(tmp, "w") as mark:
                    mark.write(f"{os.path.getsize('data.bin')} {__import__('train').PROJECT}")
                os.replace(tmp, os.path.join(args["reports"], f"{job_id}.workdir"))
        for argv in args["children"]:
            subprocess.Popen([sys.executable if arg == "{python}" else arg for arg in argv], stdin=subprocess.DEVNULL)
        time.sleep(args["hold"])
        return job_id

    return job


def client_main(run_dir: str, seed: int) -> None:
    """A client process: random requests for ever (attached jobs, detached jobs, sessions of a few calls),
    connecting again whenever its connection dies."""
    import rpycdl

    die_with_parent()
    config = json.loads(Path(run_dir, "client.json").read_text())
    rng = random.Random(seed)
    job = make_job()
    conn = None
    with open(Path(run_dir, "clients", f"{os.getpid()}.log"), "a", buffering=1) as log:
        while True:
            if conn is None:
                user = rng.choice(config["identities"])
                conn = _connect(Path(run_dir, "ports.json"), rng, config["certs"].get(user, {}))
                conn.root.identify(user)  # nothing where its certificate names it
            try:
                outcome = _request(conn, job, config, rng, user, Path(run_dir, "submitted"))
            except Exception as exc:  # noqa: BLE001 - what the job or the server said, or its connection died
                outcome = type(exc).__name__
                if isinstance(exc, rpycdl.ConnectionFailedError | rpycdl.ServerStoppingError) or not isinstance(
                        exc, rpycdl.RpycdlError):
                    with contextlib.suppress(Exception):  # its connection process or server died: connect again
                        conn.close()
                    conn = None
            if conn is not None and conn.closed:
                conn = None
            log.write(f"{outcome}\n")


def _request(conn: Any, job: Callable[[dict[str, Any]], str], config: dict[str, Any], rng: random.Random, user: str,
             submitted: Path) -> str:
    """One random request of a client: a session of a few calls, a detached job, or an attached one; its outcome."""
    request = {"queue_timeout": config["queue_timeout"], **rng.choice(config["requests"])}
    if rng.random() < config["working_dir"]:
        request["working_dir"] = rng.choice(config["working_dirs"])
    roll = rng.random()
    if roll < config["session"]:
        with conn.root.session(**request) as session:
            for _ in range(rng.randint(*config["calls"])):
                session.run(job, _job_args(config, rng, user, session=True))
        return "session ok"
    if roll < config["session"] + config["detached"] and rng.random() < config["arrays"]:
        array = conn.root.submit_array(job, [_job_args(config, rng, user)
                                             for _ in range(rng.randint(*config["elements"]))], **request)
        for element in array:
            (submitted / element.id).touch()  # its id came back: it must end recorded
        return f"array {array.wait(config['queue_timeout'] + 10)}"
    if roll < config["session"] + config["detached"]:
        handle = conn.root.submit(job, _job_args(config, rng, user), **request)
        (submitted / handle.id).touch()  # its id came back: it must end recorded
        return f"detached {handle.wait(config['queue_timeout'] + 5).state.value}"
    conn.root.run_code(job, _job_args(config, rng, user), **request)
    return "ok"


WORKING_DIRS = 3
"""Working directories the clients choose from: each is sent once per server's cache, then named."""


def make_working_dirs(root: Path) -> list[str]:
    """The working directories a run's clients send: a module and 1 MiB of data each."""
    made = []
    for number in range(WORKING_DIRS):
        made.append(str(root / f"project{number}"))
        Path(made[-1]).mkdir(parents=True)
        Path(made[-1], "train.py").write_text(f"PROJECT = {number}\n")
        Path(made[-1], "data.bin").write_bytes(os.urandom(2**20))
    return made


def _job_args(config: dict[str, Any], rng: random.Random, user: str, session: bool = False) -> dict[str, Any]:
    """The arguments of one job (or session call): where it reports, how long it runs, which children it starts,
    who sent it."""
    kinds = config["child_kinds"]
    chosen = rng.choices(kinds, [CHILDREN[kind][0] for kind in kinds], k=rng.randint(*config["children"]))
    return {"reports": config["reports"], "inboxes": config["inboxes"], "memory_var": config["memory_var"],
            "hold": rng.uniform(*config["hold"]), "children": [CHILDREN[kind][1] for kind in chosen], "user": user,
            "session": session, "client": os.getpid()}


def _connect(ports_file: Path, rng: random.Random, credentials: dict[str, str]) -> Any:
    """Connect to one of the servers the ports file lists now (with `credentials`, rpycdl.connect() keywords),
    trying until one answers."""
    import rpycdl

    while True:
        with contextlib.suppress(OSError, ValueError):
            ports = json.loads(ports_file.read_text())
            if ports:
                with contextlib.suppress(OSError, EOFError, rpycdl.RpycdlError):
                    return rpycdl.connect(host="127.0.0.1", port=rng.choice(ports), **credentials)
        time.sleep(0.05)


# -- observer ---------------------------------------------------------------------------------------


class _Seen:
    """A process the observer knows: its identity, group, job mark and the job it belongs to."""

    __slots__ = ("start", "pgrp", "mark", "job")

    def __init__(self, start: int, pgrp: int, mark: str | None) -> None:
        self.start, self.pgrp, self.mark = start, pgrp, mark
        self.job: str | None = None


class ReleaseWatch:
    """Promise 3 while the chaos runs: a job's grant ends within GRACE of its last live process.

    A job's grant lasts while a record in the lock directory's held/ names the job and the process
    that holds it (the record's owner: an attached job's connection process, a detached job's
    supervisor; not the job process's parent, which is the job forkserver for an attached job) is
    alive and has not gone on to a later job. Past GRACE, a probe of the record's range of the GPU's
    lock file must find that very process holding it before the job counts as late."""

    CHECK_EVERY = 0.01  # seconds between looks at held/

    def __init__(self, lock_dir: str) -> None:
        self.lock_dir = Path(lock_dir)
        self.records: dict[str, dict[str, Any]] = {}  # held/ file name -> record (never rewritten)
        self.conns: dict[str, tuple[int, int, float]] = {}  # unresolved job -> its grant's owner (pid, start, time)
        self.ended: dict[str, float] = {}  # unresolved job -> when none of its processes was seen alive
        self.finished: dict[str, float] = {}  # resolved job -> the same
        self.latencies = array("d")  # seconds from a job's end to its grant's end, within CHECK_EVERY
        self.late: dict[str, dict[str, Any]] = {}
        self._next = 0.0

    def reported(self, report: Report) -> None:
        """A job that runs: the owner of its grant, as its held/ records (made before it ran) name it."""
        owners = [record.get("owner") for record in self._holding().get(report.job_id, [])]
        pid, start = next((owner for owner in owners if owner), (0, 0))  # none: its grant has ended already
        self.conns[report.job_id] = (pid, start, report.time)

    def step(self, live_jobs: set[str], zombies: Callable[[str], list[str]]) -> None:
        now = time.time()
        for job in self.conns:
            if job in live_jobs:
                self.ended.pop(job, None)
            else:
                self.ended.setdefault(job, now)
        if now < self._next:
            return
        self._next = now + self.CHECK_EVERY
        holding = self._holding()
        for job, ended in list(self.ended.items()):
            records = holding.get(job, [])
            if not records or self._moved_on(job):
                self._resolve(job, now - ended)
            elif now - ended > GRACE:
                self._late(job, records, ended, now, zombies)

    def _holding(self) -> dict[str, list[dict[str, Any]]]:
        """The held/ records, by job."""
        holding: dict[str, list[dict[str, Any]]] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.lock_dir / "held"):
                if name.endswith(".json") and name not in self.records:
                    with contextlib.suppress(OSError, ValueError):
                        self.records[name] = {**json.loads((self.lock_dir / "held" / name).read_text()),
                                              "gpu": name.rpartition(".json")[0].rpartition(".")[0]}
                record = self.records.get(name)
                if record is not None:
                    holding.setdefault(record.get("job_id", ""), []).append(record)
        return holding

    def _moved_on(self, job: str) -> bool:
        """Whether the job's connection process is gone (the kernel freed its locks) or ran a later job."""
        pid, start, since = self.conns[job]
        if not alive(read_stat(pid), start):
            return True
        return any(other[0] == pid and other[1] == start and other[2] > since for other in self.conns.values())

    def _resolve(self, job: str, latency: float) -> None:
        self.latencies.append(latency)
        del self.conns[job]
        self.finished[job] = self.ended.pop(job)
        if job in self.late:
            self.late[job]["released_after"] = latency

    def _late(self, job: str, records: list[dict[str, Any]], ended: float, now: float,
              zombies: Callable[[str], list[str]]) -> None:
        """Record the job as late if a probe finds its connection process still locking its GPUs."""
        pid = self.conns[job][0]
        locked = []
        for record in records:
            path = self.lock_dir / "gpus" / f"{record['gpu']}.lock"
            ranges = record.get("ranges") or [[0, 0]]
            if any(lock_holder(path, start, length) == pid for start, length in ranges):
                locked.append(record["gpu"])
        if not locked:
            return
        entry = self.late.setdefault(job, {"job": job, "gpus": locked, "conn": pid, "ended": ended,
                                           "conn_comm": read_comm(pid), "zombies": zombies(job)})
        entry["held_after"] = now - ended


def read_uids(pid: int) -> tuple[int, ...] | None:
    """A process's real, effective, saved and filesystem uids (/proc/PID/status); None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return tuple(int(uid) for uid in line.split()[1:])
    except (OSError, ValueError):
        return None
    return None


class OwnerWatch:
    """Under isolation (issue 26), from outside: every process of a job runs as its owner's account (all four
    uids of /proc/PID/status), and its working copy and output directory on the server, with all in them, are
    its owner's. Its owner is the identity its client connected as (the report says it; the end check holds the
    ledger's row to it)."""

    def __init__(self, uids: dict[str, int], jobs_dir: Path) -> None:
        self.uids, self.jobs_dir = uids, jobs_dir
        self.processes = self.files = 0  # how many were checked
        self.wrong: list[str] = []

    def process(self, pid: int, start: int, report: Report) -> None:
        """Check the process `pid` that started at `start` (not one that took its pid since)."""
        found, want = read_uids(pid), self.uids.get(report.user)
        stat = read_stat(pid)  # after its uids: both of one process
        if found is None or stat is None or stat.start != start:
            return
        self.processes += 1
        if any(uid != want for uid in found):
            self.wrong.append(f"process {pid} ({read_comm(pid)}) of job {report.job_id} of {report.user} runs as "
                              f"uids {found}, not {want}")

    def job_files(self, report: Report) -> None:
        """Check the job's working copy and output directory (those still there: a job may be gone already)."""
        want = self.uids.get(report.user)
        for sub in ("work", "output"):
            for root, dirs, files in os.walk(self.jobs_dir / report.job_id / sub):
                for name in (".", *dirs, *files):
                    path = os.path.normpath(os.path.join(root, name))
                    try:
                        owner = os.lstat(path).st_uid
                    except OSError:
                        continue
                    self.files += 1
                    if owner != want:
                        self.wrong.append(f"{path} of job {report.job_id} of {report.user} "
                                          f"belongs to uid {owner}, not {want}")

    def summary(self) -> dict[str, Any]:
        return {"processes": self.processes, "files": self.files, "wrong": self.wrong[:20],
                "wrong_count": len(self.wrong)}


class Observer:
    """Watches /proc for live processes of two jobs on one GPU beyond what the GPU allows, and for
    grants that outlive their job by more than GRACE (ReleaseWatch).

    A process belongs to a job if it is the job process that reported (same pid and start time),
    carries the job's RPYCDL_JOB_ID and this run's token in /proc/PID/environ, or lives in the job
    process's group. Zombies do not count. A GPU is over-committed when live processes of two jobs
    use it and one job has it whole, or their shares add up to more than its memory. Before that
    counts, the processes involved are read again: one still alive then was alive when the last of
    them was seen, so all lived at one instant (a process that died during the scan, its pid given
    to another, does not count)."""

    def __init__(self, inbox: str, token: str, lock_dir: str, shared_mark: str | None = None,
                 owners: OwnerWatch | None = None) -> None:
        self.inbox = inbox
        self.owners = owners
        self.shared_mark = shared_mark  # a file made once two jobs were seen sharing a GPU (for the killer)
        self.token = token.encode()
        self.jobs: dict[str, Report] = {}
        self.by_pid: dict[int, list[Report]] = {}  # a job process's reports (several if its pid was reused)
        self.seen: dict[int, _Seen] = {}
        self.releases = ReleaseWatch(lock_dir)
        self.violations: dict[tuple[str, frozenset[str]], dict[str, Any]] = {}
        self.periods = array("d")
        self.shared_at_once = 0  # loops in which two jobs shared one GPU within its memory
        self.most_processes = 0

    def run(self, stop: Callable[[], bool], ready: Callable[[], None]) -> None:
        self.step()
        ready()
        last = time.monotonic()
        while not stop():
            self.step()
            now = time.monotonic()
            self.periods.append(now - last)
            last = now

    def step(self) -> None:
        """One look at every process: which jobs' processes live, and on which GPUs. A process's
        environment is read once (its pid and start time are its identity), and whom a process
        belongs to is asked again only when a job has reported since: only a report can change it."""
        reports = take_inbox(self.inbox)
        for report in reports:
            self.jobs[report.job_id] = report
            self.by_pid.setdefault(report.pid, []).append(report)
            self.releases.reported(report)
            if self.owners is not None:
                self.owners.job_files(report)
        live: list[tuple[str, int, int]] = []  # (job, pid, order seen)
        present = set()
        for pid in proc_pids():
            present.add(pid)
            seen, stat = self.seen.get(pid), None
            if seen is None:
                stat = read_stat(pid)
                if stat is None:
                    continue
                seen = self.seen[pid] = _Seen(stat.start, stat.pgrp, marked_job(pid, self.token))
                self._attribute(pid, seen)
            elif seen.job is None and reports:
                self._attribute(pid, seen)
            if seen.job is None:
                continue
            stat = stat or read_stat(pid)
            if stat is None or stat.start != seen.start:
                del self.seen[pid]  # gone, or a new process with its pid: seen afresh next time
            elif stat.state not in "ZX":
                live.append((seen.job, pid, len(live)))
        for pid in self.seen.keys() - present:
            del self.seen[pid]
        self.most_processes = max(self.most_processes, len(live))
        self._check(live)
        self.releases.step({job for job, _, _ in live}, self._zombies)

    def _attribute(self, pid: int, seen: _Seen) -> None:
        """Find the job a process belongs to (and, under isolation, check that it runs as the job's owner)."""
        seen.job = self._owner(pid, seen)
        if seen.job is not None and self.owners is not None:
            self.owners.process(pid, seen.start, self.jobs[seen.job])

    def _zombies(self, job: str) -> list[str]:
        """The job's processes that are dead but not reaped, with their parents."""
        found = []
        for pid, seen in list(self.seen.items()):
            stat = read_stat(pid) if seen.job == job else None
            if stat is not None and stat.state == "Z":
                found.append(f"{pid} (parent {stat.ppid} {read_comm(stat.ppid)})")
        return found

    def _owner(self, pid: int, seen: _Seen) -> str | None:
        """The job a process belongs to: the job process itself, a process marked with the job's id,
        or one in the job process's group."""
        for report in self.by_pid.get(pid, ()):
            if report.start == seen.start:
                return report.job_id
        if seen.mark in self.jobs:
            return seen.mark
        leaders = [r for r in self.by_pid.get(seen.pgrp, ()) if r.pgrp == r.pid and r.start <= seen.start]
        return max(leaders, key=lambda r: r.start).job_id if leaders else None

    def _check(self, live: list[tuple[str, int, int]]) -> None:
        by_gpu: dict[str, dict[str, list[tuple[int, int]]]] = {}
        for job, pid, order in live:
            for gpu in self.jobs[job].uuids:
                by_gpu.setdefault(gpu, {}).setdefault(job, []).append((pid, order))
        for gpu, users in by_gpu.items():
            if len(users) < 2:
                continue
            if self._over(users):
                self._confirm(gpu, users)
            else:
                if not self.shared_at_once and self.shared_mark:
                    Path(self.shared_mark).touch()
                self.shared_at_once += 1

    def _over(self, users: dict[str, Any]) -> bool:
        memory = [self.jobs[job].memory for job in users]
        return 0 in memory or sum(memory) > GPU_MEMORY

    def _confirm(self, gpu: str, users: dict[str, list[tuple[int, int]]]) -> None:
        """Keep the processes that lived at one instant: the one seen last, and those still alive now."""
        seen = [(order, pid, job) for job, entries in users.items() for pid, order in entries]
        last = max(seen)
        kept: dict[str, list[int]] = {}
        for order, pid, job in seen:
            entry = self.seen.get(pid)
            if (order, pid, job) == last or (entry is not None and alive(read_stat(pid), entry.start)):
                kept.setdefault(job, []).append(pid)
        if len(kept) > 1 and self._over(kept):
            self._record(gpu, kept)

    def _record(self, gpu: str, users: dict[str, list[int]]) -> None:
        key = (gpu, frozenset(users))
        now = time.time()
        violation = self.violations.get(key)
        if violation is None:
            violation = self.violations[key] = {"gpu": gpu, "first": now, "loops": 0, "jobs": {}}
        violation["last"] = now
        violation["loops"] += 1
        for job, pids in users.items():
            entry = violation["jobs"].setdefault(job, {"memory": self.jobs[job].memory, "granted": self.jobs[job].time,
                                                       "job_pid": self.jobs[job].pid, "pids": {}})
            for pid in pids:
                if str(pid) not in entry["pids"]:
                    entry["pids"][str(pid)] = read_comm(pid)

    def summary(self) -> dict[str, Any]:
        periods = sorted(self.periods)

        def at(fraction: float) -> float:
            return periods[min(len(periods) - 1, int(fraction * len(periods)))] * 1000 if periods else 0.0

        latencies = sorted(self.releases.latencies)
        return {"loops": len(periods), "period_ms": {"mean": sum(periods) / len(periods) * 1000 if periods else 0.0,
                                                       "p50": at(0.5), "p99": at(0.99), "max": at(1.0)},
                "jobs": len(self.jobs), "shared_at_once": self.shared_at_once,
                "most_processes": self.most_processes,
                "release_s": {"count": len(latencies), "max": latencies[-1] if latencies else 0.0,
                              "p99": latencies[int(0.99 * len(latencies))] if latencies else 0.0},
                "violations": sorted(self.violations.values(), key=lambda v: v["first"]),
                "late_releases": sorted(self.releases.late.values(), key=lambda v: v["ended"]),
                "ended": {**self.releases.finished, **self.releases.ended},
                "owners": self.owners.summary() if self.owners is not None else {}}


def observe_main(run_dir: str, token: str, lock_dir: str, nice: int) -> None:
    """The observer process: loops until SIGTERM, then writes observer.json."""
    die_with_parent()
    # A higher priority than the servers and jobs it watches (nice -10 by default), so that on a few
    # loaded cores they delay its looks less; only root may take one, anyone else looks at nice 0.
    if nice and (nice > 0 or os.geteuid() == 0):
        os.nice(nice)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    owners = None
    with contextlib.suppress(FileNotFoundError):  # under isolation: the uid of each identity's account
        owners = OwnerWatch(json.loads(Path(run_dir, "owners.json").read_text()), Path(lock_dir, "state", "jobs"))
    observer = Observer(str(Path(run_dir, "inbox-observer")), token, lock_dir, str(Path(run_dir, "observer.shared")),
                        owners)
    observer.run(stopping.is_set, lambda: Path(run_dir, "observer.ready").touch())
    out = Path(run_dir, "observer.json")
    out.with_suffix(".tmp").write_text(json.dumps(observer.summary()))
    out.with_suffix(".tmp").replace(out)


# -- servers and clients ---------------------------------------------------------------------------


@dataclass
class Server:
    process: Any  # rpycdl.site.local.Process
    port: int
    server_id: str
    started: float
    killed: float | None = None


class Servers:
    """The run's servers, all on the cluster's lock directory, their ports in a file the clients reread."""

    def __init__(self, cluster: Any, ports_file: Path, settings: ChaosSettings) -> None:
        self.cluster = cluster
        self.ports_file = ports_file
        self.settings = settings
        self.live: list[Server] = []
        self.killed: list[Server] = []
        self._lock = threading.Lock()
        self._restart: threading.Thread | None = None

    def start(self) -> Server:
        import rpycdl

        isolation = self.settings.isolation
        process, port = self.cluster.add_server("pytorch", self.settings.gpus, *self.settings.server_args,
                                                *(isolation.server_args if isolation else ()), isolated=bool(isolation))
        with rpycdl.connect(host="127.0.0.1", port=port, **self.settings.looker()) as conn:
            server_id = conn.root.gpu_status()["server"]["server_id"]
        server = Server(process, port, server_id, time.time())
        with self._lock:
            self.live.append(server)
            self._write_ports()
        return server

    def kill_and_restart(self, rng: random.Random) -> bool:
        """kill -9 a server parent and start another in the background (one restart at a time)."""
        if self.restarting or not self.live:
            return False
        with self._lock:
            server = self.live.pop(rng.randrange(len(self.live)))
            self._write_ports()
        server.process.popen.kill()
        server.killed = time.time()
        server.process.popen.wait()
        self.killed.append(server)
        self._restart = threading.Thread(target=self.start, daemon=True)
        self._restart.start()
        return True

    @property
    def restarting(self) -> bool:
        return self._restart is not None and self._restart.is_alive()

    def wait_restarts(self) -> None:
        if self._restart is not None:
            self._restart.join(60)

    def parent_pids(self) -> set[int]:
        return {server.process.popen.pid for server in self.live}

    def _write_ports(self) -> None:
        tmp = self.ports_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([server.port for server in self.live]))
        tmp.replace(self.ports_file)


class Clients:
    """Client processes (`python chaos.py client`), each with a seed of its own."""

    def __init__(self, run_dir: Path, seed: int) -> None:
        self.run_dir = run_dir
        self.rng = random.Random(seed)
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        argv = [sys.executable, str(HERE), "client", str(self.run_dir), str(self.rng.randrange(1 << 30))]
        with open(self.run_dir / "clients" / "stderr.log", "ab") as stderr:
            self.processes.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                   stderr=stderr))

    def kill_one(self, pid: int | None = None) -> int:
        """kill -9 a live client (the one of `pid`, if given and still live), and start another; the pid killed
        (0: none)."""
        live = [p for p in self.processes if p.poll() is None and pid in (None, p.pid)]
        if not live:
            return 0
        victim = self.rng.choice(live)
        victim.kill()
        victim.wait()
        self.start()
        return victim.pid

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()

    def outcomes(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for log in (self.run_dir / "clients").glob("*.log"):
            if log.name != "stderr.log":
                counts.update(line.strip() for line in log.read_text().splitlines() if line.strip())
        return counts


class StatusWatch:
    """Asks a live server for gpu_status every INTERVAL seconds: which jobs hold which GPUs, by the
    servers' own account (which counts a dead holder's grant while its job's processes linger)."""

    INTERVAL = 0.05

    def __init__(self, servers: Servers) -> None:
        self.servers = servers
        self.samples: list[tuple[float, dict[str, list[str]]]] = []  # (when asked, {job: GPUs held})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        import rpycdl

        conn = None
        while not self._stop.wait(self.INTERVAL):
            try:
                conn = conn or rpycdl.connect(host="127.0.0.1", port=random.choice(self.servers.live).port,
                                              **self.servers.settings.looker())
                asked = time.time()
                holders: dict[str, list[str]] = {}
                for gpu in conn.root.gpu_status()["gpus"]:
                    for holder in gpu["holders"]:
                        holders.setdefault(holder["job_id"], []).append(gpu["uuid"])
                self.samples.append((asked, holders))
            except Exception:  # noqa: BLE001 - its server or connection process was killed: ask another
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None

    def late(self, ended: dict[str, float]) -> list[dict[str, Any]]:
        """Jobs still named as holders in two looks asked more than GRACE after their last process ended."""
        looks: dict[str, list[tuple[float, list[str]]]] = {}
        for asked, holders in self.samples:
            for job, gpus in holders.items():
                if job in ended and asked > ended[job] + GRACE:
                    looks.setdefault(job, []).append((asked, gpus))
        return [{"job": job, "ended": ended[job], "gpus": seen[0][1], "first": seen[0][0], "last": seen[-1][0],
                 "looks": len(seen)} for job, seen in looks.items() if len(seen) > 1]


# -- killer -----------------------------------------------------------------------------------------


@dataclass
class Kill:
    time: float
    kind: str
    pid: int
    job: str = ""
    note: str = ""  # for a connection process: what the job's record said right after the kill


class Killer:
    """Kills at random every few tens of ms; counts and logs what it killed."""

    def __init__(self, run_dir: Path, lock_dir: Path, token: str, servers: Servers, clients: Clients,
                 settings: ChaosSettings, rng: random.Random) -> None:
        self.inbox = str(run_dir / "inbox-killer")
        self.lock_dir = lock_dir
        self.token = token.encode()
        self.servers, self.clients, self.settings, self.rng = servers, clients, settings, rng
        self.running: dict[str, Report] = {}  # jobs whose job process was alive at the last look
        self.kills: Counter[str] = Counter()
        self.log: list[Kill] = []
        self._actions: dict[str, Callable[[], int]] = {
            "conn_after_grant": self._conn_after_grant, "conn": self._conn, "orphan_conn": self._orphan_conn,
            "job": self._job, "children_kill": lambda: self._children(signal.SIGKILL, "children_kill"),
            "children_term": lambda: self._children(signal.SIGTERM, "children_term"), "client": self._client,
            "supervisor": self._supervisor, "session_process": self._session_process,
            "session_conn": self._session_conn, "session_client": self._session_client,
            "forkserver": self._forkserver, "spare": self._spare, "keeper": self._keeper}

    def run(self, least: float, enough: Callable[[], bool], deadline: float) -> None:
        """Kill until `least` (a time.monotonic()), then on until enough() or `deadline`."""
        kinds = [kind for kind, _ in self.settings.kills]
        weights = [weight for _, weight in self.settings.kills]
        halfway = (time.monotonic() + least) / 2
        next_restart = time.monotonic() + self.rng.uniform(*self.settings.restart_every)
        while time.monotonic() < least or (time.monotonic() < deadline and not enough()):
            time.sleep(self.rng.uniform(*self.settings.kill_every))
            self._fresh()
            if time.monotonic() >= next_restart:
                forkservers = {pid: self._forkserver_of(pid) for pid in self.servers.parent_pids()}
                if self.servers.kill_and_restart(self.rng):
                    killed = self.servers.killed[-1].process.popen.pid
                    self._note("server", killed)
                    self._double_fault(forkservers.get(killed, 0))
                    next_restart = time.monotonic() + self.rng.uniform(*self.settings.restart_every)
                    continue
            required = self.settings.required_kills()
            untried = [kind for kind in required if kind in self._actions and not self.kills[kind]]
            if untried and time.monotonic() >= halfway:  # a short run still tries every kind it must
                self._actions[self.rng.choice(untried)]()
            self._actions[self.rng.choices(kinds, weights)[0]]()

    def _fresh(self) -> list[Report]:
        reports = take_inbox(self.inbox)
        self.running.update((report.job_id, report) for report in reports)
        return reports

    def _note(self, kind: str, pid: int, job: str = "", note: str = "") -> int:
        self.kills[kind] += 1
        self.log.append(Kill(time.time(), kind, pid, job, note))
        return 1

    def _running(self) -> list[Report]:
        """Jobs whose job process still runs."""
        for job, report in list(self.running.items()):
            if not alive(read_stat(report.pid), report.start):
                del self.running[job]
        return list(self.running.values())

    def _conn_after_grant(self) -> int:
        """Wait for a job that has just been granted its GPUs; kill its connection process as soon as
        the job process has a child."""
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            fresh = [r for r in self._fresh() if time.time() - r.time < 0.01]
            if fresh:
                report = fresh[-1]
                until = time.monotonic() + 0.05
                while not child_pids(report.pid) and time.monotonic() < until:
                    time.sleep(0.0002)
                return self._kill_conn(report, "conn_after_grant")
            time.sleep(0.001)
        return 0

    def _conn(self) -> int:
        running = self._running()
        return self._kill_conn(self.rng.choice(running), "conn") if running else 0

    def _orphan_conn(self) -> int:
        """The connection process of a running job whose server parent was killed."""
        servers = self.servers.parent_pids()
        owners = self._owners()
        orphans = []
        for report in self._running():
            owner = owners.get(report.job_id)
            conn = read_stat(owner[0]) if owner else None
            if conn is not None and read_comm(owner[0]) == "rpycdl-conn" and conn.ppid not in servers:
                orphans.append(report)
        return self._kill_conn(self.rng.choice(orphans), "orphan_conn") if orphans else 0

    def _supervisor(self) -> int:
        """The supervisor of a running detached job."""
        owners = self._owners()
        running = [r for r in self._running() if read_comm(owners.get(r.job_id, (0, 0))[0]) == "rpycdl-superv"]
        return self._kill_conn(self.rng.choice(running), "supervisor") if running else 0

    def _owners(self) -> dict[str, tuple[int, int]]:
        """The owner of every unfinished job, by its row: an attached job's connection process, a detached job's
        supervisor (an attached job process's parent is the job forkserver, not its connection process)."""
        return {row["job_id"]: (row["owner_pid"], row["owner_start"]) for row in ledger_rows(self.lock_dir, LIVE)}

    def _kill_conn(self, report: Report, kind: str) -> int:
        """kill -9 the owner of a running job, if that is still a connection process (or, for the kind
        "supervisor", a detached job's supervisor) of this run."""
        if not alive(read_stat(report.pid), report.start):
            return 0
        rows = ledger_rows(self.lock_dir, "job_id = ?", (report.job_id,))
        pid, start = (rows[0]["owner_pid"], rows[0]["owner_start"]) if rows else (0, 0)
        if read_comm(pid) != ("rpycdl-superv" if kind == "supervisor" else "rpycdl-conn") or \
                not signal_process(pid, start, signal.SIGKILL):
            return 0
        return self._note(kind, pid, report.job_id, self._record(report.job_id))

    def _record(self, job: str) -> str:
        """What the job's row in the ledger says of it: its state and process group."""
        rows = ledger_rows(self.lock_dir, "job_id = ?", (job,))
        return f"record {rows[0]['state']}, group {rows[0]['pgid']}" if rows else "no record"

    def _job(self) -> int:
        return self._kill_job(self._running(), "job")

    def _kill_job(self, running: list[Report], kind: str) -> int:
        """kill -9 the job process of one of `running`."""
        if not running:
            return 0
        report = self.rng.choice(running)
        return self._note(kind, report.pid, report.job_id) if signal_process(
            report.pid, report.start, signal.SIGKILL) else 0

    def _children(self, sig: int, kind: str) -> int:
        """Signal some of one job's children and grandchildren (found by their environment)."""
        by_job: dict[str, list[tuple[int, int]]] = {}
        for pid in proc_pids():
            job = marked_job(pid, self.token)
            stat = read_stat(pid) if job else None
            if job and stat and stat.state not in "ZX":
                by_job.setdefault(job, []).append((pid, stat.start))
        if not by_job:
            return 0
        job, processes = self.rng.choice(sorted(by_job.items()))
        done = 0
        for pid, start in self.rng.sample(processes, self.rng.randint(1, len(processes))):
            if signal_process(pid, start, sig):
                done += self._note(kind, pid, job)
        return done

    def _client(self) -> int:
        pid = self.clients.kill_one()
        return self._note("client", pid) if pid else 0

    @staticmethod
    def _forkserver_of(server: int) -> int:
        return next((pid for pid in child_pids(server) if read_comm(pid) == "rpycdl-forksrv"), 0)

    def _forkserver(self) -> int:
        """kill -9 the job forkserver of a live server."""
        found = [pid for pid in map(self._forkserver_of, sorted(self.servers.parent_pids())) if pid]
        return self._kill_shared(found, "forkserver")

    def _spare(self) -> int:
        """kill -9 a spare connection process of a live server."""
        found = [pid for server in sorted(self.servers.parent_pids()) for pid in child_pids(server)
                 if read_comm(pid) == "rpycdl-spare"]
        return self._kill_shared(found, "spare")

    def _kill_shared(self, found: list[int], kind: str) -> int:
        if not found:
            return 0
        pid = self.rng.choice(found)
        stat = read_stat(pid)
        return self._note(kind, pid) if stat and signal_process(pid, stat.start, signal.SIGKILL) else 0

    def _kept(self, forkserver: int = 0) -> list[Report]:
        """The running attached jobs and sessions (their job process's parent is a keeper), those whose keeper the
        `forkserver` forked if given."""
        return [report for report in self._running() if read_comm(report.ppid) == "rpycdl-keeper" and (
            not forkserver or getattr(read_stat(report.ppid), "ppid", 0) == forkserver)]

    def _keeper(self, kind: str = "keeper", forkserver: int = 0) -> int:
        """kill -9 the keeper of a running attached job or session (its job process's parent)."""
        return self._kill_parent(self._kept(forkserver), kind)

    def _kill_parent(self, running: list[Report], kind: str) -> int:
        """kill -9 the job process's parent (its keeper, or a detached job's supervisor) of one of `running`."""
        if not running:
            return 0
        report = self.rng.choice(running)
        stat = read_stat(report.ppid)
        if stat is None or not signal_process(report.ppid, stat.start, signal.SIGKILL):
            return 0
        return self._note(kind, report.ppid, report.job_id)

    def _double_fault(self, forkserver: int) -> None:
        """Right after a server parent's kill: kill -9 its orphaned `forkserver`, or the keeper (a detached job's:
        its supervisor) or job process of a running job, one it forked if it has any: a double fault of
        DOUBLE_FAULTS, the one made least so far that finds something to kill within DOUBLE_FAULT_PATIENCE."""
        def running() -> list[Report]:
            fresh = self._kept(forkserver)
            return fresh or [report for report in self._running() if read_comm(report.ppid) in (
                "rpycdl-keeper", "rpycdl-superv")]

        actions = {"double_forkserver": lambda: self._kill_shared([forkserver] if forkserver else [],
                                                                  "double_forkserver"),
                   "double_keeper": lambda: self._kill_parent(running(), "double_keeper"),
                   "double_job": lambda: self._kill_job(running(), "double_job")}
        deadline = time.monotonic() + DOUBLE_FAULT_PATIENCE
        while time.monotonic() < deadline:
            self._fresh()
            for kind in sorted(DOUBLE_FAULTS, key=lambda each: (self.kills[each], self.rng.random())):
                if actions[kind]():
                    return
            time.sleep(0.02)

    def _sessions(self) -> list[Report]:
        """Sessions whose process still runs."""
        return [report for report in self._running() if report.session]

    def _session_process(self) -> int:
        return self._kill_job(self._sessions(), "session_process")

    def _session_conn(self) -> int:
        sessions = self._sessions()
        return self._kill_conn(self.rng.choice(sessions), "session_conn") if sessions else 0

    def _session_client(self) -> int:
        """kill -9 the client of a running session (and start another client)."""
        sessions = self._sessions()
        if not sessions:
            return 0
        report = self.rng.choice(sessions)
        return self._note("session_client", report.client, report.job_id) if self.clients.kill_one(
            report.client) else 0


# -- the end check ---------------------------------------------------------------------------------


def locked_gpus(lock_dir: Path) -> list[str]:
    """GPU lock files on which some process holds an fcntl lock."""
    held = []
    for path in sorted((lock_dir / "gpus").glob("*.lock")):
        pid = lock_holder(path)
        if pid is not None:
            held.append(f"{path.stem} locked by pid {pid} ({read_comm(pid) or 'gone'})")
    return held


def job_processes(reports: dict[str, Report], token: bytes) -> dict[str, list[str]]:
    """Live processes of the run's jobs, by job: job processes, processes marked with a job id, members
    of a job process's group."""
    leaders = {(r.pid, r.start): r.job_id for r in reports.values()}
    groups = {r.pgrp: r for r in reports.values() if r.pgrp == r.pid}
    found: dict[str, list[str]] = {}
    for pid in proc_pids():
        stat = read_stat(pid)
        if stat is None or stat.state in "ZX" or pid == os.getpid():
            continue
        job = leaders.get((pid, stat.start)) or marked_job(pid, token)
        leader = groups.get(stat.pgrp)
        if job is None and leader is not None and leader.start <= stat.start:
            job = leader.job_id
        if job is not None:
            found.setdefault(job, []).append(f"{pid} {read_comm(pid)} of job {job}")
    return found


def ledger_rows(lock_dir: Path, where: str = "1", params: tuple[Any, ...] = (), table: str = "jobs",
                ) -> list[dict[str, Any]]:
    """Rows of the job ledger (its `table`: jobs, arrays, preemptions), read as an outsider (SQLite, read-only)."""
    ledger = lock_dir / "state" / "ledger.sqlite3"
    if not ledger.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=10)) as db:
        db.row_factory = sqlite3.Row
        key = "array_id" if table == "arrays" else "job_id"
        return [dict(row) for row in db.execute(f"SELECT * FROM {table} WHERE {where} ORDER BY {key}", params)]


LIVE = "state IN ('PENDING', 'RUNNING')"
"""The ledger's rows of jobs that have not ended."""


def describe_row(row: dict[str, Any]) -> str:
    return (f"{row['job_id']} {row['state']} (server {row['server_id']}, owner process {row['owner_pid']}, group "
            f"{row['pgid']})")


def live_records(lock_dir: Path) -> list[str]:
    """Rows of the job ledger that still say PENDING or RUNNING."""
    return [describe_row(row) for row in ledger_rows(lock_dir, LIVE)]


LEFTOVER_KINDS = ("holders", "queue", "locked", "processes", "records", "held_files", "queue_files", "job_files",
                  "cgroups")


def job_files_leftovers(lock_dir: Path) -> list[str]:
    """What the state directory keeps of jobs that ended, or never were recorded: a job directory
    without a row, a working or output directory of an ended job (chaos jobs leave no outputs), a
    mark of files made before a row (jobs/.unrecorded) whose maker is dead."""
    jobs = lock_dir / "state" / "jobs"
    rows = {row["job_id"]: row for row in ledger_rows(lock_dir)}  # read before the files they judge
    arrays = {row["array_id"] for row in ledger_rows(lock_dir, table="arrays")}
    unfinished = {row["array_id"] for row in rows.values() if row["state"] in ("PENDING", "RUNNING")}
    found = []
    for entry in sorted(jobs.iterdir()) if jobs.is_dir() else ():
        row = rows.get(entry.name)
        if entry.name in arrays:  # an array's own files: its spec stays, what its elements share goes with the last
            if entry.name not in unfinished:
                found += [f"{entry.name}/{name} of an array whose elements all ended" for name in (
                    "payload", "result.key", "work") if (entry / name).exists()]
                found += [f"{entry.name}/{name} of an array whose elements all ended, not emptied" for name in (
                    "args", "args.index") if (entry / name).exists() and (entry / name).stat().st_size]
        elif entry.name.isalnum() and row is None:
            maker = jobs / ".unrecorded" / entry.name
            with contextlib.suppress(OSError, ValueError):
                pid, start = map(int, maker.read_text().split())
                if alive(read_stat(pid), start):
                    continue  # being made; its row comes
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a sweep's remove_unrecorded): none left
                found.append(f"{entry.name}/ without a row: {sorted(os.listdir(entry))}")
        elif row is not None and row["state"] not in ("PENDING", "RUNNING"):
            found += [f"{entry.name}/{name} of a job {row['state']}" for name in ("work", "output")
                      if (entry / name).exists()]
    for mark in sorted((jobs / ".unrecorded").glob("[!.]*")):
        with contextlib.suppress(OSError, ValueError):
            pid, start = map(int, mark.read_text().split())
            if not alive(read_stat(pid), start):
                found.append(f".unrecorded/{mark.name} of dead process {pid}")
    return found


def lock_dir_records(directory: Path) -> dict[str, dict[str, Any]]:
    """The records of held/ or queue/ (grants and waiting requests), by file name."""
    found = {}
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            found[path.name] = json.loads(path.read_text())
    return found


def lock_dir_entries(directory: Path) -> list[str]:
    """The records of held/ or queue/, with the job each names."""
    return [f"{name} (job {record.get('job_id')})" for name, record in lock_dir_records(directory).items()]


def lock_holders(lock_dir: Path) -> dict[int, list[str]]:
    """Every process holding an fcntl lock on a GPU lock file (some of it or all), with those GPUs, as
    /proc/locks lists them. Files are matched by inode alone: on overlayfs, /proc/locks names the
    device of the layer below."""
    gpus = {path.stat().st_ino: path.stem for path in (lock_dir / "gpus").glob("*.lock")}
    holders: dict[int, list[str]] = {}
    with open("/proc/locks") as locks:
        for line in locks:
            fields = line.split()  # "1: POSIX ADVISORY WRITE PID MAJ:MIN:INODE START END"; "1: -> ..." waits
            if len(fields) < 8 or fields[1] != "POSIX":
                continue
            gpu = gpus.get(int(fields[5].rpartition(":")[2]))
            if gpu is not None and gpu not in holders.setdefault(int(fields[4]), []):
                holders[int(fields[4])].append(gpu)
    return {pid: found for pid, found in holders.items() if found}


def dead_jobs_leftovers(lock_dir: Path, reports_dir: Path, token: bytes, since: float) -> Leftovers:
    """What jobs that ended or lost their owner still hold: a held/ record or a GPU lock whose job has no
    live process, a queue entry whose waiter is gone, a row PENDING or RUNNING whose owner (connection
    process or supervisor) is dead (a detached job waiting in line, its row queued, has no owner yet: not one), a
    process of a job whose row has ended, files (job_files_leftovers).
    Each is read after what it is judged by (a row before the processes it ended, processes before the
    records they free, an owner's death before its row, held/ both before and after the locks, rows
    before files), so a job that ends during the look is not taken for one that had."""
    found = Leftovers(time.time() - since)
    rows = {row["job_id"]: row for row in ledger_rows(lock_dir)}
    unfinished = {job for job, row in rows.items() if row["state"] in ("PENDING", "RUNNING")}
    queued = {entry.get("job_id") for entry in lock_dir_records(lock_dir / "rows").values()}  # read after the rows
    orphaned = {job for job in unfinished if not alive(read_stat(rows[job]["owner_pid"]), rows[job]["owner_start"])
                and not (not rows[job]["owner_pid"] and job in queued)}  # a detached job waiting in line has none
    processes = job_processes(read_reports(reports_dir), token)
    found.processes = [p for job, ps in processes.items() if job in rows and job not in unfinished for p in ps]
    held = lock_dir_records(lock_dir / "held")
    locks = lock_holders(lock_dir)
    named = [*held.values(), *lock_dir_records(lock_dir / "held").values()]  # a lock granted or freed meanwhile
    live = set(processes) | {record["job_id"] for record in named  # a job process not yet reported
                             if record.get("leader") and alive(read_stat(record["leader"][0]), record["leader"][1])}
    found.held_files = [f"{name} (job {record['job_id']})" for name, record in held.items()
                        if record["job_id"] not in live]
    holding: dict[int, set[str]] = {}  # owner pid -> the jobs of its records
    for record in named:
        holding.setdefault(record["owner"][0], set()).add(record["job_id"])
    for pid, gpus in locks.items():
        if not holding.get(pid, set()) & live:
            jobs = f"job(s) {sorted(holding[pid])}" if pid in holding else "no held/ record"
            found.locked += [f"GPU {gpu_name(gpu)} locked by pid {pid} ({read_comm(pid) or 'gone'}) for {jobs}"
                             for gpu in gpus]
    queue = lock_dir / "queue"
    found.queue_files = [f"{name} (job {entry.get('job_id')})" for name, entry in lock_dir_records(queue).items()
                         if not fifo_read(queue / name.replace(".json", ".fifo"))]
    found.records = [describe_row(row) for row in ledger_rows(lock_dir, LIVE) if row["job_id"] in orphaned]
    found.job_files = job_files_leftovers(lock_dir)
    found.cgroups = stale_cgroups()
    return found


def stale_cgroups() -> list[str]:
    """The jobs' cgroups (a root server's: `rpycdl/job-<pid>-<start>-<n>` under this process's cgroup of each
    hierarchy, named after the job's keeper or supervisor) whose keeper or supervisor is dead: its job's requester,
    or a server's sweep, removes each. Read from /proc and the cgroup file systems, not through rpycdl."""
    stale = []
    with open("/proc/self/mountinfo") as mounts, open("/proc/self/cgroup") as mine:
        points = [line.split()[4] for line in mounts if line.split(" - ")[1].split()[0] in ("cgroup", "cgroup2")]
        own = {line.split(":", 2)[2].strip().removesuffix("/rpycdl-leaf") for line in mine}  # v2: where servers move
    for base in {Path(point) / path.lstrip("/") / "rpycdl" for point in points for path in own}:
        for entry in (base.iterdir() if base.is_dir() else ()):
            named = re.fullmatch(r"job-(\d+)-(\d+)-\d+", entry.name)
            if named and not alive(read_stat(int(named.group(1))), int(named.group(2))):
                stale.append(str(entry))
    return sorted(stale)


def fifo_read(fifo: Path) -> bool:
    """Whether some process has a waiter's wake-up FIFO open for reading (the waiter lives)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader
    except OSError:
        return False
    os.close(fd)
    return True


@dataclass
class Leftovers:
    """What one look found still held, waiting, running or recorded as live."""

    after: float  # seconds after the moment looked from (the last kill, or the end of the detached jobs)
    holders: list[str] = field(default_factory=list)
    queue: list[str] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    records: list[str] = field(default_factory=list)
    held_files: list[str] = field(default_factory=list)
    queue_files: list[str] = field(default_factory=list)
    job_files: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)  # jobs' cgroups whose keeper or supervisor is dead

    def __bool__(self) -> bool:
        return any(getattr(self, kind) for kind in LEFTOVER_KINDS)

    def describe(self) -> str:
        parts = [f"{name}: {items}" for name, items in (
            ("GPU holders (gpu_status)", self.holders), ("queue (gpu_status)", self.queue),
            ("locked GPU lock files", self.locked), ("job processes", self.processes),
            ("job records pending/running", self.records), ("held/ records", self.held_files),
            ("queue/ entries", self.queue_files), ("job files", self.job_files),
            ("cgroups of dead keepers", self.cgroups)) if items]
        return f"{self.after:.3f} s after: " + ("; ".join(parts) or "nothing left")


class EndCheck:
    """Looks, again and again, at what the run left once the clients are gone."""

    def __init__(self, lock_dir: Path, servers: Servers, reports_dir: Path, token: str) -> None:
        self.lock_dir, self.servers, self.reports_dir, self.token = lock_dir, servers, reports_dir, token.encode()
        self.conns: dict[int, Any] = {}

    def look(self, since: float) -> Leftovers:
        found = Leftovers(time.time() - since)
        for server in list(self.servers.live):
            status = self._status(server.port)
            if status is None:
                found.holders.append(f"server on port {server.port} did not answer")
                continue
            for gpu in status["gpus"]:
                found.holders += [f"{gpu['uuid']}: job {h['job_id']} ({h['share_bytes'] / GIB:g} GiB)"
                                  for h in gpu["holders"]]
            found.queue += [f"job {w['job_id']}" for w in status["queue"]]
        found.holders = sorted(set(found.holders))
        found.queue = sorted(set(found.queue))
        found.locked = locked_gpus(self.lock_dir)
        found.processes = [p for ps in job_processes(read_reports(self.reports_dir), self.token).values() for p in ps]
        found.records = live_records(self.lock_dir)
        found.held_files = lock_dir_entries(self.lock_dir / "held")
        found.queue_files = lock_dir_entries(self.lock_dir / "queue") + lock_dir_entries(self.lock_dir / "rows")
        found.job_files = job_files_leftovers(self.lock_dir)
        found.cgroups = stale_cgroups()
        return found

    def _status(self, port: int) -> dict[str, Any] | None:
        import rpycdl

        try:
            if port not in self.conns:
                self.conns[port] = rpycdl.connect(host="127.0.0.1", port=port, **self.servers.settings.looker())
            return self.conns[port].root.gpu_status()
        except Exception:  # noqa: BLE001 - reported as a leftover; connect again next time
            with contextlib.suppress(Exception):
                self.conns.pop(port).close()
            return None

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(Exception):
                conn.close()


# -- a run ------------------------------------------------------------------------------------------


@dataclass
class Ending:
    """What the looks after a moment found: the first look, the first that started past GRACE and
    found something, when each kind of leftover was first gone, and when all were."""

    what: str  # what the looks looked for, and from when: "dead jobs' leftovers after the last kill"
    first: Leftovers
    late: Leftovers | None = None
    gone_after: dict[str, float] = field(default_factory=dict)
    clean_after: float | None = None  # None: not within PATIENCE

    def describe(self) -> str:
        gone = ", ".join(f"{kind} {seconds:.3f} s" for kind, seconds in self.gone_after.items())
        clean = f"{self.clean_after:.3f} s" if self.clean_after is not None else f"not within {PATIENCE:g} s"
        return f"{self.what}: none left after {clean} (gone after: {gone or '-'})"


@dataclass
class ChaosResult:
    """What a run did and found."""

    settings: ChaosSettings
    started: float
    seconds: float
    jobs: int
    outcomes: Counter[str]
    kills: Counter[str]
    kill_log: list[Kill]
    servers: list[Server]
    observer: dict[str, Any]
    after_kill: Ending  # what dead jobs left, from the last kill
    ending: Ending  # everything, once the detached jobs have ended
    records: dict[str, dict[str, Any]]
    status_late: list[dict[str, Any]]  # StatusWatch.late
    status_looks: int
    submitted: set[str]  # ids of detached jobs whose submit returned
    twice: list[str]  # jobs that ran more than once
    job_files: Path  # the state directory's jobs/
    working_dirs: dict[str, str]  # what jobs that brought a working directory found in it (make_job)
    sessions: int  # sessions that ran a call
    users: dict[str, str]  # the identity each job's client connected as, by job (its report)
    clients: dict[str, int]  # the pid of each job's client, by job (its report)
    stopped: float  # when the killer stopped, and the clients were killed (the last kills)
    died: list[str]  # servers the killer did not kill that had ended by then (port, exit status)

    def problems(self) -> list[str]:
        """Broken promises, each with its figures."""
        found = []
        violations = self.observer.get("violations", [])
        if violations:
            shown = "\n  ".join(self.describe(v) for v in violations[:10])
            found.append(f"promise 1: the observer saw {len(violations)} violation(s) (GPU, jobs), "
                         f"{sum(v['loops'] for v in violations)} looks in all; jobs whose processes outlived "
                         f"their grant: {self.culprits()}\n  {shown}")
        late = self.observer.get("late_releases", [])
        if late:
            shown = "\n  ".join(self.describe_late(entry) for entry in late[:10])
            found.append(f"promise 3: {len(late)} job(s) kept their GPUs more than {GRACE:g} s after their last "
                         f"process ended:\n  {shown}")
        if self.status_late:
            shown = "\n  ".join(self.describe_status(entry) for entry in self.status_late[:10])
            found.append(f"promise 3: gpu_status still named {len(self.status_late)} job(s) as holders more than "
                         f"{GRACE:g} s after their last process ended:\n  {shown}")
        for ending in (self.after_kill, self.ending):
            if ending.late is not None:
                found.append(f"promise 3: {GRACE:g} s on, still {ending.describe()}: {ending.late.describe()}")
        broken = {job: seen for job, seen in self.working_dirs.items()
                  if not re.fullmatch(rf"{2**20} [0-{WORKING_DIRS - 1}]", seen)}
        if broken:
            found.append(f"{len(broken)} job(s) found their working directory broken (data.bin's size, the "
                         f"project): {sorted(broken.items())[:10]}")
        if self.died:
            found.append(f"{len(self.died)} server(s) ended though the killer never killed them: {self.died}")
        return found + self.owned() + self.lost() + self.died_of_others()

    def died_of_others(self) -> list[str]:
        """No job that ran died of a kill that was not its own: one that ended before the clients' last kill,
        other than SUCCEEDED, TIMED_OUT or preempted (--preempt: PreemptedError), had one of its own processes killed
        (job process, keeper, connection process, supervisor, children, client); a kill of a shared process
        (SHARED_KILLS) ends none."""
        own = {k.job for k in self.kill_log if k.job} | self.supervised()
        clients = {k.pid for k in self.kill_log if k.kind in ("client", "session_client")}
        found = []
        for job, client in sorted(self.clients.items()):
            row = self.records.get(job, {})
            if row.get("state") in ("FAILED", "CANCELLED", "LOST") and (row.get("ended") or 0) < self.stopped \
                    and job not in own and client not in clients and row.get("error_type") != "PreemptedError":
                found.append(f"job {job} ({row['state']}: {row.get('error_type')}: {row.get('error')}; "
                             f"{self._story(job)})")
        shared = {kind: self.kills[kind] for kind in SHARED_KILLS}
        return [f"promise 3: {len(found)} job(s) died though none of their own processes was killed (kills of "
                f"shared processes: {shared}):\n  " + "\n  ".join(found[:10])] if found else []

    def owned(self) -> list[str]:
        """Under isolation: every job's processes and files its owner's (OwnerWatch), its row its client's user."""
        if not self.settings.isolation:
            return []
        owners = self.observer.get("owners", {})
        found = [f"isolation: {owners['wrong_count']} process(es) or file(s) of a job not its owner's:\n  " +
                 "\n  ".join(owners["wrong"])] if owners.get("wrong_count") else []
        rows = [f"{job} (client {user}, row {self.records[job]['user']})" for job, user in sorted(self.users.items())
                if job in self.records and self.records[job]["user"] != user]
        if rows:
            found.append(f"isolation: {len(rows)} job(s) whose row names another user than their client: {rows[:10]}")
        return found

    def supervised(self) -> set[str]:
        """The jobs whose supervisor was killed: the one it ran as it was, and those its row says it owned (an array's
        element whose end waited for the next element's start, or the next element it had been handed)."""
        killed = {k.pid for k in self.kill_log if k.kind in ("supervisor", "double_keeper")}
        return {k.job for k in self.kill_log if k.kind in ("supervisor", "double_keeper")} | {
            job for job, row in self.records.items() if row.get("detached") and row.get("owner_pid") in killed}

    def lost(self) -> list[str]:
        """Promise 8: every detached job whose submit returned an id ended, once, recorded; LOST only if
        its supervisor was killed; a result kept for each that succeeded."""
        found = [f"promise 8: job {job} ran twice ({self._story(job)})" for job in self.twice]
        rows = self.records
        found += [f"promise 8: detached job {job} has no row in the ledger" for job in self.submitted - set(rows)]
        supervised = self.supervised()
        for job in sorted(self.submitted & set(rows)):
            row = rows[job]
            if row["state"] in ("PENDING", "RUNNING"):
                found.append(f"promise 8: detached job {job} never ended: {row['state']} ({self._story(job)})")
            elif row["state"] == "LOST" and job not in supervised:
                found.append(f"promise 8: detached job {job} LOST though its supervisor was not killed: "
                             f"{row['error']} ({self._story(job)})")
            elif row["state"] == "SUCCEEDED" and not (self.job_files / job / "result").is_file():
                found.append(f"promise 8: detached job {job} SUCCEEDED without its result file")
        return found

    def tested(self) -> list[str]:
        """Why this run did not test what it should (too few jobs, kills or shares)."""
        missing = shortfall(self.jobs, self.kills, len(self.submitted), len(self.working_dirs),
                            bool(self.observer.get("shared_at_once")), self.sessions, self.settings.required_kills())
        missing += unhanded(self.settings, self.records.values())
        if self.settings.isolation:
            owners = self.observer.get("owners", {})
            missing += [f"the observer checked the owner of no job {what}" for what in ("processes", "files")
                        if not owners.get(what)]
            missing += [f"no job of {user} ran" for user in sorted(set(self.settings.isolation.uids) -
                                                                   set(self.users.values()))]
        median = self.observer.get("period_ms", {}).get("p50", 0.0) / 1000
        if not self.observer.get("loops"):
            missing.append("the observer never looped")
        elif median > OBSERVER_PERIOD:
            missing.append(f"the observer looked every {median * 1000:.2f} ms (median), not every "
                           f"{OBSERVER_PERIOD * 1000:g} ms")
        return missing

    def culprits(self) -> str:
        """The job of each violation whose processes outlived its grant, what was done to it, its record."""
        jobs: Counter[str] = Counter(self._culprit(violation) for violation in self.observer.get("violations", []))
        return "; ".join(f"{job} ({count} violation(s); {self._story(job)})" for job, count in jobs.items())

    def _culprit(self, violation: dict[str, Any]) -> str:
        """One whose connection process had been killed, else one whose job process is gone, else the
        first granted."""
        jobs = sorted(violation["jobs"].items(), key=lambda item: item[1]["granted"])
        killed = {k.job for k in self.kill_log if k.kind in CONN_KILLS and k.time <= violation["first"]}
        for job, _ in jobs:
            if job in killed:
                return job
        for job, info in jobs:
            if str(info["job_pid"]) not in info["pids"]:
                return job
        return jobs[0][0]

    def _story(self, job: str, since: float | None = None) -> str:
        """How the killer treated the job, and what its record says."""
        since = self.started if since is None else since
        kills = ", ".join(f"{k.kind} {k.pid} at {k.time - since:+.3f} s" + (f" ({k.note})" if k.note else "")
                          for k in self.kill_log if k.job == job)
        record = self.records.get(job, {})
        server = next((s for s in self.servers if s.server_id == record.get("server_id")), None)
        where = "" if server is None else f" of server :{server.port}" + (
            f" (server killed at {server.killed - since:+.3f} s)" if server.killed else "")
        return f"killed: {kills or 'nothing'}; record {record.get('state', 'gone')}{where}{self._said(job, since)}"

    def _said(self, job: str, since: float) -> str:
        """What the servers logged about the job, each line with its time relative to `since`."""
        said = []
        for server in self.servers:
            for line in list(server.process.lines):
                if job in line:
                    stamp, _, rest = line.partition(",")  # "2026-11-28 11:41:52,123 rpycdl... message"
                    try:
                        when = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(rest[:3]) / 1000
                    except ValueError:
                        said.append(f"server :{server.port}: {line}")
                        continue
                    said.append(f"server :{server.port} at {when - since:+.3f} s: {rest[4:]}")
        return "; servers said: " + " / ".join(said) if said else ""

    def describe(self, violation: dict[str, Any]) -> str:
        """One violation: when, how long, the jobs and their live processes (times relative to it)."""
        parts = []
        for job, info in sorted(violation["jobs"].items(), key=lambda item: item[1]["granted"]):
            share = f"{info['memory'] / GIB:g} GiB" if info["memory"] else "whole GPU"
            pids = ", ".join(f"{pid} {comm or '?'}{' (job process)' if int(pid) == info['job_pid'] else ''}"
                             for pid, comm in info["pids"].items())
            parts.append(f"job {job} [{share}, granted {info['granted'] - violation['first']:+.3f} s; "
                         f"{self._story(job, violation['first'])}] live: {pids}")
        duration = (violation["last"] - violation["first"]) * 1000
        return (f"GPU {gpu_name(violation['gpu'])} at {violation['first'] - self.started:.3f} s, seen for "
                f"{duration:.1f} ms ({violation['loops']} looks): " + " WITH ".join(parts))

    def describe_late(self, entry: dict[str, Any]) -> str:
        released = entry.get("released_after")
        return (f"job {entry['job']} ended at {entry['ended'] - self.started:.3f} s; GPU(s) "
                f"{[gpu_name(gpu) for gpu in entry['gpus']]} still locked by its connection process {entry['conn']} "
                f"({entry['conn_comm']}) {entry['held_after']:.3f} s later, released "
                f"{'never' if released is None else f'after {released:.3f} s'}; its zombies then: "
                f"{entry['zombies'] or 'none'}; {self._story(entry['job'], entry['ended'])}")

    def describe_status(self, entry: dict[str, Any]) -> str:
        return (f"job {entry['job']} ended at {entry['ended'] - self.started:.3f} s; holder of GPU(s) "
                f"{[gpu_name(gpu) for gpu in entry['gpus']]} from {entry['first'] - entry['ended']:.3f} s to "
                f"{entry['last'] - entry['ended']:.3f} s after ({entry['looks']} looks); "
                f"{self._story(entry['job'], entry['ended'])}")

    def summary(self) -> str:
        period = self.observer.get("period_ms", {})
        release = self.observer.get("release_s", {})
        restarts = sum(1 for s in self.servers if s.killed)
        return "\n".join([
            f"chaos seed {self.settings.seed}: {self.seconds:.1f} s of chaos, {self.jobs} jobs started "
            f"(client outcomes: {dict(self.outcomes.most_common())})",
            f"processes killed, by kind: {dict(sorted(self.kills.items()))} (of shared processes, which must end no "
            f"job: {sum(self.kills[kind] for kind in SHARED_KILLS)}); server restarts: {restarts}",
            f"detached jobs: {len(self.submitted)} submitted, ended "
            f"{dict(Counter(self.records[job]['state'] for job in self.submitted if job in self.records))}; "
            f"{len(self.working_dirs)} jobs ran in a working directory; {self.sessions} sessions ran a call",
            f"owners checked (isolation): {self.observer.get('owners') or 'none (one account)'}; children jobs "
            f"started: {child_kinds(self.settings)}",
            f"observer: {self.observer.get('loops', 0)} looks, period mean {period.get('mean', 0):.2f} ms, "
            f"p50 {period.get('p50', 0):.2f} ms, p99 {period.get('p99', 0):.2f} ms, max {period.get('max', 0):.1f} ms; "
            f"jobs seen {self.observer.get('jobs', 0)}, most job processes at once "
            f"{self.observer.get('most_processes', 0)}, looks with shares together "
            f"{self.observer.get('shared_at_once', 0)}",
            f"grants ended after their job: {release.get('count', 0)} jobs, p99 {release.get('p99', 0):.3f} s, "
            f"max {release.get('max', 0):.3f} s; late (> {GRACE:g} s): {len(self.observer.get('late_releases', []))} "
            f"by the locks, {len(self.status_late)} by gpu_status ({self.status_looks} looks)",
            f"promise 1 violations: {len(self.observer.get('violations', []))}",
            f"{self.after_kill.describe()}; first look {self.after_kill.first.describe()}",
            f"{self.ending.describe()}; first look {self.ending.first.describe()}",
        ])


class Chaos:
    """Servers, observer, clients and killer of one run; close() kills whatever it started."""

    def __init__(self, cluster: Any, run_dir: Path, settings: ChaosSettings) -> None:
        from rpycdl.gpu.caps import MEMORY_VAR  # the variable a job on a share finds its size in

        self.settings = settings
        self.run_dir = run_dir
        self.lock_dir = Path(cluster.lock_dir)
        self.token = uuid.uuid4().hex
        self.rng = random.Random(settings.seed)
        for sub in ("reports", "inbox-observer", "inbox-killer", "clients", "submitted"):
            (run_dir / sub).mkdir(parents=True, exist_ok=True)
        if settings.isolation:  # jobs of every account report there (and the observer, as root, checks them)
            for sub in ("reports", "inbox-observer", "inbox-killer"):
                (run_dir / sub).chmod(0o1777)
            (run_dir / "owners.json").write_text(json.dumps(settings.isolation.uids))
        (run_dir / "client.json").write_text(json.dumps({
            "reports": str(run_dir / "reports"), "inboxes": [str(run_dir / "inbox-observer"),
                                                             str(run_dir / "inbox-killer")],
            "memory_var": MEMORY_VAR, "queue_timeout": settings.queue_timeout, "detached": settings.detached,
            "arrays": settings.arrays, "elements": settings.elements,
            "session": settings.session, "calls": settings.calls, "hold": settings.hold,
            "identities": settings.identities(), "certs": settings.isolation.certs if settings.isolation else {},
            "working_dir": settings.working_dir, "child_kinds": child_kinds(settings),
            "working_dirs": make_working_dirs(run_dir / "working-dirs"),
            "children": settings.children, "requests": settings.requests}))
        self.servers = Servers(cluster, run_dir / "ports.json", settings)
        self.clients = Clients(run_dir, self.rng.randrange(1 << 30))
        self.killer = Killer(run_dir, self.lock_dir, self.token, self.servers, self.clients, settings, self.rng)
        self.status = StatusWatch(self.servers)
        self.observer: subprocess.Popen[bytes] | None = None
        self.guard: subprocess.Popen[bytes] | None = None
        self._saved_token = os.environ.get(TOKEN_VAR)

    def start(self) -> None:
        # The guard cleans up should this process die without close(); it does not carry the token.
        self.guard = subprocess.Popen([sys.executable, str(HERE), "guard", self.token, str(os.getpid())],
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        os.environ[TOKEN_VAR] = self.token  # every process started from now on carries it
        for _ in range(self.settings.servers):
            self.servers.start()
        argv = [sys.executable, str(HERE), "observe", str(self.run_dir), self.token, str(self.lock_dir),
                str(self.settings.observer_nice)]
        with open(self.run_dir / "observer.log", "ab") as stderr:
            self.observer = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 30
        while not (self.run_dir / "observer.ready").exists():
            if self.observer.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the observer did not start: " + (self.run_dir / "observer.log").read_text())
            time.sleep(0.01)
        self.status.start()
        for _ in range(self.settings.clients):
            self.clients.start()

    def run(self) -> ChaosResult:
        """The chaos, then the end check; returns what happened."""
        started, now = time.time(), time.monotonic()
        self.killer.run(now + self.settings.duration, lambda: not self.shortfall(), now + self.settings.deadline)
        self.servers.wait_restarts()
        seconds = time.time() - started
        stopped = time.time()
        died = [f":{server.port} (exit {server.process.popen.poll()})" for server in self.servers.live
                if server.process.popen.poll() is not None]
        self.clients.kill_all()  # the last kills
        reports = self.run_dir / "reports"
        after_kill = self._wait_clean("dead jobs' leftovers after the last kill", time.time(), functools.partial(
            dead_jobs_leftovers, self.lock_dir, reports, self.token.encode()))
        # Detached jobs outlive their clients: wait for their rows to end (at most queue_timeout in the queue, a
        # moment running; a minute allows for a busy machine), then look from that moment.
        deadline = time.monotonic() + self.settings.queue_timeout + 60
        while live_records(self.lock_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        check = EndCheck(self.lock_dir, self.servers, reports, self.token)
        try:
            ending = self._wait_clean("leftovers once the detached jobs ended", time.time(), check.look)
        finally:
            check.close()
        self.status.stop()
        observed = self._stop_observer()
        return ChaosResult(self.settings, started, seconds, len(read_reports(reports)), self.clients.outcomes(),
                           self.killer.kills, self.killer.log, self.servers.killed + self.servers.live, observed,
                           after_kill, ending, {row["job_id"]: row for row in ledger_rows(self.lock_dir)},
                           self.status.late(observed.get("ended", {})), len(self.status.samples),
                           set(os.listdir(self.run_dir / "submitted")), sorted(p.stem for p in reports.glob("*.twice")),
                           self.lock_dir / "state" / "jobs",
                           {path.stem: path.read_text() for path in reports.glob("*.workdir")},
                           len(list(reports.glob("*.session"))),
                           {job: report.user for job, report in read_reports(reports).items()},
                           {job: report.client for job, report in read_reports(reports).items()}, stopped, died)

    def shortfall(self) -> list[str]:
        """What the run has not done yet of what it must (shortfall), as its files tell so far."""
        reports = os.listdir(self.run_dir / "reports")
        jobs, working_dirs, sessions = (sum(name.endswith(suffix) for name in reports)
                                        for suffix in (".json", ".workdir", ".session"))
        return shortfall(jobs, self.killer.kills, len(os.listdir(self.run_dir / "submitted")), working_dirs,
                         (self.run_dir / "observer.shared").exists(), sessions, self.settings.required_kills()) + \
            unhanded(self.settings, ledger_rows(self.lock_dir, "array_id IS NOT NULL")) + (
                ["no job was preempted"] if "--preempt" in self.settings.server_args and not ledger_rows(
                    self.lock_dir, table="preemptions") else [])

    @staticmethod
    def _wait_clean(what: str, since: float, look: Callable[[float], Leftovers]) -> Ending:
        """Look (look(since)) until nothing is left, or PATIENCE ran out."""
        ending: Ending | None = None
        while True:
            found = look(since)
            ending = ending or Ending(what, found)
            for kind in LEFTOVER_KINDS:
                if not getattr(found, kind):
                    ending.gone_after.setdefault(kind, time.time() - since)
            if not found:
                ending.clean_after = time.time() - since
                return ending
            if found.after > GRACE and ending.late is None:
                ending.late = found
            if time.time() - since > PATIENCE:
                return ending
            time.sleep(0.01)

    def _stop_observer(self) -> dict[str, Any]:
        if self.observer is None or self.observer.poll() is not None:
            return {}
        self.observer.terminate()
        try:
            self.observer.wait(20)
        except subprocess.TimeoutExpired:
            return {}
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.run_dir / "observer.json").read_text())
        return {}

    def close(self) -> None:
        """Kill everything the run started: clients, observer, servers, and any process carrying the token."""
        try:
            self.status.stop()
            self.servers.wait_restarts()
            self.clients.kill_all()
            if self.observer is not None and self.observer.poll() is None:
                self.observer.kill()
                self.observer.wait()
            for server in self.servers.live:
                server.process.stop()
        finally:
            if self._saved_token is None:
                os.environ.pop(TOKEN_VAR, None)
            else:
                os.environ[TOKEN_VAR] = self._saved_token
            left = kill_marked(self.token.encode())
            if left:
                print(f"chaos: could not kill {left}", file=sys.stderr)
            if self.guard is not None:
                self.guard.terminate()
                self.guard.wait()


def kill_marked(token: bytes, patience: float = 10.0) -> list[int]:
    """SIGKILL every live process whose environment carries `token` until none is left; returns those
    still alive after `patience` seconds."""
    deadline = time.monotonic() + patience
    while True:
        marked = []
        for pid in proc_pids():
            stat = read_stat(pid)
            if pid != os.getpid() and stat is not None and stat.state not in "ZX" \
                    and read_environ(pid).get(TOKEN_VAR.encode()) == token:
                marked.append(pid)
                signal_process(pid, stat.start, signal.SIGKILL)
        if not marked or time.monotonic() > deadline:
            return marked
        time.sleep(0.05)


def guard_main(token: str, pid: int) -> None:
    """The guard process: once process `pid` (the test's) has died, however, kill whatever carries `token`."""
    with contextlib.suppress(OSError):
        watched = os.pidfd_open(pid)
        select.select([watched], [], [])
    kill_marked(token.encode())


def run_chaos(cluster: Any, run_dir: Path, settings: ChaosSettings | None = None) -> ChaosResult:
    """One chaos run on `cluster` (a rpycdl.site.local.LocalCluster; its lock directory is the run's).

    - Servers: `settings.servers` of them on the cluster's lock directory; their ports in a file
      that clients read again whenever they connect.
    - Clients (`python chaos.py client`): random requests (whole GPUs and shares) with a queue
      timeout, attached, detached, or sessions of a few calls, for ever, connecting again when their
      connection dies. Under `settings.isolation`, servers run as root with a user map and each
      connection is one of alice, bob or carol, with that user's certificate.
    - Jobs (make_job): each reports itself (pid, start time, parent, group, job id, GPUs, share)
      before it starts anything, then starts children by exec (some ignore SIGTERM and start
      grandchildren), sleeps a little and returns.
    - The killer (Killer, in this process) acts every few tens of ms: kill -9 the connection
      process of a job as soon as the job, just granted, has a child; of any running job; of a
      job whose server parent was killed; kill -9 a job process or its keeper; kill -9 or SIGTERM a
      job's children; kill -9 a server parent and start another server, and right then (a double
      fault) its orphaned forkserver or the keeper or job process of a job it forked; kill -9 a
      forkserver, a spare connection process; kill -9 a client; kill -9 a session's process, its
      connection process, or the client holding it. No job may die of a kill that was not its own.
    - The observer (`python chaos.py observe`, reading only /proc, the reports and the lock
      directory) loops as fast as it can, at nice -10 when run as root (its median period must
      stay within OBSERVER_PERIOD); see Observer and ReleaseWatch. A StatusWatch asks a
      server for gpu_status every 50 ms, to compare the servers' own account with the jobs' ends.
      Under isolation it also checks each job's processes and files against its owner (OwnerWatch).
    - The end: the killer stops and the clients are killed (the last kills). Within GRACE seconds
      of them a look must find nothing that a dead job left (dead_jobs_leftovers: detached jobs run
      on, so what they hold counts only once they have ended or lost their owner); once the detached
      jobs have ended, within GRACE seconds a look must find nothing at all (EndCheck).

    Everything started carries RPYCDL_CHAOS_RUN=<token> in its environment (servers, and so their
    connection and job processes and what jobs start, clients, observer); close() kills every
    live process that carries it, and a guard process does so should this process die first.
    """
    chaos = Chaos(cluster, run_dir, settings or ChaosSettings())
    try:
        chaos.start()
        return chaos.run()
    finally:
        chaos.close()


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "client":
        client_main(rest[0], int(rest[1]))
    elif command == "observe":
        observe_main(rest[0], rest[1], rest[2], int(rest[3]))
    elif command == "guard":
        guard_main(rest[0], int(rest[1]))
    else:
        raise SystemExit(f"unknown command {command!r}")
