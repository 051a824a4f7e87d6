"""Detached and attached jobs at once, from 8 processes against two servers sharing a lock and a state
directory, with cancels from every side (issue 15). Afterwards, from outside: the ledger agrees with
what every client saw, every job is in one final state, no job ran twice, and no GPU was granted to
two jobs at once (each job takes an exclusive flock of a witness file per GPU it was given). Again with
isolation (issue 26): root servers with a user map, the clients alice, bob and carol; every job ran as
its owner's account (its process, read in /proc while it ran, and the file it wrote)."""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import queue
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chaos import read_stat, read_uids
from helpers import write_user_map

import rpycdl
from rpycdl.site.local import LocalCluster

CTX = multiprocessing.get_context("fork")
WORKERS = 8
LEAST = 12.0  # seconds the workers submit and cancel at the least; then on until they have done ENOUGH
DEADLINE = 300.0  # seconds they may take to do ENOUGH (a busy machine is slow, not wrong)
MOST_UNFINISHED = 3  # detached jobs a worker has in flight at once
OUTCOME_STATES = {"ok": "SUCCEEDED", "JobCancelledError": "CANCELLED", "QueueTimeoutError": "FAILED"}
COUNTS = ("attached", "detached", "attached cancelled", "detached cancelled")
"""What each worker counts as it goes (attached jobs ended, detached jobs submitted, and of those, ended
cancelled): the test runs until the totals reach ENOUGH."""
ENOUGH = {"attached": WORKERS * 5, "detached": WORKERS * 3, "attached cancelled": 1, "detached cancelled": 1}


class Progress:
    """The COUNTS of every worker, in memory the workers share with the test (forked)."""

    def __init__(self) -> None:
        self._counts = CTX.Array("i", WORKERS * len(COUNTS))

    def add(self, worker: int, what: str) -> None:
        with self._counts.get_lock():
            self._counts[worker * len(COUNTS) + COUNTS.index(what)] += 1

    def totals(self) -> dict[str, int]:
        with self._counts.get_lock():
            counts = list(self._counts)
        return {what: sum(counts[index::len(COUNTS)]) for index, what in enumerate(COUNTS)}

    def idle_workers(self) -> list[int]:
        """Workers that have neither ended an attached job nor submitted a detached one yet."""
        with self._counts.get_lock():
            counts = list(self._counts)
        return [n for n in range(WORKERS) if not any(counts[n * len(COUNTS):n * len(COUNTS) + 2])]

    def enough(self) -> bool:
        totals = self.totals()
        return all(totals[what] >= least for what, least in ENOUGH.items()) and not self.idle_workers()

    def describe(self) -> str:
        totals = self.totals()
        idle = self.idle_workers()
        return ", ".join(f"{what} {totals[what]} of {least}" for what, least in ENOUGH.items()) + (
            f"; workers that did nothing: {idle}" if idle else "")


def make_witness() -> Callable[[dict[str, Any]], str]:
    """The job every worker sends: it locks a witness file per granted GPU (a second holder finds it
    locked: a violation), notes that it ran (its id, token, pid and start time, in a file of its uid's:
    runs.UID), holds a moment and returns its job id."""

    def witness(args: dict[str, Any]) -> str:
        import fcntl
        import os
        import time

        job_id = os.environ["RPYCDL_JOB_ID"]
        held = []
        for uuid in os.environ["RPYCDL_GPU_UUIDS"].split(","):
            fd = os.open(os.path.join(args["dir"], f"{uuid}.lock"), os.O_RDONLY | os.O_CLOEXEC)  # made by the test
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                with open(os.path.join(args["dir"], f"violations.{os.getuid()}"), "a") as out:
                    out.write(f"{job_id} found {uuid} held\n")
            held.append(fd)
        with open("/proc/self/stat", "rb") as stat:
            start = stat.read().rpartition(b")")[2].split()[19].decode()
        with open(os.path.join(args["dir"], f"runs.{os.getuid()}"), "a") as out:
            out.write(f"{job_id} {args['token']} {os.getpid()} {start}\n")
        time.sleep(args["hold"])
        return job_id

    return witness


