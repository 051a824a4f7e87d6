"""Processes forked here, and what they leave behind: a detached job's supervisor forks its first job process
itself (HERE, a runner.Launcher), before it holds anything but its job's own files, and is a child subreaper, so
what the job started (even what left its process group or its session) is its descendant, or is adopted by it
when its parent dies; its children that it did not fork itself are such leftovers, killed when the job ends and
reaped meanwhile. (A connection process's jobs, and a supervisor's other processes, come from the server's
forkserver, which does the same for them.)"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from rpycdl.defaults import KILL_WAIT
from rpycdl.errors import LimitError
from rpycdl.scheduler import procs
from rpycdl.security import cgroups
from rpycdl.server import child

_OWN: set[int] = set()
"""The job processes and load checks this process forked and has not reaped yet; any other
child it has was adopted (see adopted)."""

log = logging.getLogger("rpycdl.runner")


def _forked() -> None:
    """In a forked child: nothing is its own yet, and it is not a subreaper (prctl is not inherited)."""
    global _subreaper
    _OWN.clear()
    _subreaper = False


_subreaper = False
os.register_at_fork(after_in_child=_forked)


def fork(what: str, pipes: Sequence[int]) -> int:
    """os.fork() of a process of this one's own (a job process, a load check), this one becoming a
    child subreaper first. If the machine has no process or memory to spare, the `pipes` made for
    the child are closed and LimitError names `what` the process was for."""
    global _subreaper
    if not _subreaper:
        child.become_subreaper()
        _subreaper = True
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in pipes:
            os.close(fd)
        raise LimitError(f"this server could not start a process for {what} ({exc.strerror or exc}); try again "
                         "later or use another server") from exc
    if pid:
        _OWN.add(pid)
    return pid


def reap(pid: int) -> int:
    """Wait for a process of this one's own to end; its wait status (0 if it was reaped already)."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 0
    finally:
        _OWN.discard(pid)
    return status


def adopted() -> list[int]:
    """Children of this process that it did not fork itself: what ended job processes left, adopted
    by this process (a child subreaper)."""
    return [pid for pid in procs.children(os.getpid()) if pid not in _OWN]


def strays() -> list[int]:
    """The adopted processes and everything they started in turn."""
    found = adopted()
    return found + [pid for stray in found for pid in procs.subtree(stray)]


def kill_strays() -> None:
    """SIGKILL what the ended jobs of this process left running, until none of it runs. A process
    that cannot be killed (another user's, or stuck in the kernel) is waited for, however long:
    its GPUs are not free while it runs."""
    def running() -> list[int]:
        return [pid for pid in strays() if procs.alive(pid)]

    def reap_adopted() -> None:
        procs.reap(adopted())

    if not adopted():  # the usual end: the job's group was all there was
        return
    while not procs.kill_until_gone(running, KILL_WAIT, reap_adopted):
        log.warning("processes left by a job still run after SIGKILL: %s", running())
    reap_adopted()


class Forked:
    """A job process or load check forked by this process (runner.Launched)."""

    def __init__(self, pid: int, cgroup: cgroups.JobCgroup | None = None) -> None:
        self.pid = pid
        self.start = procs.identify(pid)[1]
        self.pidfd = os.pidfd_open(pid)
        self.cgroup = cgroup
        self.usage: cgroups.Usage | None = None  # once it has ended, if it had a cgroup
        self._status: int | None = None

    def name_job(self, job_id: str) -> None:
        """Nothing to do: what the job leaves is this process's to kill, whatever its id."""

    def gone(self) -> bool:
        """Whether it was waited for (wait(), which is quick here: no keeper to hear from)."""
        return self._status is not None

    def wait(self) -> int:
        """Reap it, then kill what its job left (kill_strays); its wait status."""
        if self._status is None:
            self._status = reap(self.pid)
            kill_strays()
            if self.cgroup is not None:
                self.usage = self.cgroup.finish()
        return self._status

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class _Here:
    """Forks job processes and load checks from this process (runner.Launcher): a detached job's supervisor, its
    first job process, before it reads anything but its job's own files (later ones, and its load checks, come
    from its server's forkserver: rpycdl.server.forkserver.ForkServerLink)."""

    def launch(self, kind: str, fds: list[int]) -> Forked:
        parent = os.getpid()
        cgroup = cgroups.for_job() if kind == "job" else None
        try:
            pid = fork("the job" if kind == "job" else "a load check", fds)
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            raise
        if pid == 0:
            if kind == "job":
                child.run_job(go_r=fds[0], out_w=fds[1], err_w=fds[2], res_w=fds[3], files=fds[4], parent=parent,
                              cgroup=cgroup)
            child.run_check(go_r=fds[0], res_w=fds[1], files=fds[2], parent=parent)
        for fd in fds:
            os.close(fd)
        return Forked(pid, cgroup)


HERE = _Here()
"""Job processes forked by this process."""
