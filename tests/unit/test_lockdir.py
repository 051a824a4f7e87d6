"""The lock directory's files (rpycdl.scheduler.lockdir): shared modes, atomic records, probes of the
locks other processes hold (one held by a forked child)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from rpycdl.scheduler import lockdir

CTX = multiprocessing.get_context("fork")


def _hold(path: str, ranges: list[tuple[int, int]], ready, done) -> None:
    fd = os.open(path, os.O_RDWR)
    for start, length in ranges:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
    ready.set()
    done.wait(10)


def test_files_and_directories_are_shared_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        lockdir.shared_dir(tmp_path / "d")
        lockdir.write_json(tmp_path / "d" / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == lockdir.SHARED_DIR_MODE
    assert stat.S_IMODE((tmp_path / "d" / "r.json").stat().st_mode) == lockdir.SHARED_FILE_MODE
    assert lockdir.read_json(tmp_path / "d" / "r.json") == {"a": 1}
    assert lockdir.read_json(tmp_path / "d" / "missing.json") is None


def test_probes_find_every_range_another_process_locks_and_take_none(tmp_path):
    path = tmp_path / "gpu.lock"
    lockdir.shared_file(path)
    ready, done = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_hold, args=(str(path), [(10, 5), (100, 20), (300, 1)], ready, done))
    holder.start()
    try:
        assert ready.wait(10)
        fd = lockdir.open_once(str(path))
        assert sorted(lockdir.others(fd, 0, 1024, [])) == [(10, 5), (100, 20), (300, 1)]
        assert lockdir.others(fd, 16, 100, []) == []
        assert sorted(lockdir.others(fd, 105, 310, [])) == [(105, 15), (300, 1)]
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)  # the probes took nothing
        fcntl.lockf(fd, fcntl.LOCK_UN, 10, 0)
    finally:
        done.set()
        holder.join(10)


def test_a_fifo_has_a_reader_only_while_someone_holds_it_open(tmp_path):
    fifo = Path(tmp_path / "w.fifo")
    os.mkfifo(fifo)
    assert not lockdir.fifo_has_reader(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    assert lockdir.fifo_has_reader(fifo)
    lockdir.poke(fifo)
    lockdir.poke(fifo)
    assert lockdir.drain(fd) == b"!!"
    os.close(fd)
    assert not lockdir.fifo_has_reader(fifo)


def test_a_new_file_is_shared_made_once_and_never_through_a_link(tmp_path):
    old = os.umask(0o077)
    try:
        lockdir.new_file(tmp_path / "r.json", b'{"a": 1}')
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == lockdir.SHARED_FILE_MODE
    assert lockdir.read_json(tmp_path / "r.json") == {"a": 1}
    (tmp_path / "target").write_bytes(b"mine")
    (tmp_path / "link.json").symlink_to(tmp_path / "target")
    for name in ("r.json", "link.json"):
        with pytest.raises(FileExistsError):
            lockdir.new_file(tmp_path / name, b"{}")
    assert (tmp_path / "target").read_bytes() == b"mine"
    (tmp_path / "half.json").write_bytes(b'{"a": 1')  # a record whose write did not end reads as none
    assert lockdir.read_json(tmp_path / "half.json") is None
