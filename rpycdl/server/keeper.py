"""A job's keeper (rpycdl-keeper): the one process of a running job's own that outlives every shared process.

The forkserver forks one keeper for each job process or load check a connection asks for, hands it the
request's descriptors, and forgets it (it only reaps it once it ends). The keeper leaves the forkserver's
session for one of its own, keeps nothing of the forkserver's but those descriptors, becomes a child
subreaper, and forks the job process, which dies with it (PR_SET_PDEATHSIG). On the control socket it tells
the requester the job process's pid, start time and pidfd, and it kills the job once the requester closes it
(the requester died, or let the job go). Once the job process has ended it kills whatever the job left
(everything the job started is in its subtree: it is a child subreaper), tells the requester the job's wait
status once nothing of it runs, and exits; or, a job's keeper, waits for the requester to ask it for another job
process (AGAIN, with that one's descriptors: a supervisor's, which runs an array's elements in turn), and keeps that
one the same way. While the job runs, what the job started stays, even if its parent died.

So the death of the forkserver, the server parent or any other shared process ends no running job; the
death of the keeper ends its job alone (its job process dies with it, and what the job left is killed by
whichever rpycdl process notices first: the forkserver or the server, which adopt it, or the requester,
which finds it by the job's id and session: forklink.Launched.wait)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
from typing import NoReturn

from rpycdl.defaults import SWEEP_INTERVAL
from rpycdl.scheduler import procs
from rpycdl.security import cgroups
from rpycdl.server import child

NAME = "rpycdl-keeper"
PID = struct.Struct("<iQ")  # reply: pid, start time, then the name of its cgroup (if it has one)
STATUS = struct.Struct("<i")  # end: wait status, then the JSON of its cgroup's usage (if it had one)
AGAIN = b"again"  # the requester to a job's keeper once its end was told: keep another job process (its descriptors)
JOB_FDS = 5  # a job process's descriptors: go, stdout, stderr, result, files


def keep(kind: str, control: int, fds: list[int]) -> NoReturn:
    """In a child the forkserver just forked: become the keeper of a new process of `kind` ("job" or "check")
    whose descriptors are `fds`, its requester on the socket `control`; a job's keeper then keeps each job process
    the requester asks it for AGAIN, one at a time, until the requester closes the socket. Never returns."""
    try:
        child.keep_only([control, *fds])
        os.setsid()  # no signal to the forkserver's group reaches a job's keeper
        child.name_process(NAME)
        child.become_subreaper()
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        requester = socket.socket(fileno=control)
        while _keep_one(kind, requester, fds, wake_r) and kind == "job":
            fds = _asked_again(requester)
            if not fds:
                break
    finally:
        os._exit(0)


def _keep_one(kind: str, requester: socket.socket, fds: list[int], wake_r: int) -> bool:
    """Fork a process of `kind` with `fds` and keep it to its end; whether its requester was told that end (it
    still holds its socket)."""
    me = os.getpid()
    cgroup = cgroups.for_job() if kind == "job" else None  # named after this process (cgroups.keeper_of)
    try:
        pid = os.fork()
    except OSError:
        if cgroup is not None:
            cgroup.remove()
        return False  # the requester reads an empty reply once this process has exited: LimitError
    if pid == 0:
        signal.set_wakeup_fd(-1)  # its other signals are reset by child._start
        if kind == "job":  # it keeps nothing of the keeper's but `fds` (child.keep_only)
            child.run_job(go_r=fds[0], out_w=fds[1], err_w=fds[2], res_w=fds[3], files=fds[4], parent=me,
                          cgroup=cgroup)
        child.run_check(go_r=fds[0], res_w=fds[1], files=fds[2], parent=me)
    for fd in fds:
        os.close(fd)
    return _Keeper(requester, pid, wake_r, cgroup).run()


def _asked_again(requester: socket.socket) -> list[int]:
    """Wait, with nothing of a job left, for the requester to ask for another job process (AGAIN, with its
    descriptors: forklink.ForkServerLink.launch); [] once it has closed its socket, or asked amiss."""
    try:
        data, fds, _, _ = socket.recv_fds(requester, 256, JOB_FDS)
    except OSError:
        return []
    if data == AGAIN and len(fds) == JOB_FDS:
        return fds
    for fd in fds:
        os.close(fd)
    return []


class _Keeper:
    """The keeper's loop: its requester's messages, its job process's end, what the job left."""

    def __init__(self, requester: socket.socket, pid: int, wake_r: int, cgroup: cgroups.JobCgroup | None) -> None:
        self.requester = requester
        self.cgroup = cgroup
        self.pid = pid
        self.wake_r = wake_r
        self.watched = True  # the requester still holds its control socket
        self.status: int | None = None  # once the job process is reaped
        pidfd = os.pidfd_open(pid)
        try:
            named = b"" if cgroup is None else cgroup.name.encode()
            socket.send_fds(requester, [PID.pack(pid, procs.identify(pid)[1]) + named], [pidfd])
        except OSError:  # the requester is gone already
            self._let_go()
        finally:
            os.close(pidfd)

    def run(self) -> bool:
        """Until the job process and everything of its job are gone; whether the requester was told so."""
        while True:
            watched = [self.requester] if self.watched else []
            if select.select([self.wake_r, *watched], [], [], SWEEP_INTERVAL)[0].count(self.requester):
                self._told()
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
            self._reap()
            if self.status is not None and self._gone():
                usage = b"" if self.cgroup is None else json.dumps(self.cgroup.usage().to_dict()).encode()  # empty
                try:
                    self.requester.send(STATUS.pack(self.status) + usage)
                except OSError:  # the requester is gone
                    self.watched = False
                if self.cgroup is not None:  # once its end is told: the GPUs do not wait for the kernel's rmdir
                    self.cgroup.remove()
                return self.watched

    def _told(self) -> None:
        try:
            data = self.requester.recv(256)
        except OSError:
            data = b""
        if not data:  # the requester is gone: so is its job (it sends nothing else)
            self._let_go()

    def _let_go(self) -> None:
        self.watched = False
        procs.kill_group(self.pid)
        procs.kill([self.pid])

    def _reap(self) -> None:
        for pid, status in procs.reaped():
            if pid == self.pid:
                self.status = status

    def _gone(self) -> bool:
        """Once the job process has ended: kill what it left; whether none runs."""
        found = left(os.getpid(), self.cgroup)
        procs.kill(found)
        return not found


def left(keeper: int, cgroup: cgroups.JobCgroup | None) -> list[int]:
    """What runs of a job whose job process has ended: the live processes of its keeper's subtree (all the job
    started, however their parents died: the keeper is their subreaper), and those in its cgroup (however they left
    the subtree: nothing does, but a cgroup is exact). Its keeper's check, which its requester makes too, so as not
    to wait for the keeper's word (forklink.Launched.gone)."""
    found = [pid for pid in procs.subtree(keeper) if procs.alive(pid)]
    if cgroup is not None:
        found += sorted(cgroup.pids() - set(found))
    return found
