"""The job forkserver: the process that forks a keeper for every job process and load check of a server's connections,
and the supervisor of every detached job its server's dispatcher starts.

The server starts it clean at its own start (`python -m rpycdl.server.forkserver FD`, exec'd, with the
server's environment less every credential variable), so that nothing of the server's memory (its TLS
key, its shared secret, the store's credentials, other users' rows) and no secret of its environment is
in a job, whose owner may read all of its memory once it runs as them (rpycdl.security.accounts). It
never touches CUDA. For each request it forks a keeper (rpycdl.server.keeper), which forks the job
process, answers the requester and carries the job to its end on its own: the forkserver keeps no job's
life, so its death ends none. It forks a detached job's supervisor the same way (rpycdl.server.supervisor.forked,
warm: that module is imported here once), which answers the requester itself and lives on its own. It is a child
subreaper: what it adopts (what a killed keeper's job left) is killed.

One request a datagram on a SOCK_SEQPACKET connection: the one the server made (every connection process
inherits it; no job ever holds it), or one a process of the server's account made to the forkserver's
abstract address (ForkServer.launch, after the forkserver it knew died):

    request   JSON {"kind": "job" | "check" | "supervisor"}; SCM_RIGHTS: a control socket, then the child's
              descriptors (job: go, stdout, stderr, result, files; check: go, result, files; supervisor: its row's
              claim, go, secrets)
    reply     from the keeper, on the control socket: PID (pid, start time), then the name of the job's cgroup
              if it has one (rpycdl.security.cgroups); SCM_RIGHTS: the child's pidfd (a supervisor: its own, and
              nothing more comes on the socket)
    end       from the keeper, on the control socket: STATUS (wait status), then the JSON of its cgroup's usage
              (rpycdl.security.cgroups.Usage) if the job had one, once the child and everything of its job are
              gone; then the control socket closes, or (a job's keeper) stays open for the next request
    again     to a job's keeper that told its end, on its control socket: AGAIN; SCM_RIGHTS: a job's
              descriptors; the keeper forks that job process, and the reply and end come as above

A requester that closes its control socket (it died, or let go) has its child killed by the keeper. The
forkserver leaves once every connection has closed and its keepers are gone."""

from __future__ import annotations

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

from rpycdl.defaults import (
    FORKSERVER_MODULE,
    SWEEP_INTERVAL,
)
from rpycdl.errors import RpycdlError
from rpycdl.scheduler import procs
from rpycdl.security import cgroups
from rpycdl.server import child, container_watcher, keeper, supervisor
from rpycdl.server.forklink import ForkServerLink

READY = b"ready"  # the forkserver to the server, once its preload is imported
MAX_FDS = 8
DESCRIPTORS = {"job": 6, "check": 4, "supervisor": 4}
"""The descriptors each kind of request comes with, its control socket first."""

log = logging.getLogger("rpycdl.forkserver")


# -- the server's side ----------------------------------------------------------------------------


