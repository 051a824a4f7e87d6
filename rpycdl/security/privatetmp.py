"""A job's own /tmp and /dev/shm: a mount namespace of the job process's, with an empty tmpfs on each, as Slurm's
job_container/tmpfs gives each job. Everything the job starts shares them (torchrun's workers, data loaders);
they are gone with its last process. What a job must still see there (its working and output directories, its
saves' socket, the server's Python when it lives in /tmp) is bound back at the same path.

Entered by the job process as root, before it becomes its owner (rpycdl.server.child), and only by a server
that fences its jobs (rpycdl.security.cgroups): a tmpfs's pages count against the job's memory limit."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

from rpycdl.scheduler import procs

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
PRIVATE = ("/tmp", "/dev/shm")


def _libc_call(name: str, *args: object) -> None:
    if getattr(procs.libc(), name)(*args) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{name}: {os.strerror(number)}")


def _mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
    _libc_call("mount", None if source is None else source.encode(), target.encode(),
               None if kind is None else kind.encode(), ctypes.c_ulong(flags),
               None if data is None else data.encode())


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def wanted(env: dict[str, str]) -> list[str]:
    """The paths under /tmp or /dev/shm a job needs to see: the absolute paths of its variables (its working and
    output directories, its saves' socket), this Python's prefixes and module path, and the working directory."""
    candidates = [value for value in env.values() if value.startswith("/")]
    candidates += [sys.prefix, sys.exec_prefix, sys.base_prefix, *sys.path, os.getcwd()]
    found = sorted({os.path.realpath(path) for path in candidates if path and os.path.exists(path)})
    return [path for path in found if _under(path, PRIVATE)]


def enter(size: int, keep: Iterable[str]) -> None:
    """Give this process (and what it starts) a mount namespace of its own with an empty tmpfs of at most `size`
    bytes on /tmp and on /dev/shm, the paths `keep` bound back at their place; TMPDIR is /tmp."""
    _libc_call("unshare", CLONE_NEWNS)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host, nor back
    kept: list[tuple[str, int]] = []  # opened in this namespace: a bind takes a mount of its own namespace only
    try:
        for path in sorted(set(keep)):
            if not any(_under(path, [outer]) for outer, _ in kept):  # a directory bound brings what is in it
                kept.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        for target in PRIVATE:
            if os.path.isdir(target):
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={max(size, 4096)},mode=1777")
        for path, fd in kept:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    finally:
        for _, fd in kept:
            os.close(fd)
    os.environ["TMPDIR"] = "/tmp"
