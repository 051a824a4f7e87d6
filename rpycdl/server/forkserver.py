"""The job forkserver: the process that forks every job process and load check of a server's connections.

The server starts it clean at its own start (`python -m rpycdl.server.forkserver FD`, exec'd, with the
server's environment less every credential variable), so that nothing of the server's memory (its TLS
key, its shared secret, the store's credentials, other users' rows) and no secret of its environment is
in a job, whose owner may read all of its memory once it runs as them (rpycdl.security.accounts). It
never touches CUDA. It is a child subreaper: what a job leaves when its parent dies comes to it, stays
while it belongs to a live job (its session, or RPYCDL_JOB_ID naming the job), and is killed otherwise.

One request a datagram on a SOCK_SEQPACKET connection: the one the server made (every connection process
inherits it; no job ever holds it), or one a process of the server's account made to the forkserver's
abstract address (ForkServer.launch, after the forkserver it knew died):

    request   JSON {"kind": "job" | "check"}; SCM_RIGHTS: a control socket, then the child's descriptors
              (job: go, stdout, stderr, result, files; check: go, result, files)
    reply     on the control socket: PID (pid, start time), SCM_RIGHTS: the child's pidfd
    requester on the control socket: JOB_ID + the job's id, once it knows it
    end       on the control socket: STATUS (wait status), once the child and everything of its job are
              gone; then the control socket closes

A requester that closes its control socket (it died) has its child killed. The forkserver leaves once
every connection has closed and its children are gone."""

from __future__ import annotations

import array
import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass

from rpycdl.defaults import FORKSERVER_MODULE, SECRET_VARIABLE_PREFIXES, STORE_SECRET_VARIABLES, SWEEP_INTERVAL
from rpycdl.errors import LimitError, RpycdlError
from rpycdl.scheduler import procs

PID = struct.Struct("<iQ")  # reply: pid, start time
STATUS = struct.Struct("<i")  # end: wait status
JOB_ID = b"J"  # requester: the job's id follows
READY = b"ready"  # the forkserver to the server, once its preload is imported
MAX_FDS = 8
PR_SET_CHILD_SUBREAPER = 36

log = logging.getLogger("rpycdl.forkserver")


# -- the server's side ----------------------------------------------------------------------------


class Launched:
    """A process the forkserver forks for this one: its pid and start time, a pidfd (readable once it
    has exited), and the control socket its end comes on. The forkserver's reply (pid, start time, pidfd)
    is read when one of them is first needed, so that the requester goes on while the forkserver forks
    (a connection's next spare is asked for as its job takes one, and taken by the next job); reading it raises
    LimitError if the forkserver could not fork, or is gone."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.status: int | None = None
        self._told: tuple[int, int, int] | None = None
        self._failed = ""

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
                data, fds_back, _, _ = socket.recv_fds(self.control, PID.size, 1)
            except OSError as exc:
                data, fds_back, self._failed = b"", [], f"its forkserver: {exc}"
            if len(data) == PID.size and fds_back:
                self._told = (*PID.unpack(data), fds_back[0])
            else:
                for fd in fds_back:
                    os.close(fd)
                self._failed = self._failed or "its forkserver could not fork"
        if self._told is None:
            raise LimitError(f"this server could not start a process for the job ({self._failed}); try again later "
                             "or use another server")
        return self._told

    def name_job(self, job_id: str) -> None:
        """Tell the forkserver the job's id: what the job starts keeps it in its environment."""
        with contextlib.suppress(OSError):
            self.control.send(JOB_ID + job_id.encode())

    def wait(self) -> int:
        """Block until the process and everything of its job are gone; its wait status."""
        if self.status is None:
            data = b""
            with contextlib.suppress(OSError, LimitError):  # never forked: its status says killed, as for a death
                self._reply()
                data = self.control.recv(STATUS.size)
            # No end told: the forkserver died, and its children with it (they die with their parent).
            self.status = STATUS.unpack(data)[0] if len(data) == STATUS.size else signal.SIGKILL
        return self.status

    def close(self) -> None:
        """Let go of the process (killed by the forkserver if still running) and of its descriptors (a reply not
        read yet goes with the control socket)."""
        self.control.close()
        if self._told is not None and self._told[2] >= 0:
            os.close(self._told[2])
            self._told = (*self._told[:2], -1)


