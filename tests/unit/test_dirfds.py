"""How root acts on paths (rpycdl.scheduler.dirfds, lockdir's modes, jobfiles' reads): through directory
descriptors, following no link, changing no mode it did not make; and a job's outcome read as plain data
(rpycdl.wire.untrusted). The ownership cases need root to make files of other accounts (skipped elsewhere)."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest

from rpycdl.errors import LimitError, RemoteError, RpycdlError
from rpycdl.scheduler import dirfds, lockdir
from rpycdl.scheduler.jobfiles import JobFiles
from rpycdl.wire import codec, untrusted

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="files of another account need root to make")


def test_a_directory_handed_over_is_filled_and_given_while_only_its_maker_reaches_it(tmp_path):
    seen = {}

    def fill(path: Path) -> None:
        seen["mode"] = stat.S_IMODE(path.stat().st_mode)  # nobody else may enter while it is filled
        (path / "sub").mkdir()
        (path / "sub" / "f").write_text("x")
        (path / "link").symlink_to("/etc/passwd")

    owner = (os.getuid(), os.getgid()) if os.geteuid() != 0 else (NOBODY, NOBODY)
    assert dirfds.hand_over(tmp_path, "work", *owner, fill)
    assert seen["mode"] == 0o700
    work = tmp_path / "work"
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    for path in (work, work / "sub", work / "sub" / "f", work / "link"):
        assert (path.lstat().st_uid, path.lstat().st_gid) == owner, path
    assert Path("/etc/passwd").stat().st_uid == 0  # the link was given, not what it names
    assert not dirfds.hand_over(tmp_path, "work", *owner, fill)  # once only: never walked again


def test_a_fill_that_fails_leaves_no_directory(tmp_path):
    def fill(path: Path) -> None:
        (path / "half").write_text("x")
        raise KeyError("evicted")

    with pytest.raises(KeyError):
        dirfds.hand_over(tmp_path, "work", None, None, fill)
    assert not (tmp_path / "work").exists()


def test_a_walk_follows_no_link_and_skips_what_it_is_told(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")
    (tmp_path / "skip" / "g").mkdir(parents=True)
    (tmp_path / "out").symlink_to("/etc")
    visited = []
    with dirfds.opened_dir(tmp_path) as top:
        dirfds.walk(top, lambda _, name, status: visited.append((name, stat.S_IFMT(status.st_mode))),
                    lambda where: where[-1] == "skip")
    assert sorted(visited) == sorted([("f", stat.S_IFREG), ("b", stat.S_IFDIR), ("a", stat.S_IFDIR),
                                      ("out", stat.S_IFLNK)])
    assert visited.index(("f", stat.S_IFREG)) < visited.index(("b", stat.S_IFDIR))  # children first
    with pytest.raises(OSError):
        dirfds.open_dir(tmp_path / "out")


def test_a_trees_usage_follows_no_link_and_counts_a_hard_linked_file_once(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"b" * (4 << 20))
    top = tmp_path / "out"
    (top / "a" / "b").mkdir(parents=True)
    (top / "model").write_bytes(b"m" * 100_000)
    os.link(top / "model", top / "a" / "model-again")  # one file, two names
    (top / "a" / "b" / "ckpt").write_bytes(b"c" * 50_000)
    (top / "link").symlink_to(outside / "big")  # neither a link's target
    (top / "a" / "dir-link").symlink_to(outside)  # nor a linked directory is counted
    with open(top / "sparse", "wb") as sparse:
        sparse.truncate(1 << 20)  # no block on disk, but 1 MiB to read (and to upload)
    expected, seen = 0, set()
    for where, names, files in os.walk(top):  # the same, by path
        for name in names + files:
            status = os.lstat(os.path.join(where, name))
            if (status.st_dev, status.st_ino) not in seen:
                seen.add((status.st_dev, status.st_ino))
                expected += max(status.st_size, status.st_blocks * 512)
    with dirfds.opened_dir(top) as fd:
        used = dirfds.usage(fd, 10)
    assert used == expected
    assert 100_000 + 50_000 + (1 << 20) <= used < 2 * 100_000 + 50_000 + (1 << 20)  # not the 4 MiB outside


def test_a_trees_usage_refuses_a_tree_nested_deeper_than_told(tmp_path):
    deep = tmp_path.joinpath(*"abcde")
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"x" * 1000)
    with dirfds.opened_dir(tmp_path) as fd:
        assert dirfds.usage(fd, 5) >= 1000
        with pytest.raises(LimitError, match="deeper than 4 levels"):
            dirfds.usage(fd, 4)
    opened = len(os.listdir("/proc/self/fd"))
    with dirfds.opened_dir(tmp_path) as fd, pytest.raises(LimitError):
        dirfds.usage(fd, 2)
    assert len(os.listdir("/proc/self/fd")) == opened  # every level's descriptor closed


@needs_root
def test_trusted_paths_are_roots_alone_to_change(tmp_path):
    tmp_path.chmod(0o755)
    dirfds.check_trusted(tmp_path / "locks", "lock directory")  # not there yet, in a directory of root's
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    with pytest.raises(RpycdlError, match="writable by others"):
        dirfds.check_trusted(open_dir / "locks", "lock directory")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    dirfds.check_trusted(sticky / "locks", "lock directory")  # /tmp: fine while the entry is root's or absent
    (sticky / "locks").mkdir()
    os.chown(sticky / "locks", NOBODY, NOBODY)
    with pytest.raises(RpycdlError, match=r"belongs to another account.*uid 65534"):
        dirfds.check_trusted(sticky / "locks", "lock directory")
    (sticky / "link").symlink_to(tmp_path)
    os.chown(sticky / "link", NOBODY, NOBODY, follow_symlinks=False)
    with pytest.raises(RpycdlError, match="link"):
        dirfds.check_trusted(sticky / "link" / "locks", "lock directory")


def test_an_existing_directory_or_file_keeps_its_mode(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    folder.chmod(0o750)
    lockdir.shared_dir(folder)
    lockdir.shared_file(folder / "f")
    (folder / "f").chmod(0o600)
    lockdir.shared_file(folder / "f")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750 and stat.S_IMODE((folder / "f").stat().st_mode) == 0o600
    (folder / "planted").symlink_to(tmp_path / "target")
    lockdir.shared_file(folder / "planted", b"x")  # a record replaces a link at its name, never writes through it
    (folder / f".rec.json.{os.getpid()}.tmp").symlink_to(tmp_path / "target2")  # nor through one at its temporary
    lockdir.write_json(folder / "rec.json", {"a": 1})
    assert not (tmp_path / "target").exists() and not (tmp_path / "target2").exists()
    assert (folder / "planted").read_bytes() == b"x" and lockdir.read_json(folder / "rec.json") == {"a": 1}


@needs_root
def test_a_tree_holding_another_accounts_file_is_refused_and_one_of_roots_tightened(tmp_path):
    tree = tmp_path / "locks"
    (tree / "held").mkdir(parents=True)
    (tree / "held" / "x.json").write_text("{}")
    (tree / "held" / "x.json").chmod(0o666)
    os.mkfifo(tree / "w.fifo", 0o666)
    os.chmod(tree / "w.fifo", 0o666)
    (tree / "state" / "jobs" / "abc" / "output").mkdir(parents=True)
    os.chown(tree / "state" / "jobs" / "abc" / "output", NOBODY, NOBODY)  # a job's own: left as it is
    lockdir.make_private(tree)
    assert stat.S_IMODE((tree / "held" / "x.json").stat().st_mode) == 0o640
    assert stat.S_IMODE((tree / "w.fifo").stat().st_mode) == 0o660  # its group (a monitor) still sees waiters
    (tree / "held" / "y.json").write_text("{}")
    os.chown(tree / "held" / "y.json", NOBODY, NOBODY)
    with pytest.raises(RpycdlError, match="other accounts than root"):
        lockdir.make_private(tree)


def test_a_jobs_file_swapped_for_a_link_is_not_read(tmp_path):
    files = JobFiles(tmp_path / "state")
    files.create("abc", {"a": 1}, b"payload")
    secret = tmp_path / "secret"
    secret.write_text("root's secret")
    files.path("abc", "log").symlink_to(secret)
    files.path("abc", "result").symlink_to(secret)
    with pytest.raises(PermissionError):
        files.read_log("abc", 0, 100)
    with pytest.raises(PermissionError):
        files.result("abc")


@needs_root
def test_a_jobs_file_another_account_wrote_is_not_read_by_root(tmp_path):
    files = JobFiles(tmp_path / "state")
    files.create("abc", {"a": 1}, b"payload")
    files.path("abc", "log").write_text("forged")
    os.chown(files.path("abc", "log"), NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="root did not write"):
        files.read_log("abc", 0, 100)
    assert files.payload("abc") == b"payload"


class _Trap:
    """Unpickling it would create the file its path names."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("shape", ["value", "failure texts", "failure tuple", "exit code"])