def _worker(port_list: list[int], directory: str, number: int, progress: Progress, stop: Any, out: Any,
            certs: dict[str, dict[str, str]]) -> None:
    """Attached jobs in one thread; detached submits and cancels (of its user's detached and attached jobs)
    in another, until `stop` is set; then the final state each detached job reached, as this client saw it.
    With `certs` (rpycdl.connect() keywords by user), it connects as one of those users (not "root")."""
    users = [user for user in certs if user != "root"]
    user = users[number % len(users)] if users else f"worker{number}"
    rng = random.Random(number)
    witness = make_witness()
    attached: collections.Counter[str] = collections.Counter()
    tokens: dict[str, str] = {}  # attached job token -> outcome
    detached: dict[str, str | None] = {}  # job id -> state a cancel found it in (None: not cancelled)
    ended: dict[str, str] = {}  # detached job id -> the final state a look found it in

    def connect() -> rpycdl.Connection:
        conn = rpycdl.connect(host="127.0.0.1", port=rng.choice(port_list), **certs.get(user, {}))
        conn.root.identify(user)  # nothing where its certificate names it
        return conn

    def attach() -> None:
        conn = connect()
        while not stop.is_set():
            token = f"w{number}-{len(tokens)}"
            args = {"dir": directory, "hold": rng.uniform(0.02, 0.3), "token": token}
            try:
                conn.root.run_code(witness, args, ngpus=rng.choice([1, 1, 2]), queue_timeout=rng.choice([None, 1.0]))
                outcome = "ok"
            except (rpycdl.JobCancelledError, rpycdl.QueueTimeoutError) as exc:
                outcome = type(exc).__name__
            attached[outcome] += 1
            tokens[token] = outcome
            progress.add(number, "attached")
            if outcome == "JobCancelledError":
                progress.add(number, "attached cancelled")

    thread = threading.Thread(target=attach)
    thread.start()
    conn = connect()
    while not stop.is_set():
        for job_id in detached.keys() - ended.keys():
            status = conn.root.job(job_id).status()
            if status.finished:
                ended[job_id] = status.state.value
                if status.state.value == "CANCELLED":
                    progress.add(number, "detached cancelled")
        unfinished = [job_id for job_id in detached if job_id not in ended]
        roll = rng.random()
        if len(unfinished) < MOST_UNFINISHED and roll < 0.6:
            args = {"dir": directory, "hold": rng.uniform(0.02, 0.5), "token": f"w{number}-d{len(detached)}"}
            name = rng.choice([None, f"w{number}-{len(detached)}"])  # workers of one user: names of their own
            job = conn.root.submit(witness, args, ngpus=rng.choice([1, 2]), name=name)
            detached[job.id] = None
            progress.add(number, "detached")
        elif unfinished and roll < 0.8:
            job_id = rng.choice(unfinished)
            detached[job_id] = conn.root.cancel(job_id)
        else:
            mine = conn.root.jobs(users=[user], states=["PENDING", "RUNNING"])
            live = [row["job_id"] for row in mine if not row["detached"]]
            if live:
                conn.root.cancel(rng.choice(live))
        time.sleep(rng.uniform(0, 0.05))
    thread.join()
    seen = {}
    for job_id, cancelled in detached.items():
        status = rpycdl.job(job_id, host="127.0.0.1", port=rng.choice(port_list), **certs.get(user, {})).wait(60)
        seen[job_id] = {"state": status.state.value, "cancelled_when": cancelled}
    out.put((user, attached, tokens, seen))


def _until_enough(workers: list[Any], progress: Progress, stop: Any) -> float:
    """Let the workers run LEAST seconds, then on until they have done ENOUGH, a worker died, or DEADLINE
    passed; stop them. Returns the seconds they ran."""
    started = time.monotonic()
    while True:
        ran = time.monotonic() - started
        if (ran >= LEAST and progress.enough()) or ran > DEADLINE or not all(w.is_alive() for w in workers):
            stop.set()
            return ran
        time.sleep(0.1)


def _reports(out: Any, workers: list[Any]) -> list[tuple[Any, ...]]:
    """What every worker put in `out` once stopped (it waits for its detached jobs to end first)."""
    reports: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + DEADLINE
    while len(reports) < len(workers):
        try:
            reports.append(out.get(timeout=1))
        except queue.Empty:
            dead = [worker.exitcode for worker in workers if not worker.is_alive()]
            assert len(dead) < len(workers) and time.monotonic() < deadline, \
                f"{len(reports)} of {len(workers)} workers reported; exit codes of those that ended: {dead}"
    return reports


