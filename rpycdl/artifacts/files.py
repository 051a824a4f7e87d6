"""Files of jobs, read without following links and copied in the kernel: what the artifact store and the
working directories' cache need of the filesystem (open_beneath, copy_range, identity)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from rpycdl.errors import InvalidRequestError

COPY_CHUNK = 8 * 1024**2
"""Bytes copied at a time, and so the steps in which copy_range reports its progress."""

FALLOC_FL_KEEP_SIZE = 1
SYNC_FILE_RANGE_WRITE = 2
FICLONE = 0x40049409
_NO_CLONE = (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EPERM)

_libc = ctypes.CDLL(None, use_errno=True)

Identity = tuple[int, int, int, int, int, int]
"""A file as stat sees it: (device, inode, mode, size, mtime in ns, ctime in ns). Writing to a file changes
its size or its times (ctime cannot be set from user space), so an identity unchanged says the content is
unchanged, but within one tick of the kernel's clock, or through a shared mapping not yet synced."""


BAD_CHARACTERS = "\n\r\0"
"""Characters no name of a job's file may hold (they would break a line of a listing or a C string)."""


def plain_relative(name: str, bad: str = BAD_CHARACTERS) -> bool:
    """Whether `name` is a relative POSIX path without empty, '.' or '..' components, nor any of `bad`."""
    return all(part not in ("", ".", "..") and not any(c in part for c in bad) for part in name.split("/"))


def check_name(name: Any) -> str:
    """`name` if it can name an artifact: a relative POSIX path without empty, '.' or '..' components, NUL,
    newlines or backslashes; else InvalidRequestError naming it."""
    if not isinstance(name, str) or not plain_relative(name, BAD_CHARACTERS + "\\"):
        raise InvalidRequestError(f"not an artifact's name: {name!r} (a relative path without empty, '.' or '..' "
                                  "components, NUL, newlines or backslashes)")
    return name


def identity(status: os.stat_result) -> Identity:
    """The identity of the file `status` describes."""
    return (status.st_dev, status.st_ino, status.st_mode, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def open_beneath(directory: str | os.PathLike[str], name: str) -> int:
    """Open the regular file `name` (a relative POSIX path) under `directory` for reading, following no
    symbolic link on the way (the directory itself included): each component is opened O_NOFOLLOW from
    its open parent. The caller closes the descriptor.

    Raises:
        FileNotFoundError: there is no such file.
        IsADirectoryError / OSError(ELOOP): it, or a directory on the way, is a symbolic link or not a
            regular file (ELOOP: a link; EINVAL: a device, FIFO, socket or directory).
    """
    parts = name.split("/")
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        found = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(found).st_mode):
        os.close(found)
        raise OSError(errno.EINVAL, f"not a regular file: {name}")
    return found


def preallocate(fd: int, size: int) -> None:
    """Reserve the disk space of `size` bytes for the file `fd`, its size unchanged (fallocate(2) with
    FALLOC_FL_KEEP_SIZE), so that writing it allocates nothing on the way: a third faster on ext4. Nothing
    where the filesystem cannot (never emulated by writing, as posix_fallocate would)."""
    if size > 0:
        _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(size))


def start_writeback(fd: int) -> None:
    """Start writing the file `fd`'s dirty pages to its disk, without waiting (sync_file_range(2) with
    SYNC_FILE_RANGE_WRITE): a clone of it then waits for less (reflinks need the bytes on disk)."""
    _libc.sync_file_range(fd, ctypes.c_long(0), ctypes.c_long(0), SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, data: memoryview) -> None:
    """Write all of `data` to the file `fd` at its position."""
    while data:
        data = data[os.write(fd, data):]


def clone(source: int, target: int, size: int) -> None:
    """Make the empty file `target` a copy of the `size` bytes of `source`: a clone sharing their blocks
    until either is written (FICLONE: XFS, btrfs, bcachefs, ZFS's block cloning; nothing copied), else a
    copy in the kernel (copy_range)."""
    if size and not _cloned(source, target) and copy_range(source, target, size) != size:
        raise OSError(errno.EIO, "the file was cut short while it was copied")


def can_clone(directory: str | os.PathLike[str]) -> bool:
    """Whether the filesystem of `directory` clones files (see clone), tried on two of its files."""
    with tempfile.TemporaryFile(dir=directory) as source, tempfile.TemporaryFile(dir=directory) as target:
        source.write(bytes(4096))
        source.flush()
        return _cloned(source.fileno(), target.fileno())


def _cloned(source: int, target: int) -> bool:
    """Clone `source` into `target` (FICLONE); False where the filesystem cannot."""
    try:
        fcntl.ioctl(target, FICLONE, source)
    except OSError as exc:
        if exc.errno not in _NO_CLONE:
            raise
        return False
    return True


def copy_range(source: int, target: int, count: int, on_progress: Callable[[int], None] | None = None) -> int:
    """Copy up to `count` bytes of the file `source` from its start to the file `target` at its position,
    in the kernel (copy_file_range, else sendfile: no byte through this process's memory, and a reflink on
    filesystems that have them), by COPY_CHUNK, telling `on_progress`. Stops early at the end of
    `source`; returns the bytes copied."""
    preallocate(target, count)
    copied = 0
    calls: list[Callable[[int], int]] = [
        lambda size: os.copy_file_range(source, target, size, copied),
        lambda size: os.sendfile(target, source, copied, size),
    ]
    while copied < count:
        size = min(COPY_CHUNK, count - copied)
        try:
            moved = calls[0](size)
        except OSError as exc:  # another filesystem (before Linux 5.19's checks), or none of the calls
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL) or len(calls) == 1:
                raise
            calls.pop(0)
            continue
        if not moved:
            break
        copied += moved
        if on_progress is not None:
            on_progress(moved)
    return copied

