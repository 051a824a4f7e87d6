"""The requesters' side of the job forkserver (rpycdl.server.forkserver): a connection to it that asks for
processes (ForkServerLink, a runner.Launcher), and each process it forks for them (Launched), read as its keeper
tells it. Its own module, so that a detached job's supervisor, which the forkserver forks, reaches it without an
import in a circle."""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket

from rpycdl.defaults import KILL_WAIT
from rpycdl.errors import LimitError
from rpycdl.scheduler import procs
from rpycdl.security import cgroups
from rpycdl.server.keeper import AGAIN, PID, STATUS, left

IDLE_KEEPERS = 1
"""Keepers of a process's ended jobs kept for its next ones (ForkServerLink.rest): that of the one that ended last."""


class Launched:
    """A process the forkserver forks for this one (through its keeper): its pid and start time, a pidfd
    (readable once it has exited), and the control socket its end comes on. The keeper's reply (pid, start
    time, pidfd) is read when one of them is first needed, so that the requester goes on while the forkserver forks
    (a connection's next spare is asked for as its job takes one, and taken by the next job); reading it raises
    LimitError if the forkserver could not fork, or is gone. A job's keeper whose word on its end came goes back to
    `link` once this is closed, to keep the requester's next job process (ForkServerLink.rest)."""

    def __init__(self, control: socket.socket, link: ForkServerLink | None = None) -> None:
        self.control = control
        self._link, self._asker = link, os.getpid()
        self._kept = False  # its keeper told its end: it waits for another job process to keep (keeper.AGAIN)
        self.status: int | None = None
        self.usage: cgroups.Usage | None = None  # once it has ended, if its job had a cgroup
        self._told: tuple[int, int, int] | None = None
        self._failed = ""
        self._job_id = ""
        self._cgroup = ""  # the name of its job's cgroup, if it has one

    @property
    def pid(self) -> int:
        return self._reply()[0]

    @property
    def start(self) -> int:
        return self._reply()[1]

    @property
    def pidfd(self) -> int:
        return self._reply()[2]

    def _reply(self) -> tuple[int, int, int]:
        if self._told is None and not self._failed:
            try:
                data, fds_back, _, _ = socket.recv_fds(self.control, 4096, 1)
            except OSError as exc:
                data, fds_back, self._failed = b"", [], f"its forkserver: {exc}"
            if len(data) >= PID.size and fds_back:
                self._told = (*PID.unpack(data[:PID.size]), fds_back[0])
                self._cgroup = data[PID.size:].decode()
            else:
                for fd in fds_back:
                    os.close(fd)
                self._failed = self._failed or "its forkserver could not fork"
        if self._told is None:
            raise LimitError(f"this server could not start a process for the job ({self._failed}); try again later "
                             "or use another server")
        return self._told

    def name_job(self, job_id: str) -> None:
        """The job's id, by which what the job started is found should its keeper die (wait)."""
        self._job_id = job_id

    def gone(self) -> bool:
        """Once it was killed: wait for its exit, then whether nothing of its job runs, told here without waiting for
        its keeper's word: the keeper's own check (keeper.left) on the keeper's subtree and the job's cgroup, made
        while the keeper lives (so that all the job started is in one or the other). Only for a job with a cgroup,
        which is named after its keeper; False where it cannot be told here, or something runs (wait() then waits for
        the keeper)."""
        if self.status is not None:
            return True
        found = cgroups.hierarchy()
        if self._told is None or not self._cgroup or isinstance(found, str) or self._told[2] < 0:
            return False
        select.select([self._told[2]], [], [])  # readable once it has exited (its keeper dead or not)
        keeper = cgroups.keeper_of(self._cgroup)
        return not left(keeper[0], found.job(self._cgroup)) and procs.alive(*keeper)

    def wait(self) -> int:
        """Block until the process and everything of its job are gone; its wait status. Should its keeper die
        first (its job process dies with it), what the job left is killed here before this returns."""
        if self.status is None:
            data = b""
            with contextlib.suppress(OSError, LimitError):  # never forked: its status says killed, as for a death
                self._reply()
                data = self.control.recv(4096)
            if len(data) >= STATUS.size:
                self.status, self._kept = STATUS.unpack(data[:STATUS.size])[0], True
                if len(data) > STATUS.size:
                    self.usage = cgroups.Usage.from_dict(json.loads(data[STATUS.size:]))
            else:  # the keeper died: its job process with it, not what that started
                self.status = signal.SIGKILL
                if self._cgroup:
                    self.usage = cgroups.finish(self._cgroup)
                if self._told is not None:
                    procs.kill_until_gone(lambda: procs.job_processes(self._job_id, self._told[:2]), KILL_WAIT)
        return self.status

    def close(self) -> None:
        """Let go of the process (killed by the forkserver if still running) and of its descriptors (a reply not
        read yet goes with the control socket; a keeper that told its job's end goes back to its link)."""
        if self._link is not None and self._kept and self._asker == os.getpid():
            self._link.rest(self.control)
        else:
            self.control.close()
        self._link = None
        if self._told is not None and self._told[2] >= 0:
            os.close(self._told[2])
            self._told = (*self._told[:2], -1)


