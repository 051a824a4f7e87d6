"""A job's working directory end to end: packed by a real client, sent once per content over the
connection's bulk path, cached by the server, unpacked for each job alone (its current directory and
first on its sys.path), removed when it ends; attached, detached and from the command line; refused
by name when it is too large or hostile, with the server still serving and nothing written outside.
Real registry and servers on loopback; only the GPUs are simulated."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from helpers import unavailable, wait_until

import rpycdl
from rpycdl.artifacts import workdir, workdircache
from rpycdl.client.connection import call
from rpycdl.site.local import LocalCluster
from rpycdl.wire import bulk, codec


def _project(root: Path) -> Path:
    """A small training project: a module, a data file, and what .rpycdlignore leaves out."""
    project = root / "project"
    (project / "data").mkdir(parents=True)
    (project / "trainlib.py").write_text("def train(args):\n"
                                         "    import os\n"
                                         "    with open('data/lr.txt') as f:\n"
                                         "        lr = float(f.read())\n"
                                         "    return {'lr': lr * args, 'cwd': os.getcwd(),\n"
                                         "            'files': sorted(os.listdir('.')), 'module': __file__}\n")
    (project / "data" / "lr.txt").write_text("0.5")
    (project / "big.ckpt").write_bytes(b"x" * 1000)
    (project / workdir.IGNORE_FILE).write_text("*.ckpt\n")
    return project


@pytest.fixture
def imported() -> Iterator[Callable[[Path], Any]]:
    """imported(project) -> trainlib.train, imported here from `project`: dill pickles it by reference to
    its module, so a server can load it only where that module is importable."""

    def load(project: Path) -> Any:
        sys.path.insert(0, str(project))
        try:
            return importlib.import_module("trainlib").train
        finally:
            sys.path.remove(str(project))

    yield load
    sys.modules.pop("trainlib", None)


def _job_dirs(lock_dir: str) -> list[str]:
    """The jobs' directories, and the marks of those made before their jobs' rows (.unrecorded/<id>)."""
    jobs = Path(lock_dir) / "state" / "jobs"
    marks = [f".unrecorded/{mark.name}" for mark in (jobs / ".unrecorded").glob("*")]
    return sorted(entry.name for entry in jobs.glob("[!.]*")) + marks if jobs.exists() else []


def test_a_job_runs_in_its_working_directory_sent_once(server, connect, lock_dir, tmp_path, imported):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    train = imported(_project(tmp_path))
    with pytest.raises(rpycdl.InvalidRequestError, match="cannot be loaded on this server"):
        conn.root.run_code(train, 2)  # its module is not on the server
    assert not conn.root.has_working_dir(workdir.pack(tmp_path / "project", 10**6).digest)

    value = conn.root.run_code(train, 2, working_dir=tmp_path / "project")
    assert value["lr"] == 1.0
    assert value["files"] == [workdir.IGNORE_FILE, "data", "trainlib.py"]  # big.ckpt left out
    assert value["module"] == os.path.join(value["cwd"], "trainlib.py")
    assert Path(value["cwd"]).parent.parent == Path(lock_dir) / "state" / "jobs"  # a copy, the job's own
    wait_until(lambda: _job_dirs(lock_dir) == [], 10, "the job's directory to go with it")  # after the reply
    assert conn.root.has_working_dir(workdir.pack(tmp_path / "project", 10**6).digest)

    (tmp_path / "project" / "other.ckpt").write_bytes(b"y" * 10**6)  # ignored: the same content goes up
    again = connect(port).root.run_code(train, 4, working_dir=str(tmp_path / "project"))
    assert again["lr"] == 2.0 and again["cwd"] != value["cwd"]  # a directory of its own each time
    (tmp_path / "project" / "data" / "lr.txt").write_text("0.25")
    assert conn.root.run_code(train, 4, working_dir=tmp_path / "project")["lr"] == 1.0  # new content: sent


def test_the_client_remembers_a_directory_but_never_a_changed_file(server, connect, lock_dir, tmp_path, imported):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    project = _project(tmp_path)
    train = imported(project)
    assert conn.root.run_code(train, 2, working_dir=project)["lr"] == 1.0
    assert conn.root.run_code(train, 2, working_dir=project)["lr"] == 1.0  # remembered: named, not read again
    lr = project / "data" / "lr.txt"
    before = lr.stat()
    time.sleep(0.05)  # a tick of the kernel's clock later
    lr.write_text("0.7")  # the same size, and its mtime set back as a careless tool might
    os.utime(lr, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert conn.root.run_code(train, 2, working_dir=project)["lr"] == 1.4
    for cached in (Path(lock_dir) / "state" / "workdirs").iterdir():
        shutil.rmtree(cached)  # the server let it go: the client remembers it, and sends it again
    assert conn.root.run_code(train, 2, working_dir=project)["lr"] == 1.4


def test_a_detached_job_and_the_command_line(server, connect, lock_dir, tmp_path, imported):
    port = server("pytorch", "fake:2")
    project = _project(tmp_path)
    (project / "script.py").write_text("import trainlib\nprint('lr is', trainlib.train(3)['lr'])\n")
    conn = connect(port)
    conn.root.identify("alice")
    job = conn.root.submit(imported(project), 4, working_dir=project)
    assert job.result(timeout=30)["lr"] == 2.0
    wait_until(lambda: not (Path(lock_dir) / "state" / "jobs" / job.id / "work").exists(), 10,
               "its working directory to go (after its end is recorded)")  # its log and result stay
    assert (Path(lock_dir) / "state" / "jobs" / job.id / "result").exists()

    cli = [sys.executable, "-m", "rpycdl"]
    where = ["--host", "127.0.0.1", "--port", str(port)]
    ran = subprocess.run([*cli, "run", "pytorch", *where, "--working-dir", str(project), "--", sys.executable,
                          "script.py"], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "lr is 1.5\n"
    submitted = subprocess.run([*cli, "submit", "pytorch", *where, "-q", "--working-dir", str(project), "--",
                                sys.executable, "script.py"], capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    waited = subprocess.run([*cli, "wait", submitted.stdout.strip(), *where], capture_output=True, text=True,
                            timeout=60)
    assert waited.returncode == 0, waited.stderr
    logs = subprocess.run([*cli, "logs", submitted.stdout.strip(), *where], capture_output=True, text=True,
                          timeout=60)
    assert logs.stdout == "lr is 1.5\n"
    wait_until(lambda: all(not (Path(lock_dir) / "state" / "jobs" / name / "work").exists()
                           for name in _job_dirs(lock_dir)), 10, "the working directories to go")


def _opened_by(path: Path) -> list[int]:
    """The processes, but this one, with `path` open."""
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if int(fd_dir.parent.name) != os.getpid() and any(os.readlink(fd) == str(path) for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
    return found


@pytest.mark.parametrize("detached", [False, True])
def test_a_connection_killed_before_its_job_is_recorded_leaves_no_files(server, connect, lock_dir, tmp_path, detached):
    """A connection process killed -9 while it copies a job's working directory out of the cache (held
    there by an eviction's lock), before the job has a row in the ledger that the sweep could end: the
    job's directory goes all the same, within a sweep, and the server serves on."""
    port = server("pytorch", "fake:1")
    conn = connect(port)
    project = _project(tmp_path)
    listed = conn.root.run_code(os.listdir, ".", working_dir=project)  # now in the cache
    entry = Path(lock_dir) / "state" / "workdirs" / workdir.pack(project, 10**6).digest
    evicting = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(evicting, fcntl.LOCK_EX)
    blocked = connect(port)
    send = blocked.root.submit if detached else blocked.root.run_code

    def killed_meanwhile() -> None:
        with contextlib.suppress(Exception):  # its connection dies: whatever error that makes
            send(os.listdir, ".", working_dir=project)

    call = threading.Thread(target=killed_meanwhile, daemon=True)
    try:
        call.start()
        copier = wait_until(lambda: _opened_by(entry), 10, "the connection process to wait for the entry")
        wait_until(lambda: _job_dirs(lock_dir), 10, "the job's directory")
        os.kill(copier[0], signal.SIGKILL)
    finally:
        os.close(evicting)
    call.join(10)
    wait_until(lambda: _job_dirs(lock_dir) == [], 5, "the unrecorded job's directory to go")
    assert conn.root.run_code(os.listdir, ".", working_dir=project) == listed


