"""A job's files (rpycdl.scheduler.jobfiles) on a real directory: results whole or not at all, logs with
their cap and marker, the last lines of a log, files whose maker died before recording them."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpycdl import defaults
from rpycdl.gpu import sampler
from rpycdl.scheduler import procs, sweep
from rpycdl.scheduler.jobfiles import TAIL_CHUNK, UNRECORDED, JobFiles, LogWriter
from rpycdl.scheduler.ledger import JobRecord, Ledger


def test_a_jobs_files_come_and_go_together(tmp_path):
    files = JobFiles(tmp_path)
    files.create("abc123", {"request": {"ngpus": 1}}, b"payload")
    assert files.spec("abc123") == {"request": {"ngpus": 1}} and files.payload("abc123") == b"payload"
    assert files.result("abc123") is None and files.log_size("abc123") == 0 and files.read_log("abc123", 0, 9) == b""
    assert files.store_result("abc123", b"outcome") == 7 and files.result("abc123") == b"outcome"
    assert sorted(os.listdir(files.path("abc123"))) == ["payload", "result", "spec.json"]  # nothing left aside
    assert stat.S_IMODE(files.path("abc123", "result").stat().st_mode) == 0o666  # any server of the host reads it
    files.drop_payload("abc123")
    assert files.payload("abc123") is None and files.listed() == ["abc123"]
    files.remove("abc123")
    assert files.listed() == []
    with pytest.raises(ValueError, match="bad job id"):
        files.path("../etc")


def test_the_sweep_removes_only_what_a_dead_maker_left_unrecorded(tmp_path):
    """Three jobs marked before their rows: one whose maker lives, one whose maker died with no row (its
    files go, and its place in line), one whose maker died after its row was saved (its files are
    end_orphaned's: they stay)."""
    ledger, files = Ledger(tmp_path), JobFiles(tmp_path)
    assert files.unrecorded() == {}
    dead = subprocess.Popen(["true"])
    dead.wait()
    for job_id in ("alive1", "dead2", "saved3"):
        files.begin(job_id)
        files.output_dir(job_id).mkdir(parents=True)
    for job_id in ("dead2", "saved3"):  # as if the dead process had marked them
        marker = files.root / UNRECORDED / job_id
        marker.write_text(f"{dead.pid} {procs.myself()[1]}")
    ledger.save(JobRecord("saved3", "server", "client", 1))
    assert sorted(files.unrecorded()) == ["alive1", "dead2", "saved3"]
    dropped: list[str] = []
    assert sweep.remove_unrecorded(ledger, files, lambda job_id: dropped.append(job_id) is None) == ["dead2"]
    assert dropped == ["dead2"]
    assert sorted(files.listed()) == ["alive1", "saved3"] and list(files.unrecorded()) == ["alive1"]
    files.recorded("alive1")
    assert files.unrecorded() == {} and sweep.remove_unrecorded(ledger, files, dropped.append) == []
    files.begin("gone4")
    files.remove("gone4")  # a refused submission takes its mark with it
    assert files.unrecorded() == {}
    ledger.close()


def test_a_log_keeps_its_limit_and_says_where_it_stopped(tmp_path):
    log = LogWriter(tmp_path / "log", 100)
    log.write("x" * 60)
    log.write("y" * 60)
    log.write("never shown")
    log.close()
    text = (tmp_path / "log").read_text()
    assert text.startswith("x" * 60 + "y" * 40 + "\n[rpycdl: this job's log reached its limit of 100 B (--max-log)")
    assert "never shown" not in text and log.size == len(text.encode())


@settings(max_examples=2 * settings.default.max_examples)
@given(st.lists(st.text(alphabet="ab\n", max_size=5), max_size=30), st.integers(0, 12), st.booleans())
def test_the_tail_is_the_last_lines(tmp_path_factory, pieces, lines, big):
    files = JobFiles(tmp_path_factory.mktemp("state"))
    text = ("z" * TAIL_CHUNK if big else "") + "".join(pieces)  # lines across a chunk's edge too
    files.create("job1", {}, None)
    files.path("job1", "log").write_text(text)
    tail = text[files.tail_offset("job1", lines):]
    expected = "".join(text.splitlines(keepends=True)[-lines:]) if lines else ""
    assert tail == expected


def test_the_sweep_finds_samplers_by_their_modules_name():
    assert defaults.SAMPLER_MODULE == sampler.__name__
