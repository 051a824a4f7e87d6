"""The lock directory's files, for rpycdl.locks: created writable by every user (or private to root's on a
host whose servers run as root), never loosened once made, never through a link, JSON records
replaced atomically, this process's descriptors of the lock files, probes of the fcntl locks
other processes hold (F_GETLK, which takes nothing), and the waiters' wake-up FIFOs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from rpycdl.errors import RpycdlError
from rpycdl.scheduler import dirfds
from rpycdl.scheduler.planning import Range

_FDS: dict[str, int] = {}  # a descriptor of each lock file (and queue.lock), open for the process's life
_FLOCK = "hhqqi4x"  # struct flock on Linux: type, whence, start, len, pid
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC

SHARED_DIR_MODE = 0o777
"""Servers of every user (host processes, containers of other uids) write in the lock directory.
No sticky bit: records are replaced by rename, which a sticky directory forbids across users."""
SHARED_FILE_MODE = 0o666

PRIVATE_DIR_MODE = 0o2751
"""On a host whose servers run as root: root writes, the directory's group (a monitor's) reads, others may only
pass through, to their own jobs' directories. Set-group-ID: what is made in it takes its group, the one the
operator gave the lock directory (docs/security.md, Modes)."""
PRIVATE_FILE_MODE = 0o640
PRIVATE_FIFO_MODE = 0o660
"""A waiter's wake-up FIFO: its group (a monitor) opens it for writing to see the waiter lives."""
PRIVATE_UMASK = 0o027

_MODES = {"dir": SHARED_DIR_MODE, "file": SHARED_FILE_MODE, "fifo": SHARED_FILE_MODE}
"""The modes this process gives what it creates in the lock and state directories."""

_READ_ONLY: list[bool] = [False]
"""Whether this process only reads the lock and state directories (a monitor): it makes and changes nothing."""


def use_private_modes() -> None:
    """Give what this process creates in the lock and state directories the private modes (PRIVATE_DIR_MODE),
    as the processes of a server running as root do."""
    _MODES.update(dir=PRIVATE_DIR_MODE, file=PRIVATE_FILE_MODE, fifo=PRIVATE_FIFO_MODE)
    os.umask(PRIVATE_UMASK)


def read_only() -> None:
    """Make this process a reader of the lock and state directories: shared_dir and shared_file create
    nothing, lock files are opened for reading (probes need no more), writes raise PermissionError."""
    _READ_ONLY[0] = True


def writable() -> bool:
    """Whether this process may create and change files in the lock and state directories (not read_only)."""
    return not _READ_ONLY[0]


def file_mode() -> int:
    """The mode of the files this process creates in the lock and state directories."""
    return _MODES["file"]


def fifo_mode() -> int:
    """The mode of the wake-up FIFOs this process creates in the lock directory."""
    return _MODES["fifo"]


SKIPPED_BY_OWNER = ("output", "work")
"""Directories in a job's directory that are its owner's (server.jobdirs): make_private leaves them as they are."""


def make_private(root: Path, skip: tuple[str, ...] = ()) -> None:
    """Take from every directory and file under `root` the modes the private ones do not give (write for the
    group; all for the rest, but passing through directories): a server that ran every job as itself may have
    shared them. Done through descriptors, following no link; the directories named `skip` (at any depth) and the
    jobs' own directories (SKIPPED_BY_OWNER) are left as they are.

    Raises:
        RpycdlError: an entry belongs to another account than this process's: another account could change
            it still (or hold it open), so this process does not work in that tree.
    """
    foreign: list[str] = []

    def tighten(fd: int, name: str, status: os.stat_result) -> None:
        if stat.S_ISLNK(status.st_mode):
            return
        if status.st_uid != os.geteuid():
            foreign.append(name)
            return
        mode = stat.S_IMODE(status.st_mode)
        taken = 0o007 if stat.S_ISFIFO(status.st_mode) else PRIVATE_UMASK  # a FIFO's group writes: PRIVATE_FIFO_MODE
        if mode & taken:
            dirfds.chmod_entry(fd, name, mode & ~taken | (0o001 if stat.S_ISDIR(status.st_mode) else 0))

    def skipped(where: tuple[str, ...]) -> bool:
        return where[-1] in skip or (len(where) >= 3 and where[-3] == "jobs" and where[-1] in SKIPPED_BY_OWNER)

    with dirfds.opened_dir(root) as top:
        dirfds.walk(top, tighten, skipped)
        tighten(top, ".", os.fstat(top))
    if foreign:
        raise RpycdlError(f"{root} holds files of other accounts than root ({', '.join(sorted(foreign)[:3])}"
                          f"{', ...' if len(foreign) > 3 else ''}): a server running as root works only in a tree "
                          "no other account can change. Stop every server using it and remove it (its ledger "
                          "too, or chown -R root it), or choose another --lock-dir/--state-dir")


