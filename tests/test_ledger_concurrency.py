"""The job ledger under many writers at once, a reader holding a snapshot, and 100 000 rows: no write
lost or doubled, one winner for every end, writers never wait for readers, and the queries clients
make use indexes whatever the history."""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import sqlite3
import threading
import time
import traceback

import pytest

from rpycdl.defaults import LEDGER_BUSY_TIMEOUT
from rpycdl.errors import LedgerError
from rpycdl.scheduler import jobrecord
from rpycdl.scheduler import ledger as ledger_module
from rpycdl.scheduler.ledger import JobRecord, JobState, Ledger

CTX = multiprocessing.get_context("fork")
WRITERS = 8
JOBS_EACH = 200


def _writer(state_dir: str, number: int, out) -> None:
    """Save jobs of its own, finish them, and race to end() everyone's: report what each write said."""
    try:
        ledger, rng = Ledger(state_dir), random.Random(number)
        mine, won, lost = [], [], []
        for index in range(JOBS_EACH):
            record = JobRecord(f"w{number}j{index}", "server", "client", 1, user=f"user{number % 3}",
                               name=rng.choice([None, f"n{index % 5}"]), state=JobState.RUNNING)
            try:
                ledger.save(record)
            except Exception as exc:  # noqa: BLE001 - a name taken by an unfinished job: checked below
                assert "already has an unfinished job" in str(exc), exc
                continue
            mine.append(record.job_id)
            others = [f"w{rng.randrange(WRITERS)}j{rng.randrange(index + 1)}" for _ in range(2)]
            for other in others:  # as a sweep would
                (won if ledger.end(other, JobState.LOST, f"by {number}") else lost).append(other)
            record.state = rng.choice([JobState.SUCCEEDED, JobState.FAILED])
            (won if ledger.save(record) else lost).append(record.job_id)
            ledger.query(users=[record.user], limit=20)
        out.put(("ok", number, mine, won))
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put(("error", number, traceback.format_exc(), []))


