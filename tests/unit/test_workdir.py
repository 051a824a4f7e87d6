"""rpycdl.artifacts.workdir in-process: packing (deterministic, .rpycdlignore, limits, what cannot go),
unpacking untrusted archives (nothing outside the directory, refused by name), the cache by content."""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import signal
import tarfile
import time
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpycdl.artifacts import workdir, workdircache
from rpycdl.errors import InvalidRequestError, LimitError

MiB = 1024**2


def tree(root: Path) -> dict[str, tuple[str, object, int]]:
    """Every entry under `root`: kind, content or link target, mode bits."""
    found = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[name] = ("link", os.readlink(path), 0)
        elif path.is_dir():
            found[name] = ("dir", None, path.stat().st_mode & 0o777)
        else:
            found[name] = ("file", path.read_bytes(), path.stat().st_mode & 0o777)
    return found


def unpack(data: bytes, dest: Path, limit: int, piece: int = MiB) -> None:
    """Unpack `data` into `dest` as a server does: received into a cache beside it in pieces of `piece`
    bytes, then copied from there."""
    cache = workdircache.WorkdirCache(dest.parent / "cache", 100 * MiB)

    def fill(sink):
        for start in range(0, len(data), piece):
            sink(memoryview(data)[start:start + piece])

    cache.unpack(cache.receive(fill, limit), dest, limit)


def project(root: Path) -> Path:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 10)
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "naïve ünïcode.txt").write_text("ok")
    (root / "latest").symlink_to("pkg/sub/data.bin")
    return root


def test_round_trip_keeps_content_modes_and_inside_links(tmp_path):
    source = project(tmp_path / "src")
    packed = workdir.pack(source, 10 * MiB)
    assert packed.files == 4 and packed.size == 2560 + len("#!/bin/sh\n") + 2
    dest = tmp_path / "dest"
    dest.mkdir()
    unpack(packed.data, dest, 10 * MiB)
    assert tree(dest) == tree(source)


def test_the_same_content_has_the_same_digest(tmp_path):
    first = workdir.pack(project(tmp_path / "a"), MiB)
    copy = project(tmp_path / "b")
    os.utime(copy / "run.sh", (1, 1))
    assert workdir.pack(copy, MiB).digest == first.digest == blake3.blake3(first.data).hexdigest()
    (copy / "run.sh").write_text("#!/bin/sh \n")
    assert workdir.pack(copy, MiB).digest != first.digest


def test_the_archive_is_what_tarfile_writes(tmp_path):
    """The stream is made by hand (headers, then each file read once): byte for byte tarfile's archive, so
    the same content keeps its digest whichever rpycdl packed it."""
    source = project(tmp_path / "src")
    (source / ("long " * 30)).write_bytes(os.urandom(workdir.PIECE + 1))  # a PAX header, more than one piece
    expected = io.BytesIO()
    with tarfile.open(fileobj=expected, mode="w", format=tarfile.PAX_FORMAT) as out:
        for path in sorted(source.rglob("*"), key=lambda p: p.relative_to(source).parts):
            info = out.gettarinfo(path, path.relative_to(source).as_posix())
            info.mtime = info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode &= 0o777
            with open(path, "rb") if info.isreg() else io.BytesIO() as content:
                out.addfile(info, content)
    scanned = workdir.scan(source, 10 * MiB)
    pieces: list[bytes] = []
    apart = scanned.stream(lambda piece: pieces.append(bytes(piece)), apart={"run.sh"})
    assert b"".join(pieces) == expected.getvalue() and scanned.size == len(expected.getvalue())
    assert workdir.pack(source, 10 * MiB).digest == blake3.blake3(expected.getvalue()).hexdigest()
    assert apart == {"run.sh": blake3.blake3(b"#!/bin/sh\n").hexdigest()}


def test_a_file_changed_while_packed_is_named_and_the_stream_stays_whole(tmp_path):
    source = project(tmp_path / "src")
    scanned = workdir.scan(source, MiB)
    (source / "run.sh").write_text("#!/bin/bash, longer now\n")
    (source / "pkg" / "sub" / "data.bin").unlink()
    sent = bytearray()
    with pytest.raises(InvalidRequestError, match=r"'pkg/sub/data.bin' in the working directory changed while it "
                                                  r"was packed \(and 1 more\)"):
        scanned.stream(sent.extend)
    assert len(sent) == scanned.size