def shared_dir(path: Path) -> None:
    """Make a directory of the lock directory (its parents too) with this process's mode for it; one that
    exists keeps its mode and owner. Nothing in a read-only process."""
    if _READ_ONLY[0] or path.is_dir():
        return
    shared_dir(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    with dirfds.opened_dir(path) as fd:
        os.fchmod(fd, _MODES["dir"] | (os.fstat(fd).st_mode & stat.S_ISGID))  # set-group-ID passes on


def shared_file(path: Path, data: bytes | None = None) -> None:
    """Create `path` with this process's mode for it: empty if absent (data None), else replaced atomically
    (written aside, in a file made now, then renamed). A file that exists keeps its mode; no link is
    followed. Nothing in a read-only process for an empty file; PermissionError for data.
    """
    if data is None and (_READ_ONLY[0] or path.exists()):
        return  # never reopen a lock file: closing a second descriptor would drop our fcntl lock
    if _READ_ONLY[0]:
        raise PermissionError(f"a reader of the lock directory writes nothing: {path}")
    target = path if data is None else path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if data is not None:
        target.unlink(missing_ok=True)  # a process of this pid that died writing it left it
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, _MODES["file"])
    except FileExistsError:
        return  # another process made the lock file meanwhile
    try:
        os.fchmod(fd, _MODES["file"])
        if data is not None:
            os.write(fd, data)
    finally:
        os.close(fd)
    if data is not None:
        os.replace(target, path)


