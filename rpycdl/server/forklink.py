"""The requesters' side of the job forkserver (rpycdl.server.forkserver): a connection to it that asks for
processes (ForkServerLink, a runner.Launcher), and each process it forks for them (Launched), read as its keeper
tells it. Its own module, so that a detached job's supervisor, which the forkserver forks, reaches it without an
import in a circle."""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket

from rpycdl.defaults import KILL_WAIT
from rpycdl.errors import LimitError
from rpycdl.scheduler import procs
from rpycdl.security import cgroups
from rpycdl.server.keeper import PID, STATUS


class Launched:
    """A process the forkserver forks for this one (through its keeper): its pid and start time, a pidfd
    (readable once it has exited), and the control socket its end comes on. The keeper's reply (pid, start
    time, pidfd) is read when one of them is first needed, so that the requester goes on while the forkserver forks
    (a connection's next spare is asked for as its job takes one, and taken by the next job); reading it raises
    LimitError if the forkserver could not fork, or is gone."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
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

    def wait(self) -> int:
        """Block until the process and everything of its job are gone; its wait status. Should its keeper die
        first (its job process dies with it), what the job left is killed here before this returns."""
        if self.status is None:
            data = b""
            with contextlib.suppress(OSError, LimitError):  # never forked: its status says killed, as for a death
                self._reply()
                data = self.control.recv(4096)
            if len(data) >= STATUS.size:
                self.status = STATUS.unpack(data[:STATUS.size])[0]
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
        read yet goes with the control socket)."""
        self.control.close()
        if self._told is not None and self._told[2] >= 0:
            os.close(self._told[2])
            self._told = (*self._told[:2], -1)


class ForkServerLink:
    """A connection to the forkserver of server `name` (runner.Launcher), which asks it for processes: one a process
    of the server's account made to its address, connected at the first launch() (a detached job's supervisor,
    which the forkserver forked and which must fork nothing itself once it holds the server's credentials); or
    the one the server made as it started the forkserver (ForkServer), which every connection process inherits.
    Should the forkserver die, the server starts another at the same address, and launch() reaches it."""

    def __init__(self, name: str) -> None:
        self.address = f"\0rpycdl-forkserver-{name}"  # abstract: nothing on disk; the forkserver checks the uid
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # connected by the first launch()

    def launch(self, kind: str, fds: list[int]) -> Launched:
        """A new process of `kind` ("job", "check" or "supervisor") with `fds` as its descriptors (closed here once
        sent); the forkserver's reply is read when the Launched is first asked for its pid (Launched's LimitError).

        Raises:
            LimitError: the forkserver is gone.
        """
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
        return Launched(ours)

    def close(self) -> None:
        """Close this process's connection (the forkserver leaves once every connection has closed, and its
        jobs are gone)."""
        self._socket.close()