def test_an_outcome_that_would_run_code_is_refused_and_runs_nothing(tmp_path, shape):
    marker = tmp_path / "ran"
    trap = _Trap(str(marker))
    outcome = {"value": codec.OK + pickle.dumps(trap),
               "failure texts": codec.FAILED + pickle.dumps((None, "x.Error", trap, "tb")),
               "failure tuple": codec.FAILED + pickle.dumps(trap),
               "exit code": codec.OK + pickle.dumps([trap])}[shape]
    if shape.startswith("failure"):
        assert untrusted.failure(outcome)[0] == "UnreadableResult"
    with pytest.raises(RemoteError):
        untrusted.outcome(outcome)
    assert not marker.exists()


def test_plain_outcomes_and_exceptions_read_as_their_writer_meant():
    assert untrusted.outcome(codec.encode_ok({"loss": [0.1, 2], "ok": (True, None), "z": 1j, "s": {1}})) == {
        "loss": [0.1, 2], "ok": (True, None), "z": 1j, "s": {1}}

    class Text(str):
        pass

    class Failure(Exception):
        def __str__(self) -> str:
            return Text("it failed")  # a str of the job's own class: written as a plain str

    outcome = codec.encode_error(Failure())
    assert untrusted.failure(outcome) == ("Failure", "it failed")
    with pytest.raises(RemoteError, match="it failed"):
        untrusted.outcome(outcome)
