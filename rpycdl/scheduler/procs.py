"""The processes of a job, as Linux's /proc shows them: who they are, whether any still runs, killing them.

A process is named by its pid and its start time (`Pid`), so a pid the kernel has given to
another process since is never taken for the one recorded. A zombie (dead, not yet reaped)
counts as gone: it runs nothing and holds no GPU.

A job's processes are found three ways, from the surest to the widest:

- its connection process is a child subreaper, so everything the job started is in that
  process's subtree, even what left the job's session, for as long as it lives (`subtree`);
- its server parent is a subreaper too, and adopts what is left when a connection process dies;
- from anywhere on the host (`job_processes`): the job's session (the job process leads one)
  and every process whose environment names the job (RPYCDL_JOB_ID, which every program the
  job runs inherits, containers included).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

JOB_ID_VARIABLE = "RPYCDL_JOB_ID"
"""Set in every job's environment: its id."""

Pid = tuple[int, int]
"""A process: (pid, start time in clock ticks since boot)."""


@dataclass(frozen=True)
class Stat:
    """What /proc/PID/stat says of a process."""

    state: str
    ppid: int
    pgrp: int
    session: int
    start: int

    @property
    def running(self) -> bool:
        """Not a zombie: it still runs, or could."""
        return self.state not in "ZX"


def stat(pid: int) -> Stat | None:
    """The process's stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
    except (OSError, ValueError):
        return None
    return Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def identify(pid: int) -> Pid:
    """(pid, start time) of a live process; start 0 if it is already gone."""
    found = stat(pid)
    return pid, found.start if found else 0


def myself() -> Pid:
    """(pid, start time) of this process, read once per process."""
    global _myself
    if _myself is None or _myself[0] != os.getpid():
        _myself = identify(os.getpid())
    return _myself


_myself: Pid | None = None


def alive(pid: int, start: int = 0) -> bool:
    """Whether the process runs (not a zombie), and is the one started at `start` if given."""
    found = stat(pid) if pid > 0 else None
    return found is not None and found.running and (not start or found.start == start)


def children(pid: int) -> list[int]:
    """The direct children of `pid` (of every thread), none if it is gone."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as listed:
                found.extend(int(child) for child in listed.read().split())
    return found


def subtree(pid: int) -> list[int]:
    """Every descendant of `pid`, parents before their children."""
    found, index = children(pid), 0
    while index < len(found):
        found.extend(children(found[index]))
        index += 1
    return found


def pids() -> list[int]:
    """Every process of this PID namespace."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def environment_names(pid: int, job_id: str) -> bool:
    """Whether the process's environment says it belongs to job `job_id` (False where unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return f"\0{JOB_ID_VARIABLE}={job_id}\0".encode() in b"\0" + file.read()
    except OSError:
        return False


def named(pid: int, name: str) -> bool:
    """Whether the process is one of this account's named `name` (/proc/PID/comm, as child.name_process sets it):
    how a server tells its keepers and supervisors, forked from its forkserver, from what dead jobs left. A job of a
    root server runs as its owner, so none passes for one of them."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            found = comm.read().strip() == name
        return found and os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def runs_module(pid: int, module: str) -> bool:
    """Whether the process runs `python -m module` (False where unreadable)."""
    return module_args(pid, module) is not None


def module_args(pid: int, module: str) -> list[str] | None:
    """The arguments after `-m module` of a process running `python -m module`; None if it runs
    something else (or is unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            args = file.read().split(b"\0")
    except OSError:
        return None
    for index, (flag, name) in enumerate(zip(args, args[1:], strict=False)):
        if flag == b"-m" and name == module.encode():
            return [arg.decode(errors="replace") for arg in args[index + 2:] if arg]
    return None


def job_processes(job_id: str, leader: Pid | None = None) -> list[int]:
    """The live processes of a job, found from anywhere on the host: the session that `leader`
    (the job process) leads, and every process whose environment names the job. One pass over
    /proc: a few milliseconds on a busy host."""
    session = 0
    if leader is not None and leader[0] > 0:
        found = stat(leader[0])
        # The kernel gives no process a pid still in use as a session id, so members of a session
        # whose leader is gone are the job's; a live process with that pid but another start is not.
        session = leader[0] if found is None or not leader[1] or found.start == leader[1] else 0
    members = []
    for pid in pids():
        found = stat(pid)
        if found is not None and found.running and (
                (session and found.session == session) or (job_id and environment_names(pid, job_id))):
            members.append(pid)
    return members


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Signal each process; one already gone, or not ours to signal, is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_until_gone(find: Callable[[], list[int]], timeout: float, reap: Callable[[], None] | None = None) -> bool:
    """SIGKILL what `find()` returns until it returns nothing (or `timeout` passes); `reap` is
    called between rounds (a subreaper reaps its adopted children). True if nothing is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = find()
        if not left:
            return True
        if time.monotonic() >= deadline:
            return False
        kill(left)
        if reap is not None:
            reap()
        time.sleep(0.002)


def reaped() -> list[tuple[int, int]]:
    """This process's children that have ended, reaped now without blocking: (pid, wait status) of each."""
    found = []
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            found.append((pid, status))
    return found


def reap(pids: Iterable[int]) -> None:
    """Reap those of `pids` that are this process's ended children (without blocking)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


@functools.cache
def libc() -> ctypes.CDLL:
    """This process's C library, loaded once: each ctypes.CDLL builds its classes anew (about 0.1 ms, four times in
    each connection process). For the calls Python's os has not: prctl, unshare, mount, bpf."""
    return ctypes.CDLL(None, use_errno=True)