class ForkServer(ForkServerLink):
    """The server's handle on its forkserver: started with the server, inherited by its connection
    processes, which ask it for processes. Should it die, the server starts another at the same address
    (spawn()), and each process reaches the new one when it next asks."""

    def __init__(self, name: str, preload: tuple[str, ...] = (), fence: bool = True) -> None:
        """`name` makes its address unique (the server's id); `preload`: modules it imports before it forks
        anything (rpycdl serve --preload), so that every job starts with them imported. Returns once the
        forkserver is ready.

        Raises:
            RpycdlError: a module of the preload could not be imported (the message names it and says why).
        """
        super().__init__(name)
        self.preload = preload
        self.fence = fence  # False: its keepers make no cgroup (--no-fence)
        self.spawn()
        self.ready()

    def spawn(self) -> None:
        """Start the forkserver (again), listening at its address, with this process connected to it. Processes
        may ask it at once: it answers once it has imported the preload (ready())."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.address)
        listener.listen()
        self._socket.close()
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [theirs.fileno(), listener.fileno()]
        self.process = subprocess.Popen([sys.executable, "-m", FORKSERVER_MODULE, *map(str, fds),
                                         *(() if self.fence else (cgroups.NO_FENCE,)), *self.preload],
                                        pass_fds=fds, env=child.clean_environment(os.environ), stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        theirs.close()
        listener.close()  # the forkserver's alone: the address is free again once it is gone
        self._identity = procs.identify(self.process.pid)
        self._ready = False

    def ready(self, block: bool = True) -> bool:
        """Whether the forkserver has imported its preload; with `block`, once it has.

        Raises:
            RpycdlError: a module of the preload could not be imported (the message names it and says why), or
                the forkserver died first; it has exited.
        """
        if not self._ready:
            try:
                told = self._socket.recv(4096, 0 if block else socket.MSG_DONTWAIT)  # READY, else why not
            except BlockingIOError:
                return False
            if told != READY:
                self.process.wait()
                raise RpycdlError(f"the job forkserver could not start: {told.decode(errors='replace') or 'it died'}")
            self._ready = True
        return True

    def alive(self) -> bool:
        """Whether the forkserver still runs."""
        return procs.alive(*self._identity)


# -- the forkserver's side ------------------------------------------------------------------------


class _Server:
    """The forkserver's loop: requests (a keeper forked for each), its keepers' ends, what it adopted."""

    def __init__(self, first: socket.socket, listener: socket.socket) -> None:
        self.connections = {first}  # the server's, and those of processes that reconnected (ForkServer.launch)
        self.listener = listener
        self.keepers: set[int] = set()
        self.supervisors: set[int] = set()  # detached jobs' (rpycdl.server.supervisor): their lives are their own
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(wake_w)

    def run(self) -> None:
        while self.connections or self.keepers:
            ready = select.select([self.wake_r, self.listener, *self.connections], [], [], SWEEP_INTERVAL)[0]
            for each in ready:
                if each is self.listener:
                    self._accept()
                elif each in self.connections:
                    self._request(each)
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
            if len(fds) != DESCRIPTORS.get(kind):
                raise ValueError(f"bad request {data[:100]!r}")
            self._fork(kind, fds)
        except Exception:  # a bad request never takes the forkserver down
            log.exception("forkserver request failed")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _fork(self, kind: str, fds: list[int]) -> None:
        """Fork the keeper of the request's process, or a detached job's supervisor; the requester's reply comes
        from it (an empty one, the control socket closed, if no process could be forked)."""
        try:
            pid = os.fork()
        except OSError:
            return
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if kind == "supervisor":
                supervisor.forked(fds[0], fds[1:])
            keeper.keep(kind, fds[0], fds[1:])
        (self.supervisors if kind == "supervisor" else self.keepers).add(pid)

    def _reap(self) -> None:
        ended = {pid for pid, _ in procs.reaped()}
        self.keepers -= ended
        self.supervisors -= ended

    def _sweep(self) -> None:
        """Kill what this process adopted: what a job whose keeper or supervisor died left (the keeper's own subtree
        while it lives), but a job container's watcher, which removes its container once its supervisor died.
        Everything the jobs of the dead keepers started is in this process's subtree (it is a child subreaper), so
        no scan of the whole of /proc is needed."""
        for pid in procs.children(os.getpid()):
            if pid in self.keepers or pid in self.supervisors or procs.runs_module(pid, container_watcher.__name__):
                continue
            procs.kill([pid, *procs.subtree(pid)])


def main(argv: list[str] | None = None) -> int:
    """`python -m rpycdl.server.forkserver FD LISTENER [--no-fence] [MODULE ...]`: serve the requests on the socket
    FD and on the connections LISTENER accepts, with MODULEs imported first (rpycdl serve --preload), its jobs
    fenced unless --no-fence (rpycdl serve --no-fence)."""
    first, listener, *preload = argv if argv is not None else sys.argv[1:]
    if preload[:1] == [cgroups.NO_FENCE]:
        preload = preload[1:]
        cgroups.turn_off(cgroups.NO_FENCE)
    child.name_process("rpycdl-forksrv")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's, which stops it
    child.become_subreaper()
    server = socket.socket(fileno=int(first))
    cgroups.hierarchy()  # found once: every keeper makes its job's cgroup there
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