class ForkServerLink:
    """A connection to the forkserver of server `name` (runner.Launcher), which asks it for processes: one a process
    of the server's account made to its address, connected at the first launch() (a detached job's supervisor,
    which the forkserver forked and which must fork nothing itself once it holds the server's credentials); or
    the one the server made as it started the forkserver (ForkServer), which every connection process inherits.
    Should the forkserver die, the server starts another at the same address, and launch() reaches it. With
    `reuse` (a detached job's supervisor, which runs an array's elements in turn), the keeper of its last ended job
    keeps its next job process (rest): no keeper is forked per job."""

    def __init__(self, name: str, reuse: bool = False) -> None:
        self.address = f"\0rpycdl-forkserver-{name}"  # abstract: nothing on disk; the forkserver checks the uid
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # connected by the first launch()
        self._reuse = reuse
        self._idle: list[socket.socket] = []  # keepers of this process's ended jobs (rest), for its next ones
        self._owner = os.getpid()  # whose they are: a fork's copy lets them go (_own)

    def launch(self, kind: str, fds: list[int]) -> Launched:
        """A new process of `kind` ("job", "check" or "supervisor") with `fds` as its descriptors (closed here once
        sent); the reply is read when the Launched is first asked for its pid (Launched's LimitError). A job process
        is kept by the keeper of this process's last ended job if it is idle (keeper.AGAIN: no process forked but the
        job process), else by a new keeper the forkserver forks.

        Raises:
            LimitError: the forkserver is gone.
        """
        again = self._again(fds) if kind == "job" else None
        if again is not None:
            return again
        ours, control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        message = [json.dumps({"kind": kind}).encode()]
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [control.fileno(), *fds]))]
        try:
            try:
                try:
                    self._socket.sendmsg(message, rights)
                except OSError:  # not connected yet, or the forkserver it knew died: ask the one at the address
                    self._socket.close()
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    self._socket.connect(self.address)
                    self._socket.sendmsg(message, rights)
            finally:  # the forkserver holds them now (or nobody: the reply is empty)
                control.close()
                for fd in fds:
                    os.close(fd)
        except OSError as exc:
            ours.close()
            raise LimitError(f"this server could not start a process for the job (its forkserver: {exc}); try again "
                             "later or use another server") from None
        return Launched(ours, self if kind == "job" and self._reuse else None)

    def rest(self, control: socket.socket) -> None:
        """Keep the control socket of a keeper that told its job's end, for this process's next job process
        (launch); beyond IDLE_KEEPERS, let it go (the keeper leaves)."""
        self._own()
        if len(self._idle) < IDLE_KEEPERS:
            self._idle.append(control)
        else:
            control.close()

    def _again(self, fds: list[int]) -> Launched | None:
        """A job process with `fds` (closed here once sent) from an idle keeper of this process's, if one takes it."""
        self._own()
        while self._idle:
            control = self._idle.pop()
            try:
                socket.send_fds(control, [AGAIN], fds)
            except OSError:  # it died meanwhile
                control.close()
                continue
            for fd in fds:
                os.close(fd)
            return Launched(control, self)
        return None

    def _own(self) -> None:
        """In a fork of the process that kept them: let go of the copies of its idle keepers' sockets."""
        if self._owner != os.getpid():
            for control in self._idle:
                control.close()
            self._idle, self._owner = [], os.getpid()

    def close(self) -> None:
        """Close this process's connection (the forkserver leaves once every connection has closed, and its
        jobs are gone), and let its idle keepers go."""
        self._socket.close()
        self._own()
        for control in self._idle:
            control.close()
        self._idle = []
