"""Directories worked through their descriptors, never by a path a user could change: how a process running
as root acts in the lock and state trees and on the directories it hands to users (systemd's chase(), openat2's
RESOLVE_NO_SYMLINKS, Go's os.Root). Each component is opened O_NOFOLLOW from its open parent; owners and modes
change on an entry of an open directory (fchownat without following, fchmod of a descriptor); a tree is walked
by scandir of its descriptors, and measured so (usage). check_trusted says whether a path's every directory is
root's to change."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from rpycdl.errors import LimitError, RpycdlError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""A directory opened without following a link (ELOOP or ENOTDIR if the name is one)."""

ENTRY_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Any entry but a socket or a link opened to act on it (a FIFO's open does not wait for a writer)."""

Visit = Callable[[int, str, os.stat_result], None]
"""Called with an open directory, the name of an entry in it, and the entry's own stat (not a link's target)."""


def open_dir(name: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A descriptor of the directory `name` (in `dir_fd`, if given), refusing a link in its last component."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


@contextlib.contextmanager
def opened_dir(name: str | os.PathLike[str], dir_fd: int | None = None) -> Iterator[int]:
    """open_dir, closed at the end of the block."""
    fd = open_dir(name, dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def walk(fd: int, visit: Visit, skip: Callable[[tuple[str, ...]], bool] = lambda _: False,
         where: tuple[str, ...] = (), deepest: int | None = None) -> None:
    """Visit every entry below the open directory `fd`, a directory's entries before the directory itself
    (`where` is the path of `fd` from the walk's top, as names). An entry for which `skip(path)` is true is
    neither visited nor entered. Entries that go away meanwhile, or cannot be opened, are passed over; no link is
    followed; each directory on the way down is held open until its entries are done.

    Raises:
        LimitError: directories nest deeper than `deepest` levels below the top.
    """
    with os.scandir(fd) as entries:
        found = [(entry.name, entry.stat(follow_symlinks=False)) for entry in _present(entries)
                 if not skip((*where, entry.name))]
    for name, status in found:
        if stat.S_ISDIR(status.st_mode):
            try:
                inner = open_dir(name, fd)
            except OSError:
                continue  # gone, replaced by something else since it was listed, or not this account's to read
            try:
                if deepest is not None and len(where) >= deepest:
                    raise LimitError(f"its directories nest deeper than {deepest} levels")
                walk(inner, visit, skip, (*where, name), deepest)
            finally:
                os.close(inner)
        visit(fd, name, status)


def usage(fd: int, deepest: int) -> int:
    """Bytes the entries below the open directory `fd` take, no link followed (walk): each file once however many
    hard links it has, at the larger of its length and its blocks (a sparse file counts as much as reading it
    gives).

    Raises:
        LimitError: directories nest deeper than `deepest` levels below `fd`.
    """
    total, linked = 0, set[tuple[int, int]]()

    def count(_: int, __: str, status: os.stat_result) -> None:
        nonlocal total
        if status.st_nlink > 1 and not stat.S_ISDIR(status.st_mode):
            if (status.st_dev, status.st_ino) in linked:
                return
            linked.add((status.st_dev, status.st_ino))
        total += max(status.st_size, status.st_blocks * 512)

    walk(fd, count, deepest=deepest)
    return total


def _present(entries: Iterator[os.DirEntry[str]]) -> Iterator[os.DirEntry[str]]:
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            entry.stat(follow_symlinks=False)
            yield entry


def chown_entry(fd: int, name: str, uid: int, gid: int) -> None:
    """Give the entry `name` of the open directory `fd` to uid:gid: the entry itself, a link included, never
    what a link names (fchownat with AT_SYMLINK_NOFOLLOW)."""
    os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)


def chmod_entry(fd: int, name: str, mode: int) -> bool:
    """Set the mode of the entry `name` of the open directory `fd`, through a descriptor of the entry itself;
    False where it cannot be opened so (a link, a socket, gone)."""
    try:
        entry = os.open(name, ENTRY_FLAGS, dir_fd=fd)
    except OSError:
        return False
    try:
        os.fchmod(entry, mode)
    finally:
        os.close(entry)
    return True


def hand_over(parent: str | os.PathLike[str], name: str, uid: int | None, gid: int | None,
              fill: Callable[[Path], None] | None = None) -> bool:
    """Make the directory `name` in `parent` (a directory only this process's account may write) and give it,
    with all that `fill` puts in it, to uid:gid, mode 700. It stays this process's alone (mode 700) until
    everything in it is given, itself last, so that nobody else reaches it before; it is never walked again.
    Where it exists already (handed over before), nothing is done. uid None: it stays this process's. If `fill`
    raises, the directory is removed, and the exception goes on.

    Returns:
        Whether it was made now.
    """
    with opened_dir(parent) as parent_fd:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            return False
        with opened_dir(name, parent_fd) as fd:
            if fill is not None:
                try:
                    fill(Path(parent, name))
                except BaseException:
                    shutil.rmtree(Path(parent, name), ignore_errors=True)  # fd-based: follows no link
                    raise
            if uid is not None and gid is not None:
                walk(fd, lambda at, entry, _: chown_entry(at, entry, uid, gid))
                os.fchown(fd, uid, gid)
            os.fchmod(fd, 0o700)
    return True


def check_trusted(path: str | os.PathLike[str], what: str) -> None:
    """Refuse `path` unless no account but root can change what it names: it is root's (if it exists yet), and
    each directory above it is root's and writable by root (and root's group) alone, or sticky (/tmp) with its
    next entry root's; each link on the way is root's. Meant for a process running as root, before it acts on
    paths under `path` (whose own modes are its to keep: lockdir.make_private).

    Raises:
        RpycdlError: naming the directory (or link) another account could change, whose it is, and what to do.
    """
    current = Path("/")
    for part in Path(os.path.abspath(path)).parts[1:]:
        status, entry = os.lstat(current), current / part
        found = _lstat(entry)
        if _others_write(status) and not (status.st_mode & stat.S_ISVTX):
            raise _untrusted(what, path, current, status, "is writable by others than root")
        if found is None:
            return  # made later, by this process, in a directory only root changes (or sticky: checked again)
        if found.st_uid != 0:
            raise _untrusted(what, path, entry, found, "belongs to another account than root")
        current = Path(os.path.realpath(entry)) if stat.S_ISLNK(found.st_mode) else entry


def _others_write(status: os.stat_result) -> bool:
    """Whether a directory is writable by another account than root (its group, unless root's; or anyone)."""
    return bool(status.st_mode & 0o002 or (status.st_mode & 0o020 and status.st_gid != 0) or status.st_uid != 0)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _untrusted(what: str, path: str | os.PathLike[str], where: Path, status: os.stat_result, why: str) -> RpycdlError:
    return RpycdlError(
        f"the {what} {os.fspath(path)} cannot be trusted by a process running as root: {where} {why} (owner uid "
        f"{status.st_uid}, mode {stat.S_IMODE(status.st_mode):o}), so another user could swap what the path names "
        f"(docs/security.md, Root and paths): use a directory whose every parent is root's alone, such as "
        f"/var/lib/rpycdl (install -d -m 2751 -g GROUP DIR), or remove {where} if another user made it")