@pytest.mark.slow
def test_eight_processes_writing_at_once_lose_nothing_and_each_end_has_one_winner(tmp_path):
    state = str(tmp_path / "state")
    Ledger(state).close()
    out = CTX.Queue()
    workers = [CTX.Process(target=_writer, args=(state, n, out), daemon=True) for n in range(WRITERS)]
    for worker in workers:
        worker.start()
    reports = [out.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(10)
    errors = [report[2] for report in reports if report[0] != "ok"]
    assert not errors, errors[0]
    ledger = Ledger(state)
    rows = {record.job_id: record for record in ledger.query()}
    saved = [job for _, _, mine, _ in reports for job in mine]
    assert sorted(rows) == sorted(saved), "a saved job is missing, or one appeared twice"
    wins = [job for _, _, _, won in reports for job in won]
    assert sorted(wins) == sorted(saved), "every job must be ended exactly once, by its owner or a sweep"
    assert all(row.state.finished and row.ended is not None for row in rows.values())
    with sqlite3.connect(ledger.path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


def test_a_reader_holding_a_snapshot_never_blocks_a_writer(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.save(JobRecord("first", "server", "client", 1))
    reader = sqlite3.connect(ledger.path, isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM jobs").fetchone()[0] == 1  # holds its snapshot from here
    failed: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(50):
                ledger.save(JobRecord(f"j{i}", "s", "c", 1))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            failed.append(exc)

    # A write that waited for the reader (it holds its snapshot until after the join) would fail after the
    # ledger's busy timeout: the join may last as long as a busy machine needs for the 50 writes.
    writer = threading.Thread(target=write)
    writer.start()
    writer.join(LEDGER_BUSY_TIMEOUT * 2)
    assert not writer.is_alive() and not failed, f"a write waited for a reader: {failed}"
    assert reader.execute("SELECT count(*) FROM jobs").fetchone()[0] == 1  # its snapshot, unchanged
    reader.execute("COMMIT")
    assert ledger.count() == 51
    reader.close()


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Ledger:
    """A ledger of 100 000 finished jobs over 30 days and 200 users, and a few unfinished."""
    ledger = Ledger(tmp_path_factory.mktemp("history"))
    rng, now = random.Random(7), time.time()
    finished = [state for state in JobState if state.finished]
    rows = []
    for index in range(100_000):
        submitted = now - rng.uniform(0, 30 * 86400)
        rows.append(JobRecord(f"old{index}", "server", "client", 1, user=f"user{index % 200}",
                              name=f"sweep{index % 50}", state=rng.choice(finished), submitted=submitted,
                              ended=submitted + rng.uniform(1, 7200)))
    rows += [JobRecord(f"live{index}", "server", "client", 1, user="alice", state=JobState.RUNNING)
             for index in range(10)]
    with ledger._write() as db:
        db.executemany(ledger_module._UPSERT, [jobrecord.to_row(row) for row in rows])
    return ledger


def _plans(ledger: Ledger, query) -> list[str]:
    """The query plans of the statements `query(ledger)` runs (SQLite's EXPLAIN QUERY PLAN)."""
    ledger.count()
    seen: list[str] = []
    ledger._conn.set_trace_callback(seen.append)
    try:
        query(ledger)
    finally:
        ledger._conn.set_trace_callback(None)
    return [" / ".join(row[3] for row in ledger._conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
            for sql in seen if sql.startswith(("SELECT", "DELETE"))]


@pytest.mark.parametrize("query", [
    lambda ledger: ledger.query(active_or_ended_since=time.time() - 86400, limit=100),  # `rpycdl jobs`
    lambda ledger: ledger.query(users=["user7"], active_or_ended_since=time.time() - 86400, limit=100),
    lambda ledger: ledger.query(limit=100),  # --all
    lambda ledger: ledger.query(users=["user7"], limit=100),
    lambda ledger: ledger.query(states=[JobState.FAILED], since=time.time() - 3600, limit=100),
    lambda ledger: ledger.unfinished(),
    lambda ledger: ledger.find("sweep3", "user3"),
    lambda ledger: ledger.prune(time.time() - 40 * 86400),
], ids=["default", "user-recent", "all", "user-all", "failed-last-hour", "unfinished", "find", "prune"])
def test_the_queries_clients_make_use_an_index_whatever_the_history(history, query):
    plans = _plans(history, query)
    assert plans, "the query ran no SELECT"
    scans = [plan for plan in plans if re.search(r"SCAN jobs(?! USING)", plan)]
    assert not scans, f"a full scan of 100 000 rows: {scans}"
    assert history.count() >= 100_000


def test_the_default_view_reads_only_the_recent_rows(history):
    """With 100 000 rows, `rpycdl jobs` gets the unfinished and the last day's, newest first, in one pass."""
    recent = history.query(active_or_ended_since=time.time() - 86400)
    assert [row.submitted for row in recent] == sorted((row.submitted for row in recent), reverse=True)
    assert {row.job_id for row in recent if not row.state.finished} == {f"live{i}" for i in range(10)}
    assert all(row.ended >= time.time() - 86400 - 5 for row in recent if row.state.finished)
    assert 1000 < len(recent) < 20_000


def _open_at(state: str, go: int) -> None:
    """In a forked process: wait until `go` (a pipe's read end) reaches its end, then open the ledger."""
    os.read(go, 1)
    try:
        Ledger(state).count()
    except LedgerError as exc:
        os.write(2, f"{exc}\n".encode())
        os._exit(1)
    os._exit(0)


def test_processes_making_one_new_ledger_at_once_all_open_it(tmp_path):
    """Servers and monitors of a host often start together on a new state directory: none may take the
    ledger another is making for a lost one."""
    for round_ in range(20):
        state, pids = str(tmp_path / f"state{round_}"), []
        go, start = os.pipe()  # closed once all eight are forked, however long that took: they start together
        for _ in range(8):
            pid = os.fork()
            if pid == 0:
                os.close(start)
                _open_at(state, go)
            pids.append(pid)
        os.close(go)
        os.close(start)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        assert codes == [0] * 8, f"round {round_}: {codes.count(1)} of 8 refused the new ledger"