def test_too_large_or_hostile_working_directories_are_refused(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2", "--max-working-dir", "1MiB")
    conn = connect(port)
    project = _project(tmp_path)
    (project / "weights.bin").write_bytes(b"w" * 2 * 1024**2)
    with pytest.raises(rpycdl.LimitError, match=workdir.IGNORE_FILE):
        conn.root.run_code(len, "x", working_dir=project)
    outside = tmp_path / "outside"
    outside.write_text("secret")
    (project / "weights.bin").unlink()
    (project / "leak").symlink_to(outside)
    with pytest.raises(rpycdl.InvalidRequestError, match="leak"):
        conn.root.run_code(len, "x", working_dir=project)

    def run_in(digest: str) -> Any:  # a run naming a working directory by its hash, as a client may
        options = [None] * 8  # ngpus, stdout, stderr, timeout, queue_timeout, on_state, gpus, gpu_memory
        return codec.decode_outcome(call(conn.root._conn, "run", codec.encode_payload(len, "x"), *options, digest))

    with pytest.raises(rpycdl.InvalidRequestError, match="not a working directory you sent this server"):
        run_in("0" * 64)

    def put(data: bytes, digest: str | None = None) -> Any:  # what a hostile client can send
        raw = conn.root._conn

        def send(framed: bool) -> None:
            with bulk.sending(raw, framed) as sock:
                bulk.send_buffers(sock, [pickle.PickleBuffer(data)])

        return codec.decode_outcome(call(raw, "put_working_dir", digest or blake3.blake3(data).hexdigest(),
                                         len(data), send))

    escape = io.BytesIO()
    with tarfile.open(fileobj=escape, mode="w", format=tarfile.PAX_FORMAT) as archive:
        member = tarfile.TarInfo("../../escaped.txt")
        member.size = 3
        archive.addfile(member, io.BytesIO(b"bad"))
    with pytest.raises(rpycdl.InvalidRequestError, match="escaped.txt"):  # checked member by member as it comes
        put(escape.getvalue())
    with pytest.raises(rpycdl.InvalidRequestError, match="not a working directory you sent this server"):
        run_in(blake3.blake3(escape.getvalue()).hexdigest())
    with pytest.raises(rpycdl.InvalidRequestError, match="damaged"):
        put(b"some bytes", digest="1" * 64)
    with pytest.raises(rpycdl.LimitError, match="--max-working-dir"):
        codec.decode_outcome(call(conn.root._conn, "put_working_dir", "2" * 64, 10**12, None))
    assert not list(tmp_path.rglob("escaped.txt")) and not list(Path(lock_dir).rglob("escaped.txt"))
    wait_until(lambda: _job_dirs(lock_dir) == [], 10, "the refused jobs' directories to go")
    assert conn.root.run_code(len, "still serving") == 13


def test_an_archive_of_too_many_entries_is_refused_and_leaves_nothing(tmp_path):
    """In-process, but slow (MAX_MEMBERS + 1 entries are made and read): here rather than in tests/unit."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as out:
        for number in range(workdir.MAX_MEMBERS + 1):
            out.addfile(tarfile.TarInfo(f"f{number}"), io.BytesIO(b""))
    cache = workdircache.WorkdirCache(tmp_path / "cache", 2**20)
    with pytest.raises(rpycdl.InvalidRequestError, match="entries"):
        cache.receive(lambda sink: sink(buffer.getbuffer()), 2**20)
    assert not any(cache.root.iterdir())


@pytest.fixture
def reflink_dir(tmp_path) -> Iterator[Path]:
    """The top of a new XFS filesystem (a loop device over a sparse file in `tmp_path`): a state directory
    there has reflinks, as on a server whose disks are XFS or btrfs."""
    mkfs = shutil.which("mkfs.xfs")
    if os.geteuid() != 0 or mkfs is None:
        unavailable("a filesystem with reflinks needs root and mkfs.xfs (Debian's xfsprogs)",
                    "run as root with xfsprogs installed")
    image, top = tmp_path / "xfs.img", tmp_path / "xfs"
    with open(image, "wb") as sparse:
        sparse.truncate(1024**3)  # XFS's smallest is 300 MB
    top.mkdir()
    made = subprocess.run([mkfs, "-q", str(image)], capture_output=True, text=True, timeout=60)
    if made.returncode == 0:
        made = subprocess.run(["mount", "-o", "loop", str(image), str(top)], capture_output=True, text=True, timeout=60)
    if made.returncode:
        unavailable(f"could not make and mount an XFS image: {made.stderr.strip()}", "allow loop mounts")
    try:
        yield top
    finally:
        subprocess.run(["umount", "--lazy", str(top)], check=False, timeout=60)


def test_a_working_directory_is_cloned_where_the_filesystem_has_reflinks(reflink_dir):
    project = reflink_dir / "project"
    project.mkdir()
    (project / "weights.bin").write_bytes(os.urandom(8 * 1024**2))
    with LocalCluster(str(reflink_dir / "locks")) as cluster:
        process, port = cluster.add_server("pytorch", "fake:1")
        assert "working directories cloned" in "\n".join(process.lines)
        conn = rpycdl.connect(host="127.0.0.1", port=port)
        for _ in range(2):  # sent, then named: each job's copy shares the cache's blocks
            extents = conn.root.run_code(subprocess.check_output, ["filefrag", "-v", "weights.bin"],
                                         working_dir=project).decode()
            assert "shared" in extents.splitlines()[-2], extents
        original = (project / "weights.bin").read_bytes()
        changed = conn.root.run_code(_make_writer(), "weights.bin", working_dir=project)
        assert changed == b"changed" + original[7:]  # written in place: the job's blocks, copied on write
        assert conn.root.run_code(Path.read_bytes, Path("weights.bin"), working_dir=project) == original
        conn.close()


def _make_writer() -> Callable[[str], bytes]:
    def write_and_read(name: str) -> bytes:
        """In a job: write over the start of `name` in place, and return its content."""
        with open(name, "r+b") as file:
            file.write(b"changed")
            file.seek(0)
            return file.read()

    return write_and_read


CACHE_STEPS, CACHE_ENOUGH, CACHE_DEADLINE = 30, 30, 300.0
"""Each process of the cache stress test puts and copies at least CACHE_STEPS times, then on until the
processes together have seen CACHE_ENOUGH copies of each end (whole, gone), for CACHE_DEADLINE seconds at
the most: on a busy machine the processes interleave less, and fewer copies find their entry gone."""


def _copy_while_others_evict(root: str, archives: list[bytes], contents: list[bytes], seed: int,
                             report: str, seen: Any) -> None:
    """In one of several processes: put and copy working directories at random in a cache too small for
    two of them, writing to `report` how each copy ended: whole, or gone (evicted before it began); counts
    of both in `seen` (shared with the other processes) until there are enough."""
    import random

    rng, cache, ends = random.Random(seed), workdircache.WorkdirCache(root, 5 * 2**20), []
    deadline = time.monotonic() + CACHE_DEADLINE
    while len(ends) < CACHE_STEPS or (min(seen) < CACHE_ENOUGH and time.monotonic() < deadline):
        chosen = rng.randrange(len(archives))
        digest = cache.receive(lambda sink, data=archives[chosen]: sink(memoryview(data)), 2**24)
        dest = Path(root).parent / f"job-{seed}-{len(ends)}"
        dest.mkdir()
        try:
            cache.unpack(digest, dest, 2**24)
        except KeyError:
            ends.append("gone")
        else:
            files = sorted(dest.iterdir())
            ends.append("whole" if files == [dest / "weights.bin"] and files[0].read_bytes() == contents[chosen]
                        else f"broken: {files}")
            shutil.rmtree(dest)
        if ends[-1] in ("whole", "gone"):
            with seen.get_lock():
                seen[("whole", "gone").index(ends[-1])] += 1
    Path(report).write_text("\n".join(ends))


def test_copies_are_whole_while_processes_fill_and_evict_the_cache(tmp_path):
    """Six processes put and copy three 4 MiB directories at random into a cache that holds one: every
    copy is whole, or refused as gone; none is ever cut by an eviction (the shared flock)."""
    archives, contents = [], []
    for number in range(3):
        source = tmp_path / f"src{number}"
        source.mkdir()
        contents.append(os.urandom(4 * 2**20))
        (source / "weights.bin").write_bytes(contents[-1])
        archives.append(workdir.pack(source, 2**24).data)
    context = multiprocessing.get_context("fork")
    seen = context.Array("i", 2)  # copies whole, copies gone
    reports = [tmp_path / f"report{n}" for n in range(6)]
    processes = [context.Process(target=_copy_while_others_evict,
                                 args=(str(tmp_path / "cache"), archives, contents, n, str(reports[n]), seen))
                 for n in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(CACHE_DEADLINE + 60)
        assert process.exitcode == 0
    ends = [end for report in reports for end in report.read_text().splitlines()]
    assert len(ends) >= 6 * CACHE_STEPS and set(ends) <= {"whole", "gone"}, ends
    # both, many times (about half each on an idle machine)
    assert ends.count("whole") >= CACHE_ENOUGH and ends.count("gone") >= CACHE_ENOUGH, \
        f"{ends.count('whole')} whole and {ends.count('gone')} gone in {len(ends)} copies within {CACHE_DEADLINE:g} s"
    assert not [entry.name for entry in (tmp_path / "cache").iterdir() if entry.name.startswith(".")]
