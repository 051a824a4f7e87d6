"""The job ledger (rpycdl.scheduler.ledger) on real SQLite files: rows, guarded transitions, names,
cancels, deletes, prunes, queries, the ledgers it refuses, forks, and a property test against a model."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import stat
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpycdl.defaults import LEDGER_BUSY_TIMEOUT, REFUSAL_BUSY_TIMEOUT
from rpycdl.errors import InvalidRequestError, LedgerError
from rpycdl.scheduler.jobrecord import to_row
from rpycdl.scheduler.ledger import UNFINISHED, JobRecord, JobState, Ledger, new_job_id
from rpycdl.scheduler.schema import LIVE, MIGRATIONS

FINAL = [state for state in JobState if state.finished]


@pytest.fixture
def ledger(tmp_path) -> Ledger:
    return Ledger(tmp_path / "state")


def job(**fields) -> JobRecord:
    fields.setdefault("job_id", new_job_id())
    return JobRecord(server_id="server-1", client="127.0.0.1:40000", ngpus=1, **fields)


def statements(ledger: Ledger) -> list[str]:
    """The statements the ledger's connection in this process runs from now on (SQLite's trace)."""
    ledger.count()  # opens it
    seen: list[str] = []
    ledger._conn.set_trace_callback(seen.append)
    return seen


def test_a_row_keeps_every_field(ledger):
    record = JobRecord(
        job_id=new_job_id(), server_id="srv-7", client="10.0.0.2:5555", ngpus=2, share_bytes=1024**3,
        state=JobState.RUNNING, owner_pid=123, owner_start=456, pgid=789, leader_start=1011,
        gpu_uuids=["GPU-a", "GPU-b"], submitted=1000.5, started=1001.25, ended=1002.75, error="boom",
        error_type="ValueError", exit_code=3, user="alice", user_verified=True, name="train", detached=True,
        kind="command", service="pytorch", server="gpu1:18861",
        request={"timeout": 60.0, "command": ["python", "-c", "print('é')"], "env": {"A": None}},
        log_bytes=77, result_bytes=88, cancel_requested=False, gpus=0.5, result_nonce="ab" * 16,
        result_key_id="cd" * 8, peak_memory=3 * 1024**3 + 1, cpu_seconds=12.25, max_procs=17, attempt=3,
        array_id="a1b2c3d4e5f6", array_index=7, priority=-3)
    defaults = JobRecord(job_id="x", server_id="", client="", ngpus=0)
    unset = [f.name for f in dataclasses.fields(JobRecord)
             if getattr(record, f.name) == getattr(defaults, f.name) and f.name != "cancel_requested"]
    assert not unset, f"give these fields a value of their own: {unset}"
    assert ledger.save(record)
    assert ledger.get(record.job_id) == record
    assert JobRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    assert record.to_dict()["state"] == "RUNNING"
    assert JobRecord.from_dict({**record.to_dict(), "added_by_a_newer_rpycdl": 1}) == record
    assert ledger.get("nosuchjob") is None
    assert ledger.count() == 1
    assert LIVE == f"state IN ({', '.join(repr(state.value) for state in UNFINISHED)})"


def test_a_finished_record_gets_an_end_time(ledger):
    record = job(state=JobState.FAILED)
    before = time.time()
    assert ledger.save(record)
    assert before <= record.ended <= time.time()
    assert ledger.get(record.job_id).ended == record.ended


def test_a_finished_row_never_changes(ledger):
    record = job(state=JobState.RUNNING)
    assert ledger.save(record)
    record.state, record.exit_code = JobState.SUCCEEDED, 0
    assert ledger.save(record)
    stored = ledger.get(record.job_id)
    for late in (JobState.RUNNING, JobState.FAILED, JobState.SUCCEEDED):
        assert not ledger.save(dataclasses.replace(record, state=late, error="late", log_bytes=5))
    assert not ledger.end(record.job_id, JobState.LOST, "swept")
    assert ledger.request_cancel(record.job_id) == stored
    assert ledger.get(record.job_id) == stored


def test_the_sweep_or_the_owner_wins_and_each_knows(ledger):
    record = job(state=JobState.RUNNING)
    ledger.save(record)
    assert ledger.end(record.job_id, JobState.LOST, "its supervisor died", "JobLostError")
    assert not ledger.save(dataclasses.replace(record, state=JobState.SUCCEEDED))  # the owner lost
    swept = ledger.get(record.job_id)
    assert (swept.state, swept.error, swept.error_type) == (JobState.LOST, "its supervisor died", "JobLostError")
    assert swept.ended is not None
    assert not ledger.end(record.job_id, JobState.FAILED, "again")
    assert not ledger.end("nosuchjob", JobState.FAILED, "gone")
    with pytest.raises(ValueError, match="final state"):
        ledger.end(record.job_id, JobState.RUNNING, "")


def test_an_unfinished_name_is_one_users_once(ledger):
    first = job(user="alice", name="train")
    assert ledger.save(first)
    assert ledger.save(first)  # its own name again
    second = job(user="alice", name="train")
    with pytest.raises(InvalidRequestError) as refused:
        ledger.save(second)
    assert "'train'" in str(refused.value) and first.job_id in str(refused.value)
    assert "choose another name=, or cancel it" in str(refused.value)
    assert ledger.get(second.job_id) is None
    assert ledger.save(job(user="bob", name="train"))  # another user's
    assert ledger.save(job(user="alice")) and ledger.save(job(user="alice"))  # unnamed
    assert ledger.save(job(user="alice", name="train", state=JobState.FAILED))  # a finished one
    ledger.end(first.job_id, JobState.CANCELLED, "by alice")
    assert ledger.save(second)  # the name is free again


def test_find_by_id_then_the_unfinished_then_the_latest_of_a_name(ledger):
    old = job(user="alice", name="n", state=JobState.SUCCEEDED, submitted=100.0)
    live = job(user="alice", name="n", state=JobState.RUNNING, submitted=200.0)
    newer = job(user="alice", name="n", state=JobState.FAILED, submitted=300.0)
    for record in (old, live, newer):
        ledger.save(record)
    assert ledger.find("n", "alice").job_id == live.job_id
    assert ledger.find(old.job_id, "bob").job_id == old.job_id  # an id is anyone's
    ledger.end(live.job_id, JobState.CANCELLED, "")
    assert ledger.find("n", "alice").job_id == newer.job_id
    assert ledger.find("n", "bob") is None
    assert ledger.find("nosuchjob", "alice") is None


def test_a_cancel_request_marks_only_unfinished_rows_and_stays(ledger):
    assert ledger.request_cancel("nosuchjob") is None
    record = job(state=JobState.PENDING)
    ledger.save(record)
    assert not ledger.cancel_requested(record.job_id)
    assert ledger.request_cancel(record.job_id) == record  # as it was
    assert ledger.cancel_requested(record.job_id)
    record.state = JobState.RUNNING
    assert ledger.save(record)  # record.cancel_requested is False: save() never clears the flag
    assert ledger.cancel_requested(record.job_id) and ledger.get(record.job_id).cancel_requested
    assert ledger.request_cancel(record.job_id).cancel_requested
    done = job(state=JobState.SUCCEEDED)
    ledger.save(done)
    assert ledger.request_cancel(done.job_id) == done
    assert not ledger.cancel_requested(done.job_id)
    assert not ledger.cancel_requested("nosuchjob")


def test_delete_takes_only_finished_rows(ledger):
    live, done = job(state=JobState.RUNNING), job(state=JobState.TIMED_OUT)
    ledger.save(live)
    ledger.save(done)
    with pytest.raises(InvalidRequestError, match=f"job {live.job_id} is RUNNING: cancel it first"):
        ledger.delete(live.job_id)
    assert ledger.delete(done.job_id) == done
    assert ledger.get(done.job_id) is None and ledger.get(live.job_id) is not None
    assert ledger.delete(done.job_id) is None


def test_prune_removes_old_finished_rows_in_short_transactions(ledger):
    old = [job(state=JobState.SUCCEEDED, submitted=10.0, ended=50.0 + i) for i in range(10)]
    recent = [job(state=JobState.FAILED, submitted=10.0, ended=500.0 + i) for i in range(3)]
    live = [job(state=state, submitted=1.0) for state in UNFINISHED]
    for record in old + recent + live:
        ledger.save(record)
    seen = statements(ledger)
    assert sorted(ledger.prune(100.0, batch=3)) == sorted(record.job_id for record in old)
    assert seen.count("BEGIN IMMEDIATE") == 4  # 3 + 3 + 3 + 1
    assert {r.job_id for r in ledger.query()} == {r.job_id for r in recent + live}
    assert ledger.prune(100.0) == []


def test_query_filters_newest_first(ledger):
    now = time.time()
    rows = {
        "a1": job(user="alice", state=JobState.SUCCEEDED, submitted=now - 5000, ended=now - 4000),
        "a2": job(user="alice", state=JobState.RUNNING, submitted=now - 4500),
        "b1": job(user="bob", state=JobState.FAILED, submitted=now - 3000, ended=now - 100),
        "b2": job(user="bob", state=JobState.PENDING, submitted=now - 50),
        "c1": job(user="carol", state=JobState.CANCELLED, submitted=now - 40, ended=now - 30),
    }
    for record in rows.values():
        ledger.save(record)
    names = {record.job_id: name for name, record in rows.items()}

    def query(**kwargs) -> list[str]:
        return [names[record.job_id] for record in ledger.query(**kwargs)]

    assert query() == ["c1", "b2", "b1", "a2", "a1"]
    assert query(limit=2) == ["c1", "b2"]
    assert query(users=["alice", "carol"]) == ["c1", "a2", "a1"]
    assert query(users=[]) == []
    assert query(states=[JobState.RUNNING, JobState.FAILED]) == ["b1", "a2"]
    assert query(since=now - 3000) == ["c1", "b2", "b1"]
    assert query(active_or_ended_since=now - 1000) == ["c1", "b2", "b1", "a2"]
    assert query(active_or_ended_since=now - 1000, users=["alice", "bob"], states=list(FINAL)) == ["b1"]
    assert query(active_or_ended_since=now - 1000, since=now - 4600, limit=3) == ["c1", "b2", "b1"]
    assert [r.job_id for r in ledger.unfinished()] == [rows["a2"].job_id, rows["b2"].job_id]


def test_a_missing_ledger_is_never_started_over_a_history(tmp_path):
    state = tmp_path / "state"
    (state / "jobs" / "0123456789ab").mkdir(parents=True)
    (state / "jobs" / "0123456789ab" / "log").write_text("hello\n")
    with pytest.raises(LedgerError, match="missing") as refused:
        Ledger(state)
    assert str(state / Ledger.FILE) in str(refused.value)
    assert not (state / Ledger.FILE).exists()
    empty = tmp_path / "empty"
    (empty / "jobs" / ".unrecorded").mkdir(parents=True)  # directories with nothing in them are no history
    assert Ledger(empty).count() == 0


def test_a_corrupted_ledger_is_refused(tmp_path):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / Ledger.FILE).write_bytes(os.urandom(8192))
    with pytest.raises(LedgerError, match="corrupted") as refused:
        Ledger(tmp_path / "garbage")
    assert str(tmp_path / "garbage" / Ledger.FILE) in str(refused.value)
    damaged = Ledger(tmp_path / "damaged")
    for i in range(300):
        damaged.save(job(state=JobState.SUCCEEDED, request={"pad": "x" * 200}, submitted=float(i)))
    damaged.close()  # the last connection: its pages go from the WAL to the file
    with open(damaged.path, "r+b") as file:
        file.seek(3 * 4096)
        file.write(os.urandom(4 * 4096))
    with pytest.raises(LedgerError, match="corrupted") as refused:
        Ledger(tmp_path / "damaged")
    assert str(damaged.path) in str(refused.value)


def test_a_ledger_of_a_newer_rpycdl_is_refused(tmp_path):
    path = Ledger(tmp_path).path
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    db.close()
    with pytest.raises(LedgerError, match="written by a newer rpycdl") as refused:
        Ledger(tmp_path)
    assert str(path) in str(refused.value)


def test_a_new_ledger_is_writable_by_every_user_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        ledger = Ledger(tmp_path / "state")
        ledger.save(job())
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o777
    for suffix in ("", "-wal", "-shm"):
        assert stat.S_IMODE(Path(f"{ledger.path}{suffix}").stat().st_mode) == 0o666, suffix
    assert Ledger(tmp_path / "state").ledger_id == ledger.ledger_id
    assert len(ledger.ledger_id) == 32


def _locks_held_on(path: Path) -> int:
    """How many fcntl locks this process holds on `path` (Linux's /proc/locks)."""
    inode = f":{os.stat(path).st_ino} "
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if f" {os.getpid()} " in line and inode in line)