def new_file(path: Path, data: bytes) -> None:
    """Create `path` holding `data`, with this process's mode for it, in one write, no link followed (a name that
    exists: FileExistsError). Cheaper than shared_file's replace (one directory entry made, none renamed), and not
    atomic as it is: a reader that comes between the create and the write reads nothing, and one of a process
    killed meanwhile an empty file. Only for a record read as absent until whole (read_json reads a truncated
    record as None), written once under a lock that its pruner holds too (a queue row).
    """
    if _READ_ONLY[0]:
        raise PermissionError(f"a reader of the lock directory writes nothing: {path}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, _MODES["file"])
    try:
        os.fchmod(fd, _MODES["file"])
        os.write(fd, data)
    finally:
        os.close(fd)


def open_once(path: str) -> int:
    """This process's descriptor of a lock file (created if absent), opened once and never closed:
    closing any descriptor of a file drops the fcntl locks the process holds in it."""
    fd = _FDS.get(path)
    if fd is None:
        shared_file(Path(path))
        fd = _FDS[path] = os.open(path, (os.O_RDONLY if _READ_ONLY[0] else os.O_RDWR) | _NOFOLLOW)
    return fd


def claim(directory: Path, name: str) -> list[str]:
    """Mark `directory/name` as in use for as long as this process lives (a shared lock on that file, kept
    by open_once's descriptor); returns the other names of `directory` that a live process marks."""
    shared_dir(directory)
    fcntl.lockf(open_once(str(directory / name)), fcntl.LOCK_SH | fcntl.LOCK_NB)
    return [other for other in names(directory, "", "")  # a name with a dot is no mark: a file beside one, a temp
            if other != name and "." not in other and others(open_once(str(directory / other)), 0, 0, [])]


def claim_pid_namespace(root: Path) -> None:
    """Mark the lock directory `root` as used by this process's PID namespace, for as long as this
    process lives (a shared lock on pid-namespaces/<namespace>); refuse if a live process of
    another namespace holds such a mark. Every server sharing a lock directory must see the
    processes of every job (to find what a crashed job left, and to check pids the records name).

    Raises:
        RpycdlError: a server in another PID namespace uses the lock directory.
    """
    mine = str(os.stat("/proc/self/ns/pid").st_ino)
    for name in claim(root / "pid-namespaces", mine):
        raise RpycdlError(
            f"the lock directory {root} is used by servers in another PID namespace (pid:[{name}], this is "
            f"pid:[{mine}]); servers sharing a lock directory must see each other's processes: run server "
            "containers with --pid host (rpycdl up and scripts/start_servers.sh do)")


def claim_isolation(root: Path, mode: str) -> None:
    """Mark the lock directory `root` as used by servers running jobs in the isolation `mode`
    (security.accounts: "owner accounts" or "one account"), for as long as this process lives; refuse if a live
    server of the other mode marks it. The modes of the lock and state directories' files differ between them.

    Raises:
        RpycdlError: a server of the other mode uses the lock directory.
    """
    key = mode.replace(" ", "-")
    for other in claim(root / "isolation", key):
        raise RpycdlError(f"the lock directory {root} is used by servers that run jobs with isolation "
                          f"{other.replace('-', ' ')!r}, and this one would use {mode!r}: every server sharing a lock "
                          "directory must run as root (each job as its owner), or none (or all with --one-account)")


def host_isolation(root: Path) -> str | None:
    """The isolation mode the live servers of a lock directory run jobs in (None: no server lives)."""
    folder = root / "isolation"
    for key in names(folder, "", "") if folder.is_dir() else ():
        if "." not in key and others(open_once(str(folder / key)), 0, 0, []):
            return key.replace("-", " ")
    return None


def claim_fencing(root: Path, mark: str) -> None:
    """Mark the lock directory `root` as used by a server that fences its jobs so (`mark`: cgroup-v1, cgroup-v2 or
    none: rpycdl.security.cgroups.mark), for as long as this process lives; servers of different fencing may share
    it (the monitor says which live: host_fencing)."""
    claim(root / "fencing", mark)


def host_fencing(root: Path) -> list[str]:
    """How the live servers of a lock directory fence their jobs ("cgroup v1", "cgroup v2", "none"), sorted."""
    folder = root / "fencing"
    return sorted(key.replace("-", " ") for key in (names(folder, "", "") if folder.is_dir() else ())
                  if "." not in key and others(open_once(str(folder / key)), 0, 0, []))


def isolation_marks(root: Path) -> set[str]:
    """The isolation modes of every server that has used the lock directory `root`, live or not (their marks
    stay after them)."""
    folder = root / "isolation"
    return {key.replace("-", " ") for key in (names(folder, "", "") if folder.is_dir() else ()) if "." not in key}


def names(directory: Path, prefix: str, suffix: str) -> list[str]:
    """Names in `directory` with that prefix and suffix, none if there is no such directory (yet: a reader's)
    (no glob: its pattern would be compiled again in every new connection process)."""
    try:
        found = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [name for name in found if name.startswith(prefix) and name.endswith(suffix)]


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace the record at `path` with `data`, atomically (readers see the old or the new)."""
    shared_file(path, json.dumps(data).encode())


def read_json(path: Path) -> dict[str, Any] | None:
    """The record at `path`, or None if it is gone or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        try:
            return json.loads(file.read())
        except (OSError, ValueError):
            return None


def others(fd: int, start: int, end: int, found: list[Range]) -> list[Range]:
    """Append to `found` the ranges in [start, end) of the file that other processes lock, clipped
    (end 0: to infinity; a whole-file lock is then reported as (0, 0)); returns `found`.

    F_GETLK reports one conflicting lock at a time, in no particular order, so the search
    splits around each one it finds."""
    query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, end - start if end else 0, 0)
    kind, _, lock_start, lock_len, _ = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    if kind == fcntl.F_UNLCK:
        return found
    first = max(start, lock_start)
    if not end:
        found.append((first, lock_len))
        return found
    last = end if lock_len == 0 else min(end, lock_start + lock_len)
    found.append((first, last - first))
    if start < first:
        others(fd, start, first, found)
    if last < end:
        others(fd, last, end, found)
    return found


def fifo_has_reader(fifo: Path) -> bool:
    """Whether a waiter still has its wake-up FIFO open (it is alive)."""
    try:
        if not stat.S_ISFIFO(os.stat(fifo).st_mode):
            return False
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:  # ENXIO: nobody has it open for reading; ENOENT: gone
        return False
    os.close(fd)
    return True


def poke(fifo: Path) -> None:
    """Wake the waiter reading `fifo`, if there is one, without blocking."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return
    try:
        os.write(fd, b"!")
    except OSError as exc:  # a full pipe already holds a wake-up; a broken one lost its waiter
        if exc.errno not in (errno.EAGAIN, errno.EPIPE):
            raise
    finally:
        os.close(fd)


def drain(fd: int) -> bytes:
    """Read a non-blocking pipe or FIFO empty (a waiter's wake-ups count as one); returns what it held."""
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 4096):
            data += chunk
    return data
