"""The job ledger: every job of a host, attached or detached, as one row of an SQLite database in WAL
mode, `<state_dir>/ledger.sqlite3`, shared by every server process and container of the host.

Its schema is rpycdl.scheduler.schema's, a row's JobRecord rpycdl.scheduler.jobrecord's, a requeued job's attempts
rpycdl.scheduler.attempts's (AttemptsLedger), its tallies of refused requests and dropped connections
rpycdl.scheduler.tallies's (TalliesLedger); `artifacts` says where a job's outputs stand.

Concurrency: many processes write at once, each with its own connection; every write is one short
transaction (BEGIN IMMEDIATE ... COMMIT) that waits up to LEDGER_BUSY_TIMEOUT for another one's, and
readers never block writers (WAL). A finished row never changes: every write to a row requires it
unfinished, so of the owner's save() and a sweep's end() the first to finish a job wins, and their
return values say who. A connection never crosses a fork: os.fork() closes every ledger's connection
first (under its lock, so no thread is inside a transaction), and each process opens its own on first use. (A
child that inherited an open connection would share SQLite's memory of the parent's locks, and its own connection
would take none of them.)
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import threading
import time
import urllib.parse
import uuid
import weakref
from collections.abc import Container, Iterator, Sequence
from pathlib import Path
from typing import Any

from rpycdl.defaults import LEDGER_BUSY_TIMEOUT
from rpycdl.errors import InvalidRequestError, LedgerError
from rpycdl.scheduler.attempts import AttemptsLedger
from rpycdl.scheduler.jobrecord import COLUMNS, JobRecord, from_row, new_job_id, to_row
from rpycdl.scheduler.lockdir import shared_dir, shared_file
from rpycdl.scheduler.preemptions import PreemptionsLedger
from rpycdl.scheduler.schema import ARTIFACT_STATES, DROPS, LIVE, MIGRATIONS, REFUSALS, migrate
from rpycdl.scheduler.tallies import TalliesLedger
from rpycdl.states import UNFINISHED, JobState

__all__ = ["DROPS", "REFUSALS", "UNFINISHED", "JobRecord", "JobState", "Ledger", "new_job_id"]

_SELECT = f"SELECT state, {', '.join(COLUMNS)} FROM jobs"
_JOB_ID = 1 + COLUMNS.index("job_id")
_WRITTEN = [column for column in ("state", *COLUMNS) if column != "cancel_requested"]
_UPSERT = (f"INSERT INTO jobs ({', '.join(_WRITTEN)}) VALUES ({', '.join(':' + c for c in _WRITTEN)}) "
           f"ON CONFLICT (job_id) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in _WRITTEN if c != 'job_id')} "
           f"WHERE jobs.{LIVE}")


class Ledger(AttemptsLedger, TalliesLedger, PreemptionsLedger):
    """The job ledger of one state directory: <state_dir>/ledger.sqlite3. The threads of a process may
    share one, and a child of os.fork() goes on using it (with a connection of its own)."""

    FILE = "ledger.sqlite3"

    def __init__(self, state_dir: str | os.PathLike[str], read_only: bool = False, checked: bool = False) -> None:
        """Open the ledger of `state_dir`, creating both if the directory is new or empty; check it and
        bring its schema up to date. `read_only` (a monitor): open it for reading, creating and changing nothing.
        `checked` (a supervisor, which a server started): a server checked and migrated it, so only its schema
        version is read, not every page (PRAGMA quick_check grows with the ledger).

        Raises:
            LedgerError: the ledger is missing from a directory of earlier jobs (or from any, `read_only`),
                corrupted, written by a newer (`read_only`: another) rpycdl, or cannot be opened; the message names
                its file and what to do.
        """
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / self.FILE
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._read_only = read_only
        if read_only:  # opened when first read, once a server has made it (until then it reads as empty)
            self.ledger_id = ""
            _LEDGERS.add(self)
            return
        if not self.state_dir.is_dir():  # an existing one keeps its mode: a site may restrict it to a group
            shared_dir(self.state_dir)
        if not self.path.exists():
            history = sorted(entry.name for entry in self.state_dir.iterdir()  # the ledger's own files: another
                             if _holds(entry) and not entry.name.startswith(self.FILE))  # process made it meanwhile
            if history:
                raise LedgerError(f"the job ledger {self.path} is missing, but {self.state_dir} holds earlier jobs' "
                                  f"files ({', '.join(history)}): restore the ledger from a backup, or move the "
                                  "state directory aside to start an empty one")
            shared_file(self.path)  # mode 0o666, which SQLite gives its -wal and -shm files too
        try:
            self.ledger_id: str = self._migrate(checked)
        except sqlite3.OperationalError as exc:  # locked past the busy timeout, unreadable, disk I/O error
            raise LedgerError(f"the job ledger {self.path} cannot be used: {exc}") from exc
        except sqlite3.DatabaseError as exc:  # not a database, malformed
            raise self._corrupted(str(exc)) from exc
        _LEDGERS.add(self)

    def _corrupted(self, detail: str) -> LedgerError:
        return LedgerError(f"the job ledger {self.path} is corrupted ({detail}): restore it from a backup, or move "
                           f"the state directory {self.state_dir} aside to start afresh (`sqlite3 {self.path} "
                           ".recover` may save its rows)")

    def _check_reader(self, db: sqlite3.Connection) -> None:
        """A reader's check that the ledger it opened has this rpycdl's schema."""
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version != len(MIGRATIONS):
            raise LedgerError(f"the job ledger {self.path} has schema version {version}, and this rpycdl reads version "
                              f"{len(MIGRATIONS)}: run the servers' version of rpycdl")

    def _migrate(self, checked: bool) -> str:
        """Check the database (only its schema version if a server `checked` it), run the migrations it lacks (in
        one transaction), return its ledger_id."""
        with self._db() as db:
            if checked:
                self._check_reader(db)
                return db.execute("SELECT value FROM meta WHERE key = 'ledger_id'").fetchone()[0]
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise self._corrupted("; ".join(problems[:3]))
        with self._write() as db:
            migrate(db, self.path)
            db.execute("INSERT OR IGNORE INTO meta VALUES ('ledger_id', ?)", (uuid.uuid4().hex,))
            return db.execute("SELECT value FROM meta WHERE key = 'ledger_id'").fetchone()[0]

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """This process's connection, opened on first use, for one thread at a time."""
        with self._lock:
            if self._conn is not None and self._pid != os.getpid():  # forked past os.fork's hooks
                _INHERITED.append(self._conn)  # never close (nor collect) the parent's connection
                self._conn = None
            if self._conn is None and self._read_only and not self.path.is_file():
                yield _empty()  # a reader that came before the servers: no job yet
                return
            if self._conn is None:
                db = sqlite3.connect(f"file:{urllib.parse.quote(str(self.path))}?mode=ro" if self._read_only
                                     else self.path, timeout=LEDGER_BUSY_TIMEOUT, isolation_level=None,
                                     check_same_thread=False, uri=self._read_only)
                if self._read_only:  # found in WAL mode: its servers put it there
                    self._check_reader(db)
                else:
                    _into_wal(db)
                db.execute("PRAGMA synchronous=NORMAL")
                self._conn, self._pid = db, os.getpid()
            yield self._conn

    @contextlib.contextmanager
    def _write(self, busy: float = LEDGER_BUSY_TIMEOUT) -> Iterator[sqlite3.Connection]:
        """One write transaction: it waits for the others' (`busy` seconds at most) and blocks no reader."""
        with self._db() as db:
            if busy != LEDGER_BUSY_TIMEOUT:
                db.execute(f"PRAGMA busy_timeout = {int(busy * 1000)}")
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            finally:
                if busy != LEDGER_BUSY_TIMEOUT:
                    db.execute(f"PRAGMA busy_timeout = {int(LEDGER_BUSY_TIMEOUT * 1000)}")

    def close(self) -> None:
        """Close this process's connection (a later call opens another)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
            self._conn = None

    def save(self, record: JobRecord) -> bool:
        """Write `record`, every column but cancel_requested, unless its row has finished already (a
        finished record without an end time gets one: now). Returns whether it wrote.

        Raises:
            InvalidRequestError: another unfinished job of the same user has the record's name.
        """
        if record.state.finished and record.ended is None:
            record.ended = time.time()
        with self._write() as db:
            try:
                return db.execute(_UPSERT, to_row(record)).rowcount > 0
            except sqlite3.IntegrityError:
                other = _one(db, f"user = ? AND name = ? AND {LIVE}", record.user, record.name)
                if other is None:
                    raise
                raise InvalidRequestError(f"{record.user} already has an unfinished job named {record.name!r} "
                                          f"({other.job_id}, {other.state.value}): choose another name=, or "
                                          "cancel it") from None

    def get(self, job_id: str) -> JobRecord | None:
        """The job `job_id`, or None."""
        with self._db() as db:
            return _one(db, "job_id = ?", job_id)

    def find(self, ref: str, user: str, verified: bool | None = None) -> JobRecord | None:
        """The job whose id is `ref`, else `user`'s unfinished job named `ref`, else their latest one of
        that name, else None; with `verified`, only among that user's jobs proven alike (a declared name
        does not find the jobs of the verified user of that name, nor the other way round)."""
        alike = "" if verified is None else f" AND user_verified = {int(verified)}"
        with self._db() as db:
            return _one(db, "job_id = ?", ref) or _one(
                db, f"user = ? AND name = ?{alike} ORDER BY {LIVE} DESC, submitted DESC LIMIT 1", user, ref)

    def cancel_requested(self, job_id: str) -> bool:
        """Whether someone asked to cancel the job (cheap enough to poll)."""
        with self._db() as db:
            return bool(db.execute("SELECT 1 FROM jobs WHERE job_id = ? AND cancel_requested", (job_id,)).fetchone())

    def request_cancel(self, job_id: str) -> JobRecord | None:
        """Ask the owner of an unfinished job to cancel it (a finished one is left alone). Returns the
        job as it was before, or None if there is no such job."""
        with self._write() as db:
            record = _one(db, "job_id = ?", job_id)
            if record is not None and not record.state.finished:
                db.execute("UPDATE jobs SET cancel_requested = 1 WHERE job_id = ?", (job_id,))
            return record

    def end(self, job_id: str, state: JobState, error: str, error_type: str = "", unowned: bool = False) -> bool:
        """Finish an unfinished job in `state`, ended now (a sweep's move once its owner is gone); with `unowned`,
        only a job no process owns (a queued row: owner_pid 0). Returns whether it changed the row (not if there
        is no such job, or it had finished)."""
        if not state.finished:
            raise ValueError(f"end() needs a final state, not {state.value}")
        with self._write() as db:
            return db.execute(f"UPDATE jobs SET state = ?, error = ?, error_type = ?, ended = ? WHERE job_id = ? "
                              f"AND {LIVE}{' AND owner_pid = 0' if unowned else ''}",
                              (state.value, error, error_type, time.time(), job_id)).rowcount > 0

    def set_owner(self, job_id: str, owner: tuple[int, int], was: tuple[int, int]) -> bool:
        """Make the process `owner` (pid, start) the owner of a PENDING job whose owner is still `was` (a queued
        row's next supervisor, as it starts: (0, 0) for none yet, or one that died). Returns whether it did."""
        with self._write() as db:
            return db.execute("UPDATE jobs SET owner_pid = ?, owner_start = ? WHERE job_id = ? AND state = 'PENDING' "
                              "AND owner_pid = ? AND owner_start = ?", (*owner, job_id, *was)).rowcount > 0

    def unfinished(self, owned: bool | None = None, after: bool = False) -> list[JobRecord]:
        """The PENDING and RUNNING jobs, oldest first; with `owned`, only those a process owns, or (False) only
        those none does (the rows waiting in line for no process); with `after`, only those with dependencies
        (rpycdl.server.held: a few, however many rows wait, read without parsing the others; no array's element)."""
        which = {None: "", True: " AND owner_pid != 0", False: " AND owner_pid = 0"}[owned] + (
            """ AND request LIKE '%"after"%' AND array_id IS NULL""" if after else "")
        with self._db() as db:
            return [from_row(row) for row in db.execute(f"{_SELECT} WHERE {LIVE}{which} ORDER BY submitted")]

    def query(self, *, users: Sequence[str] | None = None, states: Sequence[JobState] | None = None,
              since: float | None = None, active_or_ended_since: float | None = None,
              limit: int | None = None) -> list[JobRecord]:
        """Jobs, newest submitted first.

        Args:
            users: only theirs.
            states: only in these states.
            since: only those submitted at or after this time.
            active_or_ended_since: only unfinished ones and those ended at or after this time.
            limit: at most this many (None: all).
        """
        # The default view reads the unfinished and recently ended rows only, whatever the history, through
        # jobs_state and jobs_ended: `+column` keeps the planner from taking another index instead.
        recent = active_or_ended_since is not None
        plus = "+" if recent else ""
        where, params = [f"({LIVE} OR ended >= ?)" if recent else "1"], [active_or_ended_since] if recent else []
        if users is not None:
            where.append(f"{plus}user IN ({', '.join('?' * len(users))})")
            params += users
        if states is not None:
            where.append(f"{plus}state IN ({', '.join('?' * len(states))})")
            params += [JobState(state).value for state in states]
        if since is not None:
            where.append(f"{plus}submitted >= ?")
            params.append(since)
        chosen = f"SELECT rowid FROM jobs WHERE {' AND '.join(where)} ORDER BY {plus}submitted DESC LIMIT ?"
        sql = f"{_SELECT} WHERE rowid IN ({chosen}) ORDER BY submitted DESC"  # sorts ids, then reads rows
        with self._db() as db:
            return [from_row(row) for row in db.execute(sql, (*params, -1 if limit is None else limit))]

    def delete(self, job_id: str) -> JobRecord | None:
        """Remove a finished job's row (its files are the caller's). Returns it, or None if there is no
        such job.

        Raises:
            InvalidRequestError: the job has not finished.
        """
        with self._write() as db:
            record = _one(db, "job_id = ?", job_id)
            if record is not None and not record.state.finished:
                raise InvalidRequestError(f"job {job_id} is {record.state.value}: cancel it first")
            db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
            return record

    def prune(self, ended_before: float, batch: int = 500) -> list[str]:
        """Remove the finished jobs that ended before `ended_before`, `batch` rows a transaction. Returns
        their ids (their files are the caller's to remove)."""
        removed: list[str] = []
        while True:
            with self._write() as db:
                ids = [row[0] for row in db.execute(
                    f"DELETE FROM jobs WHERE job_id IN (SELECT job_id FROM jobs WHERE ended < ? AND NOT {LIVE} "
                    "LIMIT ?) RETURNING job_id", (ended_before, batch))]
            removed += ids
            if len(ids) < batch:
                return removed

    def count(self) -> int:
        """How many jobs the ledger holds."""
        with self._db() as db:
            return db.execute("SELECT count(*) FROM jobs").fetchone()[0]

    def waiting(self, server_id: str, user: str, verified: bool) -> tuple[int, int]:
        """How many jobs accepted by server `server_id` wait (PENDING), and how many of them are `user`'s (as
        verified, or not). The index jobs_waiting covers it."""
        with self._db() as db:
            return db.execute("SELECT count(*), coalesce(sum(user = ? AND user_verified = ?), 0) FROM jobs "
                              "WHERE state = 'PENDING' AND server_id = ?", (user, int(verified), server_id)).fetchone()

    def count_by_state(self) -> dict[JobState, int]:
        """How many jobs the ledger holds in each state (every state, 0 for none)."""
        with self._db() as db:
            counted = dict(db.execute("SELECT state, count(*) FROM jobs GROUP BY state").fetchall())
        return {state: counted.get(state.value, 0) for state in JobState}

    def set_artifacts(self, job_id: str, state: str, files: Sequence[dict[str, Any]], error: str = "") -> None:
        """Record where the job's outputs stand: ARTIFACT_STATES[...], the store's error, and `files` uploaded
        ({"name", "size"}), added to those listed before (one of the same name replaced): the store keeps
        every file a job uploaded, while it ran (rpycdl.save_artifact) or after."""
        if state not in ARTIFACT_STATES:
            raise ValueError(f"not an artifacts state: {state!r}")
        with self._write() as db:
            row = db.execute("SELECT files FROM artifacts WHERE job_id = ?", (job_id,)).fetchone()
            listed = {entry["name"]: entry for entry in json.loads(row[0])} if row else {}
            listed.update((entry["name"], dict(entry)) for entry in files)
            db.execute("INSERT OR REPLACE INTO artifacts VALUES (?, ?, ?, ?, ?)",
                       (job_id, state, json.dumps([listed[name] for name in sorted(listed)]), error, time.time()))

    def artifacts(self, job_id: str) -> dict[str, Any] | None:
        """Where the job's outputs stand (state, files, error, updated), or None: it left none."""
        with self._db() as db:
            row = db.execute("SELECT state, files, error, updated FROM artifacts WHERE job_id = ?",
                             (job_id,)).fetchone()
        if row is None:
            return None
        return {"state": row[0], "files": json.loads(row[1]), "error": row[2], "updated": row[3]}

    def usage_since(self, since: float) -> list[tuple[str, float, float | None, float]]:
        """What the jobs that ran at or after `since` used: (user, started, ended or None, GPUs), GPUs being
        the job's grant (a share's fraction; a whole GPU for a share of a ledger before version 4)."""
        columns = "user, started, ended, gpus, ngpus, share_bytes FROM jobs"
        with self._db() as db:
            rows = db.execute(f"SELECT {columns} WHERE ended >= ? AND started IS NOT NULL UNION ALL "
                              f"SELECT {columns} WHERE {LIVE} AND started IS NOT NULL", (since,)).fetchall()
        return [(user, started, ended, gpus or (1.0 if share_bytes else float(ngpus)))
                for user, started, ended, gpus, ngpus, share_bytes in rows]

    def ended_since(self, since: float, known: Container[str] = ()) -> list[JobRecord]:
        """The jobs that ended at or after `since`, in the order they ended, but those whose ids are in
        `known` (skipped before their rows are decoded: a caller re-reading a window pays little for
        the rows it has)."""
        with self._db() as db:
            rows = db.execute(f"{_SELECT} WHERE ended >= ? ORDER BY ended", (since,))
            return [from_row(row) for row in rows if row[_JOB_ID] not in known]


@functools.cache
def _empty() -> sqlite3.Connection:
    """An empty ledger in memory, what a reader reads while no server has made the ledger yet."""
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db.execute("BEGIN")
    migrate(db, Path(":memory:"))
    db.execute("COMMIT")
    return db


def _into_wal(db: sqlite3.Connection) -> None:
    """Put a new database in WAL mode. The switch takes SQLite's exclusive lock and does not wait for it
    as writes do: processes opening a new ledger at once retry it, LEDGER_BUSY_TIMEOUT at most."""
    deadline = time.monotonic() + LEDGER_BUSY_TIMEOUT
    while db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _one(db: sqlite3.Connection, where: str, *params: Any) -> JobRecord | None:
    row = db.execute(f"{_SELECT} WHERE {where}", params).fetchone()
    return None if row is None else from_row(row)


def _holds(entry: Path) -> bool:
    """Whether an entry of a state directory holds anything: a file, or a directory holding one (jobs/
    keeps jobs/.unrecorded, empty, once all its jobs are gone)."""
    return entry.is_symlink() or not entry.is_dir() or any(_holds(inner) for inner in entry.iterdir())


_LEDGERS: weakref.WeakSet[Ledger] = weakref.WeakSet()
_FORKING: list[Ledger] = []
_INHERITED: list[sqlite3.Connection] = []  # a parent's connections, kept from being closed (or collected)


def _before_fork() -> None:
    """Close every ledger's connection before os.fork(), holding its lock until the fork is done."""
    _FORKING[:] = list(_LEDGERS)
    for ledger in _FORKING:
        ledger._lock.acquire()
        ledger._close()


def _after_fork() -> None:
    for ledger in _FORKING:
        ledger._lock.release()
    _FORKING.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)