def test_rpycdlignore_works_as_gitignore(tmp_path):
    source = project(tmp_path / "src")
    (source / "model.ckpt").write_bytes(b"x" * 3 * MiB)
    (source / "data").mkdir()
    (source / "data" / "big.csv").write_text("big")
    (source / ".git").mkdir()
    (source / ".git" / "HEAD").write_text("ref")
    (source / "pkg" / "__pycache__").mkdir()
    (source / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"pyc")
    (source / workdir.IGNORE_FILE).write_text("*.ckpt\ndata/*\n!data/keep.csv\n")
    (source / "data" / "keep.csv").write_text("keep")
    with pytest.raises(LimitError, match=workdir.IGNORE_FILE):  # the checkpoint, were it not ignored
        workdir.pack(source / "pkg", 100)
    dest = tmp_path / "dest"
    dest.mkdir()
    unpack(workdir.pack(source, 2 * MiB).data, dest, 2 * MiB)
    names = set(tree(dest))
    assert "data/keep.csv" in names and "data/big.csv" not in names and "model.ckpt" not in names
    assert not {name for name in names if name.startswith(".git") or "__pycache__" in name}


@pytest.mark.parametrize("make, named", [
    (lambda root: (root / "out").symlink_to("/etc/passwd"), "out"),
    (lambda root: (root / "up").symlink_to("../elsewhere"), "up"),
    (lambda root: os.mkfifo(root / "pipe"), "pipe"),
    (lambda root: (root / "new\nline").write_text("x"), "new\\nline"),
])
def test_what_cannot_go_is_refused_by_name(tmp_path, make, named):
    source = project(tmp_path / "src")
    make(source)
    with pytest.raises(InvalidRequestError, match=named.replace("\\", "\\\\")):
        workdir.pack(source, MiB)
    with pytest.raises(InvalidRequestError, match="not a directory"):
        workdir.pack(source / "run.sh", MiB)