def _waited(pid: int, deadline: float = 60) -> int:
    """A forked child's wait status, within `deadline` seconds: one stuck past it (a lock held at the fork) is killed
    and fails the test, rather than hang the suite."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"a forked child (pid {pid}) was still running after {deadline:g} s: stuck on a lock held at the fork?")


def _child(ledger: Ledger, record: JobRecord) -> None:
    code = 1
    try:
        record.state = JobState.SUCCEEDED
        assert ledger.save(record)
        assert ledger.get(record.job_id).state == JobState.SUCCEEDED
        assert _locks_held_on(ledger.path) > 0, "the child's connection must take its own locks"
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def test_a_forked_child_uses_the_ledger_with_a_connection_of_its_own(ledger):
    """Forks while another thread of the parent writes: each child writes through a connection of its
    own, and the parent goes on (os.fork closes the parent's connection, under its lock)."""
    stop = threading.Event()
    written: list[bool] = []

    def write() -> None:
        while not stop.is_set():
            written.append(ledger.save(job(state=JobState.RUNNING)))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(5):
            record = job(state=JobState.RUNNING)
            assert ledger.save(record)
            pid = os.fork()
            if pid == 0:
                _child(ledger, record)
            assert _waited(pid) == 0
            assert ledger.get(record.job_id).state == JobState.SUCCEEDED
    finally:
        stop.set()
        writer.join()
    assert written and all(written)
    assert _locks_held_on(ledger.path) > 0
    with sqlite3.connect(ledger.path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()


# -- a property test against a model ----------------------------------------------------------------

SLOTS = 5
"""Job ids the operations pick from, so that they meet the same rows."""

operation = st.one_of(
    st.tuples(st.just("save"), st.integers(0, SLOTS - 1), st.sampled_from(list(JobState)),
              st.sampled_from(["alice", "bob"]), st.sampled_from([None, "a", "b"]), st.integers(0, 9)),
    st.tuples(st.just("end"), st.integers(0, SLOTS - 1), st.sampled_from(FINAL)),
    st.tuples(st.just("cancel"), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("delete"), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("prune"), st.integers(0, 10)),
    st.tuples(st.just("query"), st.none() | st.sets(st.sampled_from(["alice", "bob", "carol"])),
              st.none() | st.sets(st.sampled_from(list(JobState))), st.none() | st.integers(0, SLOTS),
              st.none() | st.integers(0, 10), st.none() | st.integers(0, SLOTS)),
)


class Model:
    """What the ledger should hold: rows by id, as JobRecords."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.rows: dict[str, JobRecord] = {}
        self.frozen: dict[str, JobRecord] = {}  # finished rows as they were when first seen finished

    def save(self, slot: int, state: JobState, user: str, name: str | None, when: int) -> None:
        record = job(job_id=f"job{slot}", state=state, user=user, name=name, submitted=float(slot),
                     ended=float(when) if state.finished else None)
        old = self.rows.get(record.job_id)
        clash = [other for other in self.rows.values() if other.job_id != record.job_id and not state.finished
                 and name is not None and (other.user, other.name) == (user, name) and not other.state.finished]
        if (old is None or not old.state.finished) and clash:
            with pytest.raises(InvalidRequestError, match=clash[0].job_id):
                self.ledger.save(record)
            return
        assert self.ledger.save(record) == (old is None or not old.state.finished)
        if old is None or not old.state.finished:
            record.cancel_requested = old is not None and old.cancel_requested
            self.rows[record.job_id] = record

    def end(self, slot: int, state: JobState) -> None:
        old = self.rows.get(f"job{slot}")
        changed = old is not None and not old.state.finished
        assert self.ledger.end(f"job{slot}", state, "swept", "LostError") == changed
        if changed:
            self.rows[old.job_id] = dataclasses.replace(old, state=state, error="swept", error_type="LostError",
                                                        ended=self.ledger.get(old.job_id).ended)

    def cancel(self, slot: int) -> None:
        old = self.rows.get(f"job{slot}")
        assert self.ledger.request_cancel(f"job{slot}") == old
        if old is not None and not old.state.finished:
            self.rows[old.job_id] = dataclasses.replace(old, cancel_requested=True)

    def delete(self, slot: int) -> None:
        old = self.rows.get(f"job{slot}")
        if old is not None and not old.state.finished:
            with pytest.raises(InvalidRequestError, match="cancel it first"):
                self.ledger.delete(old.job_id)
            return
        assert self.ledger.delete(f"job{slot}") == old
        self.rows.pop(f"job{slot}", None)

    def prune(self, cut: int) -> None:
        gone = {job_id for job_id, row in self.rows.items() if row.state.finished and row.ended < cut}
        assert set(self.ledger.prune(float(cut), batch=2)) == gone
        for job_id in gone:
            del self.rows[job_id]

    def query(self, users, states, since, recent, limit) -> None:
        expected = sorted((row for row in self.rows.values()
                           if (users is None or row.user in users) and (states is None or row.state in states)
                           and (since is None or row.submitted >= since)
                           and (recent is None or not row.state.finished or row.ended >= recent)),
                          key=lambda row: -row.submitted)[:limit]
        got = self.ledger.query(users=None if users is None else sorted(users),
                                states=None if states is None else list(states), since=since,
                                active_or_ended_since=recent, limit=limit)
        assert got == expected

    def check(self) -> None:
        stored = self.ledger.query()
        assert {row.job_id: row for row in stored} == self.rows
        names = [(row.user, row.name) for row in stored if not row.state.finished and row.name is not None]
        assert len(names) == len(set(names)), "two unfinished jobs of one name"
        for row in stored:
            if row.state.finished:
                assert self.frozen.setdefault(row.job_id, row) == row, "a finished row changed"
        self.frozen = {job_id: row for job_id, row in self.frozen.items() if job_id in self.rows}
        assert [row.job_id for row in self.ledger.unfinished()] == sorted(
            job_id for job_id, row in self.rows.items() if not row.state.finished)


@settings(max_examples=settings.default.max_examples * 3 // 5, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, max_size=30))
def test_any_sequence_of_operations_keeps_the_invariants(operations):
    with tempfile.TemporaryDirectory() as state:
        ledger = Ledger(state)
        model = Model(ledger)
        for name, *args in operations:
            getattr(model, name)(*args)
            model.check()
        ledger.close()


def test_an_existing_state_directory_keeps_the_mode_its_site_gave_it(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o2770)  # a group's, so that other local users cannot read the jobs' files
    Ledger(state).save(job())
    assert stat.S_IMODE(state.stat().st_mode) == 0o2770


def test_counts_by_state_and_the_jobs_ended_since(ledger):
    for state, ended in ((JobState.SUCCEEDED, 100.0), (JobState.FAILED, 200.0), (JobState.SUCCEEDED, 300.0),
                         (JobState.RUNNING, None)):
        ledger.save(job(state=state, ended=ended, submitted=50.0))
    counts = ledger.count_by_state()
    assert counts[JobState.SUCCEEDED] == 2 and counts[JobState.FAILED] == 1 and counts[JobState.RUNNING] == 1
    assert counts[JobState.LOST] == 0 and set(counts) == set(JobState)
    ended = ledger.ended_since(200.0)
    assert [record.ended for record in ended] == [200.0, 300.0]
    assert [record.ended for record in ledger.ended_since(0.0, known={ended[0].job_id})] == [100.0, 300.0]


def test_refusals_are_counted_by_service_and_reason_in_one_statement_each(ledger, caplog):
    assert ledger.refusals() == {}
    for service, reason in [("pytorch", "invalid"), ("pytorch", "invalid"), ("pytorch", "limit"),
                            ("tensorflow", "auth"), ("pytorch", "not_allowed"), ("tensorflow", "connections")]:
        ledger.count_refusal(service, reason)
    assert ledger.refusals() == {("pytorch", "invalid"): 2, ("pytorch", "limit"): 1, ("pytorch", "not_allowed"): 1,
                                 ("tensorflow", "auth"): 1, ("tensorflow", "connections"): 1}
    seen = statements(ledger)
    ledger.count_refusal("pytorch", "limit")
    assert [s for s in seen if not s.startswith("PRAGMA")] == [
        "BEGIN IMMEDIATE", "INSERT INTO refusals VALUES ('pytorch', 'limit', 1) ON CONFLICT (service, reason) DO "
        "UPDATE SET count = count + excluded.count", "COMMIT"]
    ledger.count_refusal("pytorch", "whatever")  # a bug of the caller's: logged, never raised, never a label
    assert "not counted" in caplog.text and "whatever" in caplog.text
    assert ledger.refusals()[("pytorch", "limit")] == 2 and len(ledger.refusals()) == 5


def test_counting_a_refusal_never_raises_nor_waits_long_for_a_stuck_writer(ledger, caplog, tmp_path, monkeypatch):
    busy = REFUSAL_BUSY_TIMEOUT / 5  # the bound that counts is the constant's; a fifth of it keeps the unit tier quick
    monkeypatch.setattr("rpycdl.scheduler.tallies.REFUSAL_BUSY_TIMEOUT", busy)
    other = sqlite3.connect(ledger.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process in the middle of a write, for as long as it likes
    try:
        started = time.monotonic()
        ledger.count_refusal("pytorch", "limit")
        assert time.monotonic() - started < busy + 1
        assert "not counted" in caplog.text and "locked" in caplog.text
    finally:
        other.execute("ROLLBACK")
        other.close()
    with ledger._db() as db:  # the other writes wait as long as ever
        assert db.execute("PRAGMA busy_timeout").fetchone()[0] == LEDGER_BUSY_TIMEOUT * 1000
    ledger.count_refusal("pytorch", "limit")
    assert ledger.refusals() == {("pytorch", "limit"): 1}
    broken = Ledger(tmp_path / "broken")
    with broken._db() as db:
        db.execute("DROP TABLE refusals")  # any other error of SQLite's
    broken.count_refusal("pytorch", "auth")
    assert "no such table: refusals" in caplog.text


def test_refusals_counted_at_once_by_processes_and_threads_are_all_counted(ledger):
    def count(times: int) -> None:
        for _ in range(times):
            ledger.count_refusal("pytorch", "connections")

    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            try:
                count(50)
            finally:
                os._exit(0)
        pids.append(pid)
    threads = [threading.Thread(target=count, args=(50,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(_waited(pid) == 0 for pid in pids)
    assert ledger.refusals() == {("pytorch", "connections"): 400}


def test_a_version_1_ledger_gains_the_refusals_artifacts_gpus_drops_and_seals_and_keeps_its_rows(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    record = job(state=JobState.SUCCEEDED, user="alice", name="train", ended=1000.0, request={"timeout": 5.0})
    with sqlite3.connect(state / Ledger.FILE) as db:  # as rpycdl made it before the refusals were counted
        db.executescript(MIGRATIONS[0])
        db.execute("PRAGMA user_version = 1")
        db.execute("INSERT INTO meta VALUES ('ledger_id', 'the-old-ledgers-id')")
        row = {column: value for column, value in to_row(record).items()
               if column not in ("gpus", "cancel_requested", "result_nonce", "result_key_id", "peak_memory",
                                 "cpu_seconds", "max_procs", "attempt", "array_id", "array_index", "priority")}
        db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join(':' + column for column in row)})", row)
    db.close()
    ledger = Ledger(state)
    assert ledger.ledger_id == "the-old-ledgers-id"
    assert ledger.get(record.job_id) == record and ledger.count() == 1
    with ledger._db() as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 12
        assert db.execute("SELECT name FROM sqlite_master WHERE name = 'refusals'").fetchone() == ("refusals",)
        plan = " ".join(row[-1] for row in db.execute(
            "EXPLAIN QUERY PLAN SELECT count(*) FROM jobs WHERE state = 'PENDING' AND server_id = 'x'"))
        assert "jobs_waiting" in plan, plan  # a submit counts the waiting jobs by the index version 7 made
    assert ledger.artifacts(record.job_id) is None
    assert ledger.refusals() == {}
    ledger.count_refusal("pytorch", "auth")
    assert Ledger(state).refusals() == {("pytorch", "auth"): 1}  # opened again: nothing runs twice
    assert ledger.drops() == {}
    ledger.count_drops("pytorch", {"grace": 3, "per_source": 1})
    ledger.count_drops("pytorch", {"grace": 2})
    ledger.count_refusal("pytorch", "auth", 4)
    assert Ledger(state).drops() == {("pytorch", "grace"): 5, ("pytorch", "per_source"): 1}
    assert Ledger(state).refusals() == {("pytorch", "auth"): 5}
    ledger.count_drops("pytorch", {"whatever": 1})  # a bug of the caller's: logged, never raised, never a label
    assert len(Ledger(state).drops()) == 2
    assert Ledger(state).get(record.job_id) == record
    ledger.set_artifacts(record.job_id, "uploaded", [])
    assert Ledger(state).artifacts(record.job_id)["state"] == "uploaded"


def test_a_version_7_ledger_gains_the_measures_of_a_jobs_end_unmeasured_for_its_rows(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    old = job(state=JobState.SUCCEEDED, ended=1000.0)
    live = job(state=JobState.RUNNING, started=1000.0)
    with sqlite3.connect(state / Ledger.FILE) as db:  # as rpycdl made it before it measured jobs' cgroups
        for script in MIGRATIONS[:7]:
            db.executescript(script)
        db.execute("PRAGMA user_version = 7")
        db.execute("INSERT INTO meta VALUES ('ledger_id', 'a-version-7-ledger')")
        for record in (old, live):
            row = {column: value for column, value in to_row(record).items()
                   if column not in ("peak_memory", "cpu_seconds", "max_procs", "attempt", "array_id", "array_index",
                                     "priority")}
            db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join(':' + c for c in row)})", row)
    db.close()
    ledger = Ledger(state)
    assert ledger.ledger_id == "a-version-7-ledger"
    read = ledger.get(old.job_id)
    assert read == old and (read.peak_memory, read.cpu_seconds, read.max_procs) == (None, None, None)
    with ledger._db() as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        types = {name: kind for _, name, kind, *_ in db.execute("PRAGMA table_info(jobs)")}
    assert (types["peak_memory"], types["cpu_seconds"], types["max_procs"]) == ("INTEGER", "REAL", "INTEGER")
    measured = dataclasses.replace(live, state=JobState.SUCCEEDED, ended=1010.0, peak_memory=2**40 + 3,
                                   cpu_seconds=3601.5, max_procs=1)
    assert ledger.save(measured)
    assert Ledger(state).get(live.job_id) == measured  # opened again: nothing runs twice, the values kept exact
    assert [r.peak_memory for r in ledger.ended_since(0)] == [None, 2**40 + 3]


def test_artifacts_are_recorded_apart_and_go_with_their_job(ledger):
    done = job(state=JobState.SUCCEEDED, ended=100.0)
    ledger.save(done)
    assert ledger.artifacts(done.job_id) is None
    ledger.set_artifacts(done.job_id, "failed", [], "the store is down")
    ledger.set_artifacts(done.job_id, "uploaded", [{"name": "model.pt", "size": 3}])
    entry = ledger.artifacts(done.job_id)
    assert entry is not None and entry["state"] == "uploaded" and entry["error"] == ""
    assert entry["files"] == [{"name": "model.pt", "size": 3}]
    ledger.set_artifacts(done.job_id, "uploading", [])  # a later upload keeps what is listed
    ledger.set_artifacts(done.job_id, "failed", [{"name": "ckpt.pt", "size": 5}, {"name": "model.pt", "size": 4}],
                         "the store is down")
    entry = ledger.artifacts(done.job_id)
    assert entry["state"] == "failed" and entry["error"] == "the store is down"
    assert entry["files"] == [{"name": "ckpt.pt", "size": 5}, {"name": "model.pt", "size": 4}]  # replaced by name
    assert ledger.get(done.job_id) == done  # the finished row is as it was
    with pytest.raises(ValueError, match="artifacts state"):
        ledger.set_artifacts(done.job_id, "lost", [])
    ledger.delete(done.job_id)
    assert ledger.artifacts(done.job_id) is None