class ForkServer:
    """The server's handle on its forkserver: started with the server, inherited by its connection
    processes, which ask it for processes. Should it die, the server starts another at the same address
    (start()), and each process reaches the new one when it next asks."""

    def __init__(self, name: str, preload: tuple[str, ...] = ()) -> None:
        """`name` makes its address unique (the server's id); `preload`: modules it imports before it forks
        anything (rpycdl serve --preload), so that every job starts with them imported."""
        self.address = f"\0rpycdl-forkserver-{name}"  # abstract: nothing on disk; the forkserver checks the uid
        self.preload = preload
        self.start()

    def start(self) -> None:
        """Start the forkserver (again), listening at its address, with this process connected to it, once it
        has imported its preload.

        Raises:
            RpycdlError: a module of the preload could not be imported (the message names it and says why).
        """
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen()
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [theirs.fileno(), listener.fileno()]
        self.process = subprocess.Popen([sys.executable, "-m", FORKSERVER_MODULE, *map(str, fds), *self.preload],
                                        pass_fds=fds, env=clean_environment(os.environ), stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        theirs.close()
        listener.close()  # the forkserver's alone: the address is free again once it is gone
        self._identity = procs.identify(self.process.pid)
        told = self._socket.recv(4096)  # READY once the preload is imported, else why not
        if told != READY:
            self.process.wait()
            self._socket.close()
            raise RpycdlError(f"the job forkserver could not start: {told.decode(errors='replace') or 'it died'}")

    def alive(self) -> bool:
        """Whether the forkserver still runs."""
        return procs.alive(*self._identity)

    def launch(self, kind: str, fds: list[int]) -> Launched:
        """A new process of `kind` ("job" or "check") with `fds` as its descriptors (closed here once sent);
        the forkserver's reply is read when the Launched is first asked for its pid (Launched's LimitError).

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
                except OSError:  # the forkserver this process knew died: ask the one started in its place
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


def clean_environment(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The environment less every variable that may hold a credential: the store's, and any named by a
    prefix of SECRET_VARIABLE_PREFIXES."""
    return {name: value for name, value in environ.items()
            if name not in STORE_SECRET_VARIABLES and not name.startswith(SECRET_VARIABLE_PREFIXES)}


# -- the forkserver's side ------------------------------------------------------------------------


@dataclass
class _Child:
    control: socket.socket
    start: int
    job_id: str = ""
    watched: bool = True  # the requester still holds its control socket
    status: int | None = None  # once reaped


class _Server:
    """The forkserver's loop: requests, its children's ends, what jobs leave."""

    def __init__(self, first: socket.socket, listener: socket.socket) -> None:
        self.connections = {first}  # the server's, and those of processes that reconnected (ForkServer.launch)
        self.listener = listener
        self.children: dict[int, _Child] = {}
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)

    def run(self) -> None:
        while self.connections or self.children:
            watched = [child.control for child in self.children.values() if child.watched]
            ready = select.select([self.wake_r, self.listener, *self.connections, *watched], [], [],
                                  SWEEP_INTERVAL)[0]
            for each in ready:
                if each is self.listener:
                    self._accept()
                elif each in self.connections:
                    self._request(each)
                elif isinstance(each, socket.socket):
                    self._control(each)
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
            self._reap()
            self._sweep()

    def _accept(self) -> None:
        """A process that lost the forkserver it knew connects to this one: one of the server's account only."""
        with contextlib.suppress(OSError):
            sock, _ = self.listener.accept()
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            if uid == os.getuid():
                self.connections.add(sock)
            else:
                log.warning("refused a connection from uid %d", uid)
                sock.close()

    def _request(self, connection: socket.socket) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(connection, 4096, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:  # every holder of this connection has closed it
            self.connections.discard(connection)
            connection.close()
            return
        try:
            kind = json.loads(data)["kind"]
            if kind not in ("job", "check") or len(fds) != (6 if kind == "job" else 4):
                raise ValueError(f"bad request {data[:100]!r}")
            self._fork(kind, fds)
        except Exception:  # a bad request never takes the forkserver down
            log.exception("forkserver request failed")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _fork(self, kind: str, fds: list[int]) -> None:
        control = socket.socket(fileno=os.dup(fds[0]))
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            control.close()  # the requester reads an empty reply: LimitError
            return
        if pid == 0:
            self._become_child(kind, fds[1:], me)
        pidfd = os.pidfd_open(pid)
        try:
            socket.send_fds(control, [PID.pack(pid, procs.identify(pid)[1])], [pidfd])
        except OSError:  # the requester is gone already
            pass
        finally:
            os.close(pidfd)
        self.children[pid] = _Child(control, procs.identify(pid)[1])

    def _become_child(self, kind: str, fds: list[int], parent: int) -> None:
        """In the forked child: let go of everything of the forkserver's, then become the job (never returns)."""
        from rpycdl.server import child  # imported by main() already: no cost

        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if kind == "job":  # it keeps nothing of the forkserver's but `fds` (child.keep_only)
                child.run_job(go_r=fds[0], out_w=fds[1], err_w=fds[2], res_w=fds[3], files=fds[4], parent=parent)
            child.run_check(go_r=fds[0], res_w=fds[1], files=fds[2], parent=parent)
        finally:
            os._exit(2)

    def _control(self, control: socket.socket) -> None:
        pid = next(pid for pid, each in self.children.items() if each.control is control)
        each = self.children[pid]
        try:
            data = control.recv(256)
        except OSError:
            data = b""
        if data.startswith(JOB_ID):
            each.job_id = data[len(JOB_ID):].decode(errors="replace")
        elif not data:  # the requester is gone: so is its job
            each.watched = False
            procs.kill_group(pid)
            procs.kill([pid])

    def _reap(self) -> None:
        """Reap every ended child; a job's end is told once nothing of it runs (_sweep)."""
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                if pid in self.children:
                    self.children[pid].status = status

    def _sweep(self) -> None:
        """Kill what ended jobs left and what belongs to no live job; tell the ends of jobs now gone.

        Everything a job started is in this process's subtree (it is a child subreaper): once a job process
        has died, what it left is among this process's adopted children and their descendants, so no scan of
        the whole of /proc is needed."""
        adopted = [pid for pid in procs.children(os.getpid()) if pid not in self.children]
        live = {pid: each for pid, each in self.children.items() if each.status is None}
        for pid in adopted:
            if not any(_belongs(pid, job, each) for job, each in live.items()):
                procs.kill([pid, *procs.subtree(pid)])
        for pid, each in list(self.children.items()):
            if each.status is None:
                continue
            left = [found for stray in adopted if _belongs(stray, pid, each)
                    for found in (stray, *procs.subtree(stray)) if procs.alive(found)]
            if left:
                procs.kill(left)
                continue
            with contextlib.suppress(OSError):
                each.control.send(STATUS.pack(each.status))
            each.control.close()
            del self.children[pid]


def _belongs(pid: int, job: int, child: _Child) -> bool:
    """Whether the process `pid` belongs to the live job process `job`: in its session, or named by its
    environment."""
    found = procs.stat(pid)
    return found is not None and (found.session == job or bool(child.job_id and procs.environment_names(pid,
                                                                                                        child.job_id)))


def main(argv: list[str] | None = None) -> int:
    """`python -m rpycdl.server.forkserver FD LISTENER [MODULE ...]`: serve the requests on the socket FD and
    on the connections LISTENER accepts, with MODULEs imported first (rpycdl serve --preload)."""
    from rpycdl.server import child

    first, listener, *preload = argv if argv is not None else sys.argv[1:]
    child.name_process("rpycdl-forksrv")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's, which stops it
    child.prctl(PR_SET_CHILD_SUBREAPER, 1)
    server = socket.socket(fileno=int(first))
    for module in preload:
        try:
            importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the server says it and does not start
            server.send(f"--preload {module}: {type(exc).__name__}: {exc}".encode()[:4096])
            return 1
    server.send(READY)
    _Server(server, socket.socket(fileno=int(listener))).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