def archive(*members: tuple[str, bytes | str | None, bytes]) -> bytes:
    """A tar made by hand: (name, type, content or link target)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as out:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = payload.decode()
                out.addfile(info)
            else:
                info.size = len(payload)
                out.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


F, D, L = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE


@pytest.mark.parametrize("members, named", [
    ([("../x", F, b"bad")], "../x"),
    ([("a/../../x", F, b"bad")], "a/../../x"),
    ([("/abs", F, b"bad")], "/abs"),
    ([("out", L, b"/etc"), ("out/passwd", F, b"bad")], "out"),
    ([("a", L, b"."), ("a/b", L, b".."), ("a/b/x", F, b"bad")], "a/b"),
    ([("c", L, b"."), ("up", L, b"c/..")], "up"),  # lexically inside, out through the link c
    ([("d/c", L, b".."), ("d/up", L, b"c/../..")], "d/up"),
    ([("hard", tarfile.LNKTYPE, b"/etc/passwd")], "hard"),
    ([("dev", tarfile.CHRTYPE, b"")], "dev"),
    ([("fifo", tarfile.FIFOTYPE, b"")], "fifo"),
    ([("new\nline", F, b"x")], "new"),
    ([("twice", F, b"a"), ("twice", F, b"b")], "twice"),
    ([("big", F, b"x" * 2000)], "big"),
    ([("ok", F, b"x"), ("./ok2", F, b"x")], "./ok2"),
])
def test_hostile_archives_write_nothing(tmp_path, members, named):
    dest = tmp_path / "dest"
    dest.mkdir()
    workdircache.WorkdirCache(tmp_path / "cache", MiB)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        unpack(archive(*members), dest, 1000)
    assert sorted(tmp_path.rglob("*")) == before and not any(dest.iterdir())


def _declared_bomb() -> bytes:
    header = tarfile.TarInfo("huge")
    header.size = 10**12  # declared, not sent: refused on its header, before anything is written
    return header.tobuf(tarfile.PAX_FORMAT) + bytes(1024)


@pytest.mark.parametrize("data, why", [
    (_declared_bomb(), "huge"),
    (b"not a tar at all" * 64, "damaged"),
    (archive(("ok", F, b"x"))[:1024], "cut short"),
    (archive(("a" * 200, F, b"x"))[:600] + bytes(4096), "damaged"),  # an extended header cut
])
def test_damaged_and_bomb_archives_are_refused(tmp_path, data, why):
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(InvalidRequestError, match=why):
        unpack(data, dest, 10 * MiB)
    assert not any(dest.iterdir()) and [entry.name for entry in (tmp_path / "cache").iterdir()] == []


def test_an_entry_serves_only_the_users_who_sent_its_content(tmp_path):
    cache = workdircache.WorkdirCache(tmp_path / "cache", max_bytes=8200)
    packed = workdir.pack(project(tmp_path / "mine"), MiB)
    (project(tmp_path / "other") / "more").write_bytes(b"x" * 8000)
    other = workdir.pack(tmp_path / "other", MiB)
    cache.put(packed.digest, packed.data, MiB, "alice")
    assert cache.has(packed.digest, "alice")
    assert not cache.has(packed.digest, "bob") and not cache.has(packed.digest, "alice (unverified)")
    inode = (cache.root / packed.digest).stat().st_ino
    cache.put(packed.digest, packed.data, MiB, "bob")  # the same content sent by bob: his too, the entry as it was
    assert cache.has(packed.digest, "bob") and cache.has(packed.digest, "alice")
    assert (cache.root / packed.digest).stat().st_ino == inode
    os.utime(cache.root / packed.digest / "members.json", (1, 1))
    cache.put(other.digest, other.data, MiB, "bob")  # evicts the first: its markers outlive it a while
    assert not cache.has(packed.digest, "alice") and len(list(cache.senders.iterdir())) == 3
    for marker in cache.senders.iterdir():
        if marker.name.startswith(packed.digest):
            os.utime(marker, (1, 1))  # gone with its entry longer than SENDER_KEEP
    cache.put(other.digest, other.data, MiB, "bob")
    assert [marker.name.partition(".")[0] for marker in cache.senders.iterdir()] == [other.digest]
    cache.put(packed.digest, packed.data, MiB, "carol")
    assert cache.has(packed.digest, "carol") and not cache.has(packed.digest, "alice")


def test_the_cache_checks_evicts_and_copies(tmp_path):
    cache = workdircache.WorkdirCache(tmp_path / "cache", max_bytes=8200)
    packs = [workdir.pack(project(tmp_path / f"p{n}"), MiB) for n in range(3)]
    (tmp_path / "p1" / "extra").write_text("1")
    packs[1] = workdir.pack(tmp_path / "p1", MiB)
    (tmp_path / "p2" / "more").write_bytes(b"x" * 3000)
    packs[2] = workdir.pack(tmp_path / "p2", MiB)
    assert not cache.has(packs[0].digest, "alice") and not cache.has("../../etc/passwd", "alice")
    with pytest.raises(InvalidRequestError, match="damaged"):
        cache.put(packs[0].digest, packs[1].data, MiB, "alice")
    with pytest.raises(InvalidRequestError, match="content hash"):
        cache.put("../x", packs[0].data, MiB, "alice")
    cache.put(packs[0].digest, packs[0].data, MiB, "alice")
    cache.put(packs[1].digest, packs[1].data, MiB, "alice")
    os.utime(cache.root / packs[0].digest / "members.json", (1, 1))  # the least recently used
    cache.put(packs[2].digest, packs[2].data, MiB, "alice")
    assert [cache.has(pack.digest, "alice") for pack in packs] == [False, True, True]
    dest = tmp_path / "dest"
    dest.mkdir()
    cache.unpack(packs[1].digest, dest, MiB)
    assert tree(dest) == tree(tmp_path / "p1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyError):
        cache.unpack(packs[0].digest, tmp_path / "empty", MiB)
    with pytest.raises(InvalidRequestError, match="limit"):  # another server's smaller limit
        cache.unpack(packs[2].digest, tmp_path / "empty", 3000)
    assert not any((tmp_path / "empty").iterdir())


def test_a_jobs_copy_is_its_own(tmp_path):
    cache = workdircache.WorkdirCache(tmp_path / "cache", MiB)
    packed = workdir.pack(project(tmp_path / "p"), MiB)
    cache.put(packed.digest, packed.data, MiB, "alice")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    cache.unpack(packed.digest, first, MiB)
    with open(first / "pkg" / "sub" / "data.bin", "r+b") as changed:  # written in place, not replaced
        changed.write(b"changed")
    (first / "run.sh").chmod(0o700)
    cache.unpack(packed.digest, second, MiB)
    assert tree(second) == tree(tmp_path / "p") != tree(first)


def test_an_entry_being_copied_is_not_evicted(tmp_path):
    cache = workdircache.WorkdirCache(tmp_path / "cache", max_bytes=3000)
    packs = [workdir.pack(project(tmp_path / f"p{n}"), MiB) for n in range(2)]
    (tmp_path / "p1" / "extra").write_text("1")
    packs[1] = workdir.pack(tmp_path / "p1", MiB)
    cache.put(packs[0].digest, packs[0].data, MiB, "alice")
    with cache._held(packs[0].digest):  # as a copy holds it, from this process or another
        cache.put(packs[1].digest, packs[1].data, MiB, "alice")
        assert cache.has(packs[0].digest, "alice")
    cache.put(packs[1].digest, packs[1].data, MiB, "alice")
    assert not cache.has(packs[0].digest, "alice") and cache.has(packs[1].digest, "alice")


def test_the_cache_receives_in_pieces_and_keeps_nothing_half(tmp_path):
    cache = workdircache.WorkdirCache(tmp_path / "cache", 10 * MiB)
    packed = workdir.pack(project(tmp_path / "p"), MiB)

    def fill(sink):
        for start in range(0, len(packed.data), 1000):
            sink(memoryview(packed.data)[start:start + 1000])

    assert cache.receive(fill, MiB, sender="alice") == packed.digest  # named by what came
    assert cache.has(packed.digest, "alice")
    with pytest.raises(InvalidRequestError, match="damaged"):
        cache.receive(fill, MiB, digest="0" * 64)

    def cut(sink):
        sink(memoryview(packed.data)[:3000])
        raise EOFError("the client went away")

    with pytest.raises(EOFError):
        cache.receive(cut, MiB)
    (cache.root / ".dead.tmp" / "tree").mkdir(parents=True)  # what a receiver killed meanwhile left
    (cache.root / ".dead.gone").mkdir()  # and a remover
    older = cache.root / ("a" * 64)  # an archive an older rpycdl kept: not an entry
    older.write_bytes(packed.data)
    assert not cache.has(older.name, "alice")
    cache.put(packed.digest, packed.data, MiB, "alice")
    assert [path.name for path in cache.root.iterdir()] == [packed.digest]


def _receive_until_killed(root: str, data: bytes) -> None:
    """In a process of its own: receive the first half of `data`, then wait to be killed."""
    def fill(sink):
        sink(memoryview(data)[:len(data) // 2])
        time.sleep(60)

    workdircache.WorkdirCache(root, 10 * MiB).receive(fill, 10 * MiB)


def test_a_receivers_half_entry_stays_while_it_lives_and_goes_once_it_is_killed(tmp_path):
    cache = workdircache.WorkdirCache(tmp_path / "cache", 10 * MiB)
    (project(tmp_path / "p1") / "extra").write_text("1")
    packs = [workdir.pack(project(tmp_path / "p0"), MiB), workdir.pack(tmp_path / "p1", MiB)]
    receiver = multiprocessing.get_context("fork").Process(target=_receive_until_killed,
                                                           args=(str(cache.root), packs[0].data))
    receiver.start()
    try:
        deadline = time.monotonic() + 10
        while not (half := [entry for entry in cache.root.iterdir() if (entry / "tree").is_dir()]):
            assert time.monotonic() < deadline, "the receiver made no entry"
            time.sleep(0.01)
        cache.put(packs[1].digest, packs[1].data, MiB, "alice")  # an eviction runs: a live receiver's entry stays
        assert all(entry.is_dir() for entry in half)
    finally:
        os.kill(receiver.pid, signal.SIGKILL)
        receiver.join()
    cache.put(packs[0].digest, packs[0].data, MiB, "alice")  # the next eviction: at once, not after an hour
    assert sorted(path.name for path in cache.root.iterdir()) == sorted(pack.digest for pack in packs)


def _put(root: str, data: bytes) -> None:
    workdircache.WorkdirCache(root, 10 * MiB).put(blake3.blake3(data).hexdigest(), data, 10 * MiB)


def test_processes_putting_one_directory_at_once_leave_it_whole(tmp_path):
    (tmp_path / "src").mkdir()
    content = os.urandom(4 * MiB)
    (tmp_path / "src" / "big").write_bytes(content)
    data = workdir.pack(tmp_path / "src", 10 * MiB).data
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_put, args=(str(tmp_path / "cache"), data)) for _ in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    (tmp_path / "dest").mkdir()
    workdircache.WorkdirCache(tmp_path / "cache", 10 * MiB).unpack(blake3.blake3(data).hexdigest(),
                                                                   tmp_path / "dest", 10 * MiB)
    assert (tmp_path / "dest" / "big").read_bytes() == content
    assert len(list((tmp_path / "cache").iterdir())) == 1


names = st.text(alphabet="abcxyz_-.0", min_size=1, max_size=8).filter(lambda name: name not in (".", ".."))


@settings(max_examples=settings.default.max_examples * 2 // 5, deadline=None)
@given(st.dictionaries(st.lists(names, min_size=1, max_size=3).map("/".join), st.binary(max_size=300),
                       max_size=8), st.integers(1, 1500))
def test_random_trees_round_trip_in_any_pieces(files, piece):
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        source, dest = Path(scratch, "src"), Path(scratch, "dest")
        source.mkdir()
        dest.mkdir()
        for name, content in files.items():
            path = source / name
            if any(parent.is_file() for parent in path.parents) or path.is_dir():
                continue  # a name that is a prefix of another: one of them wins
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
        unpack(workdir.pack(source, MiB).data, dest, MiB, piece)
        assert tree(dest) == tree(source)