def _ledger_rows(state_dir: Path) -> list[dict[str, Any]]:
    """Every row of the ledger, read as an outsider (SQLite, read-only)."""
    with contextlib.closing(sqlite3.connect(f"file:{state_dir / 'ledger.sqlite3'}?mode=ro", uri=True)) as db:
        db.row_factory = sqlite3.Row
        return [dict(row) for row in db.execute("SELECT * FROM jobs")]


class RunOwners:
    """Reads, while the jobs run, the runs.UID files where each job notes its pid and start time, and the uids
    (/proc/PID/status) of each such job process still alive: what account each job ran as, seen from outside."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.uids: dict[str, tuple[int, ...]] = {}  # job id -> its process's real, effective, saved and fs uids
        self._read: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RunOwners:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for path in self.directory.glob("runs.*"):
                with open(path) as runs:
                    runs.seek(self._read.get(path, 0))
                    lines = runs.read()
                complete = lines[:lines.rfind("\n") + 1]
                self._read[path] = self._read.get(path, 0) + len(complete)
                for line in complete.splitlines():
                    job_id, _, pid, start = line.split()
                    self._look(job_id, int(pid), start)

    def _look(self, job_id: str, pid: int, start: str) -> None:
        uids, stat = read_uids(pid), read_stat(pid)  # its start after its uids: both of one process
        if stat is not None and stat.start == int(start) and uids is not None:  # else gone, its pid another's
            self.uids[job_id] = uids


def _runs(directory: Path) -> list[tuple[str, str, int]]:
    """What the jobs noted (runs.UID): job id, token, and the uid that owns the file it is in."""
    return [(line.split()[0], line.split()[1], path.stat().st_uid) for path in sorted(directory.glob("runs.*"))
            for line in path.read_text().splitlines()]


def _witness_dir(directory: Path, port: int, credentials: dict[str, str]) -> None:
    """Where the jobs of every account leave their marks (mode 1777), with a witness file per GPU that any of
    them may open (the server's gpu_status names the GPUs)."""
    directory.mkdir()
    directory.chmod(0o1777)
    with rpycdl.connect(host="127.0.0.1", port=port, **credentials) as conn:
        for gpu in conn.root.gpu_status()["gpus"]:
            (directory / f"{gpu['uuid']}.lock").touch(0o644)


@pytest.mark.slow
def test_eight_clients_submitting_and_cancelling_against_two_servers(cluster, tmp_path):
    ports = [cluster.add_server("pytorch", "fake:2")[1] for _ in range(2)]
    _stress(ports, tmp_path / "witness", Path(cluster.lock_dir) / "state", {}, {})


@pytest.mark.slow
def test_the_same_with_isolation_every_job_running_as_its_owner(team, accounts, passable_dir):
    """The servers started as root with a user map (issue 26), the workers connecting as alice, bob and carol:
    the same checks hold, and every job ran as its owner's account."""
    flags = (*team.server_args("localhost"), "--user-map", str(write_user_map(passable_dir / "users.toml")))
    with LocalCluster(str(passable_dir / "locks")) as cluster:
        ports = [cluster.add_server("pytorch", "fake:2", *flags, isolated=True)[1] for _ in range(2)]
        _stress(ports, passable_dir / "witness", Path(cluster.lock_dir) / "state",
                {user: team.user(user) for user in [*accounts, "root"]},
                {user: account.pw_uid for user, account in accounts.items()})


def _stress(ports: list[int], witness_dir: Path, state_dir: Path, certs: dict[str, dict[str, str]],
            uids: dict[str, int]) -> None:
    """WORKERS workers against the servers on `ports` (as the users of `certs`, if any: "root" is the test's
    own), then the checks; each job must have run as the account of its user in `uids` (else as this process's)."""
    _witness_dir(witness_dir, ports[0], certs.get("root", {}))
    out, progress, stop = CTX.Queue(), Progress(), CTX.Event()
    workers = [CTX.Process(target=_worker, args=(ports, str(witness_dir), n, progress, stop, out, certs), daemon=True)
               for n in range(WORKERS)]
    for worker in workers:
        worker.start()
    try:
        with RunOwners(witness_dir) as owners:
            ran = _until_enough(workers, progress, stop)
            reports = _by_user(_reports(out, workers))
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    assert all(worker.exitcode == 0 for worker in workers), [worker.exitcode for worker in workers]

    violations = "".join(path.read_text() for path in witness_dir.glob("violations.*"))
    assert not violations, "a GPU was granted to two jobs at once:\n" + violations
    runs = collections.Counter(job for job, _, _ in _runs(witness_dir))
    assert not [job for job, count in runs.items() if count > 1], f"jobs that ran twice: {runs.most_common(3)}"
    token_of = {job: token for job, token, _ in _runs(witness_dir)}

    rows = {row["job_id"]: row for row in _ledger_rows(state_dir)}
    _check_owners(rows, _runs(witness_dir), owners.uids, uids)
    assert not [row for row in rows.values() if row["state"] in ("PENDING", "RUNNING")], "unfinished rows remain"
    assert {row["user"] for row in rows.values()} == set(reports)
    submitted = 0
    for user, (attached, tokens, seen) in reports.items():
        mine = [row for row in rows.values() if row["user"] == user]
        # Detached: the ledger says what the client saw; only a cancel ends one otherwise than SUCCEEDED, and
        # a job a cancel found unfinished may still have ended first.
        for job_id, view in seen.items():
            row, cancel = rows[job_id], view["cancelled_when"]
            assert row["detached"] and row["state"] == view["state"], (job_id, row["state"], view)
            either = {"CANCELLED", "SUCCEEDED"}
            allowed = {None: {"SUCCEEDED"}, "PENDING": either, "RUNNING": either}.get(cancel, {cancel})
            assert row["state"] in allowed, (job_id, view)
            assert runs[job_id] == (row["state"] == "SUCCEEDED") or row["state"] == "CANCELLED", (job_id, view)
        submitted += len(seen)
        assert {row["job_id"] for row in mine if row["detached"]} == set(seen), user
        # Attached: as many rows in each final state as the client saw outcomes of each kind.
        states = collections.Counter(row["state"] for row in mine if not row["detached"])
        expected = collections.Counter({OUTCOME_STATES[outcome]: count for outcome, count in attached.items()})
        assert states == expected, (user, states, attached)
        for job_id, token in token_of.items():  # those that ran: their row says how the client saw them end
            if token in tokens:
                assert rows[job_id]["state"] == OUTCOME_STATES[tokens[token]], (job_id, token, tokens[token])
    so_far = f"in {ran:.0f} s (deadline {DEADLINE:g} s): {progress.describe()}"
    assert submitted >= ENOUGH["detached"], f"only {submitted} detached jobs: the test tested little {so_far}"
    assert sum(sum(attached.values()) for attached, _, _ in reports.values()) >= ENOUGH["attached"], so_far
    cancelled = [row for row in rows.values() if row["state"] == "CANCELLED"]
    assert any(row["detached"] for row in cancelled) and any(not row["detached"] for row in cancelled), \
        f"the test should cancel detached and attached jobs {so_far}"
    ended = collections.Counter((row["detached"], row["state"]) for row in rows.values())
    print(so_far, json.dumps(ended.most_common()))


def _by_user(reports: list[tuple[Any, ...]]) -> dict[str, tuple[collections.Counter[str], dict[str, str], dict]]:
    """The workers' reports summed by user (several workers may connect as one): attached outcomes, tokens,
    detached jobs seen."""
    summed: dict[str, tuple[collections.Counter[str], dict[str, str], dict]] = {}
    for user, attached, tokens, seen in reports:
        counts, all_tokens, all_seen = summed.setdefault(user, (collections.Counter(), {}, {}))
        counts.update(attached)
        all_tokens.update(tokens)
        all_seen.update(seen)
    return summed


def _check_owners(rows: dict[str, dict[str, Any]], runs: list[tuple[str, str, int]],
                  seen: dict[str, tuple[int, ...]], uids: dict[str, int]) -> None:
    """Every job ran as its row's user's account (`uids`; this process's where it has none): the file it noted
    its run in is that account's, and so are the uids of its process, where RunOwners saw it alive."""

    def want(job: str) -> int:
        return uids.get(rows[job]["user"], os.getuid())

    files = [(job, owner) for job, _, owner in runs if owner != want(job)]
    assert not files, f"jobs whose mark belongs to another account than their user's: {files[:10]}"
    processes = {job: found for job, found in seen.items() if any(uid != want(job) for uid in found)}
    assert not processes, f"job processes running as another account than their user's: {processes}"
    users = {rows[job]["user"] for job in seen}
    assert seen and users >= set(uids), f"RunOwners saw no job process alive of {set(uids) - users or 'anyone'}"
