"""The forking server: RPyC's ForkingServer whose parent authenticates every connection in its gate
(rpycdl.server.gate) before the connection gets a process: connection processes forked ahead of the clients
(spares, each with a spare job process) take the connections that got in (handed over with SCM_RIGHTS), or
under TLS one is forked for each from the parent; --max-connections; and the sweeper that cleans up after
connection processes that died."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import rpyc
from rpyc.utils.server import ForkingServer

from rpycdl.defaults import (
    FAIR_SHARE_REFRESH,
    KILL_WAIT,
    PRUNE_INTERVAL,
    SAMPLER_MODULE,
    SPARE_CONNECTIONS,
    STARTUP_GRACE,
    SUPERVISOR_NAME,
    SWEEP_INTERVAL,
)
from rpycdl.errors import LimitError, RpycdlError
from rpycdl.scheduler import fairshare, lockdir, procs, sweep
from rpycdl.scheduler.policies import FAIR
from rpycdl.security import auth, cgroups
from rpycdl.security.auth import Identity
from rpycdl.security.handshake import ServerCredentials, ServerHandshake
from rpycdl.server import (
    child,
    container_watcher,
    draining,
    drops,
    elements,
    fencing,
    gate,
    held,
    keeper,
    retries,
    runner,
)
from rpycdl.server.context import ServerContext
from rpycdl.server.dispatcher import Dispatcher
from rpycdl.server.forkserver import ForkServer
from rpycdl.server.service import GPUService
from rpycdl.states import JobState
from rpycdl.wire import stream

_PID = struct.Struct("i")  # what a spare connection process writes to the parent when it takes a client

PROTOCOL_CONFIG = {
    "allow_public_attrs": False,
    "allow_all_attrs": False,
    "allow_pickle": False,
    "sync_request_timeout": None,  # jobs call back into the client for as long as they run
}

log = logging.getLogger("rpycdl.server")


class DLServer(ForkingServer):
    """The ForkingServer of one rpycdl service, whose parent lets in each connection before it forks for it.

    The parent only forks and lets in: it never imports a framework or touches CUDA. Its gate
    (rpycdl.server.gate) accepts every connection and takes its handshake (the greeting, TLS, the
    secret; on a server without authentication, the client's first byte) in one loop over non-blocking
    sockets, so a connection that has not authenticated costs memory, not a process. A connection that
    got in goes to a connection process: without TLS, to one of the SPARE_CONNECTIONS spares the parent
    keeps forked, each with a spare job process (runner.JobProcess) started by the job forkserver
    already, waiting on a socket over which the parent passes the connection's descriptor (SCM_RIGHTS);
    a spare that takes one writes its pid to the parent, which forks the next. TLS state cannot move to
    another process, so under TLS the parent forks the connection process with it, after the handshake.
    A connection process serves one client and exits, as with RPyC's ForkingServer. The parent counts
    them: at --max-connections it keeps no spare and refuses authenticated connections, saying so.

    It is a child subreaper, so what a connection process that died leaves running (its job
    process dies with it, not what the job started) becomes its child. When a child exits other
    than cleanly with 0 (and every SWEEP_INTERVAL anyway) its sweeper kills what it adopted,
    clears the orphaned grants of its own dead connection processes (and of servers that died)
    once nothing of their jobs runs, ends the ledger rows of jobs whose owner died (of any server:
    rpycdl.scheduler.sweep), and wakes the waiting requests; every PRUNE_INTERVAL it removes the
    jobs past their retention; and it writes the gate's counts to the ledger (drops.Tally). Detached
    jobs' supervisors, which it adopts when the connection process that started them ends, are left
    alone: they live on their own."""

    # Self-pipes written from SIGCHLD: one wakes the sweeper, the other the loop that forks spares.
    _wake_r, _wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _exited_r, _exited_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def __init__(self, context: ServerContext, credentials: ServerCredentials, **kwargs) -> None:
        self.context = context
        self.credentials = credentials
        service = type("GPUService", (GPUService,), {"ALIASES": context.aliases, "context": context})
        super().__init__(service, protocol_config=PROTOCOL_CONFIG, **kwargs)
        context.port = self.port
        self._stop = threading.Event()
        self._connections: set[int] = set()  # pids of the connection processes serving a client
        self._spares: set[int] = set()  # pids of those still waiting for one
        self._queued = 0  # connections handed to the spares that no spare has said it took yet
        self._fork_failed = False
        self._forking = threading.Lock()  # held while those sets change: the sweeper kills other children
        self._taken_r, self._taken_w = os.pipe2(os.O_CLOEXEC)  # a spare writes its pid here as it takes a client
        os.set_blocking(self._taken_r, False)
        self._hand_w, self._hand_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # connections to spares
        self._spare_job: runner.JobProcess | None = None  # in a connection process: its spare job
        limits = context.limits
        self.tally = drops.Tally(context.ledger, context.name)
        startups = gate.Startups(*limits.max_startups, limits.per_source_startups, STARTUP_GRACE)
        self.gate = gate.Gate(self.listener, credentials, startups, self.tally)
        self.gate.watch(self._taken_r, self._note_taken)
        self.gate.watch(self._exited_r, lambda: lockdir.drain(self._exited_r))
        self._dispatcher = Dispatcher(context, self._forking)

    def start(self) -> None:
        child.become_subreaper()
        threading.Thread(target=self._sweep, name="rpycdl-sweeper", daemon=True).start()
        threading.Thread(target=fencing.sweep_cgroups, args=(self._stop,), name="rpycdl-cgroups", daemon=True).start()
        threading.Thread(target=self._dispatcher.run, args=(self._stop,), name="rpycdl-dispatcher",
                         daemon=True).start()
        super().start()

    def close(self) -> None:
        """Stop: accept nothing more, tell the connection processes (they refuse new jobs, and let what runs
        there drain: rpycdl.server.draining), let the forkserver go once its jobs have, kill the spares."""
        self._stop.set()
        _poke(self._wake_w)
        self._dispatcher.close()
        for pid in list(self._connections):  # no lock: this runs in a signal handler, maybe inside _forking
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, draining.DRAIN_SIGNAL)
        if isinstance(self.context.launcher, ForkServer):  # it leaves once its jobs have
            self.context.launcher.close()
        for spare in self._spares:
            doomed = [spare, *procs.children(spare)]  # its spare job, ours (a subreaper's) once the spare is gone
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in doomed:  # reaped here, so that no zombie of them outlives the server
                with contextlib.suppress(ChildProcessError):  # reaped by _handle_sigchld already
                    os.waitpid(pid, 0)
        super().close()

    @classmethod
    def _handle_sigchld(cls, signum: int, frame: object) -> None:
        """Reap ended children, and wake the sweeper if one of them did not exit cleanly: a
        connection process that exits 0 has finished its jobs and released their GPUs itself."""
        unclean = any(status != 0 for _, status in procs.reaped())
        signal.signal(signal.SIGCHLD, cls._handle_sigchld)
        _poke(cls._exited_w)
        if unclean:
            _poke(cls._wake_w)

    def accept(self) -> None:
        """One turn of the parent's loop (RPyC's start() repeats it while the server is active):
        fork the spares the limit leaves room for, let the gate take what came, and give each
        connection that got in its connection process."""
        if self._stop.is_set():  # stopped before RPyC's start() had set the server active
            self.active = False
            return
        self._forget_ended()
        self._keep_forkserver()
        self._fork_spares()
        try:
            done = self.gate.turn(1.0)
        except (OSError, ValueError):  # the listener was closed: the server is stopping
            if self.active:
                raise
            return
        for handshake, source in done:
            self._hand_off(handshake, source)

    def _keep_forkserver(self) -> None:
        """Start the job forkserver again if it died (its jobs run on: their keepers are theirs, adopted by this
        process); connection processes reach the new one at its address, and it answers them once it has
        imported its preload, which nothing here waits for: the sweeper and the accept loop go on. One that dies
        too before it is ready is started again at the next turn."""
        launcher = self.context.launcher
        if not isinstance(launcher, ForkServer):
            return
        try:
            if launcher.alive():
                launcher.ready(block=False)  # a new one's word, read as it comes
                return
            self.logger.error("the job forkserver (pid %d) died; starting another", launcher.process.pid)
            with self._forking:  # the sweeper must not take the new one, not yet exec'd, for a leftover
                launcher.close()
                launcher.spawn()
        except (RpycdlError, OSError) as exc:
            self.logger.error("%s; trying again", exc)

    def _forget_ended(self) -> None:
        """Count only the connection processes and spares that still run."""
        with self._forking:
            self._connections = {pid for pid in self._connections if _running(pid)}
            self._spares = {pid for pid in self._spares if _running(pid)}

    def _authenticated(self) -> int:
        """The connections that got in and have a connection process, or are on their way to one."""
        return len(self._connections) + self._queued

    def _fork_spares(self) -> None:
        """Keep SPARE_CONNECTIONS spares waiting (none under TLS), as far as --max-connections leaves room."""
        wanted = 0 if self.credentials.tls is not None else SPARE_CONNECTIONS
        room = self.context.limits.max_connections - self._authenticated()
        try:
            while self.active and len(self._spares) - self._queued < min(wanted, room):
                with self._forking:
                    self._spares.add(self._fork(self._spare))
            self._fork_failed = False
        except OSError as exc:  # out of processes or memory: refuse, and try again next turn
            self._fork_failed = True
            self.logger.error("could not fork a connection process: %s", exc)

    def _note_taken(self) -> None:
        with self._forking:
            for (pid,) in _PID.iter_unpack(lockdir.drain(self._taken_r)):
                self._spares.discard(pid)
                self._connections.add(pid)
                self._queued = max(0, self._queued - 1)

    def _hand_off(self, handshake: ServerHandshake, source: str) -> None:
        """Give a connection that got in its connection process: a spare, or under TLS a fork of its own."""
        sock, limit = handshake.sock, self.context.limits.max_connections
        try:
            if self._authenticated() >= limit:
                self._forget_ended()  # a connection may have ended while the gate waited (a second at most)
            if self._authenticated() >= limit:
                self._refuse(sock, source, f"this server serves at most {limit} authenticated connections at once "
                                           "(--max-connections)")
            elif isinstance(sock, ssl.SSLSocket):  # TLS state cannot move to another process: fork one with it
                with self._forking:  # forked and counted at once: the sweeper would kill it as a leftover between
                    self._connections.add(self._fork(lambda parent: self._serve(sock, handshake.identity, parent)))
            elif len(self._spares) <= self._queued and self._fork_failed:
                raise OSError("no spare connection process, and none could be forked")
            else:
                socket.send_fds(self._hand_w, [b"c"], [sock.fileno()])
                self._queued += 1
        except OSError as exc:
            self.logger.error("could not start a process for a connection: %s", exc)
            self._refuse(sock, source, "this server could not start a process for the connection")
        finally:
            sock.close()  # this process's copy (a TLS one without a close_notify: the connection goes on)

    def _refuse(self, sock: socket.socket, source: str, reason: str) -> None:
        auth.refuse(sock, f"{reason}; try again later or another server")
        self.tally.refused(source, "connections", reason)

    def _fork(self, role: Callable[[int], int]) -> int:
        """Fork a connection process that runs `role(parent pid)` and exits with what it returns."""
        parent = os.getpid()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # Ctrl-C at the server is the server's
        try:
            pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            raise
        if pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            return pid
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a connection finishes its job past a stop
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        code = 1
        try:
            signal.signal(signal.SIGCHLD, self._prevhandler)
            signal.siginterrupt(signal.SIGCHLD, False)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler would close the listener
            draining.listen(self.context.limits.drain_timeout)  # the parent's stop: no new job here
            self.gate.close_in_child()  # its copies would keep the connections it drops open
            self._hand_w.close()
            code = role(parent)
        except Exception:
            self.logger.exception("connection process failed")
        finally:
            if self._spare_job is not None:  # unused, or used and closed already (closing twice is harmless)
                self._spare_job.close()
            os._exit(code)  # not 0: the parent sweeps for jobs it left behind

    def _spare(self, parent: int) -> int:
        """A spare: wait for a connection with a spare job process forked already, tell the parent when it
        has one, and serve it."""
        child.die_with_parent(parent)  # a spare is of no use without its parent
        child.name_process("rpycdl-spare")
        with contextlib.suppress(LimitError):  # none to spare: the first job forks as its request comes
            self._spare_job = runner.JobProcess(self.context.launcher)
        procs.myself()  # read now, while no client waits
        self.context.ledger.get("0")  # the ledger's connection too
        sock = self._take_client()
        os.write(self._taken_w, _PID.pack(os.getpid()))
        return self._serve(sock, None, parent)

    def _take_client(self) -> socket.socket:
        """Receive a connection the parent let in (shared with the other spares: each goes to one)."""
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(self._hand_r, 16, 1)
            except InterruptedError:
                continue
            if not fds:  # the parent is gone
                os._exit(0)
            sock = socket.socket(fileno=fds[0])
            sock.setblocking(True)
            return sock

    def _serve(self, sock: socket.socket, identity: Identity | None, parent: int) -> int:
        """Serve the client on `sock` (its connection let in by the gate) to its end; the exit code."""
        child.die_with_parent(parent, die=False)  # from now on it serves a client, even past a stop
        child.name_process("rpycdl-conn")
        self._hand_r.close()
        sock.setblocking(True)
        try:
            if self._spare_job is None:  # under TLS, forked with its client: its first job process now
                with contextlib.suppress(LimitError):
                    self._spare_job = runner.JobProcess(self.context.launcher)
            self._serve_client(sock, identity)
        except (OSError, EOFError) as exc:  # the connection broke: one line, never a traceback
            self.logger.info("a connection ended: %s", exc)
            return 1
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        return 0

    def _serve_client(self, sock: socket.socket, credentials: object) -> None:
        """RPyC's own, over rpycdl's stream (rpycdl.wire.stream)."""
        config = dict(self.protocol_config, credentials=credentials,
                      endpoints=(sock.getsockname(), sock.getpeername()), logger=self.logger)
        limits = self.context.limits
        channel = stream.channel(sock, limits.max_frame, limits.idle_timeout)
        service = self.service(self._spare_job)
        self._handle_connection(service._connect(channel, config), service)

    def _handle_connection(self, conn: rpyc.Connection, service: GPUService) -> None:
        """Serve until the client leaves, or stays idle (no request, no job) for the idle timeout;
        after each answer, let the service finish what the call left for after its reply."""
        idle_since = time.monotonic()
        try:
            while not conn.closed:
                if conn.serve(service.tick()):  # an open session is looked at between its calls
                    service.after_reply()
                    idle_since = time.monotonic()
                elif draining.overdue():  # the server stopped: what ran here has ended (cancelled, if it had to)
                    self.logger.info("closing a connection of a stopped server (--drain-timeout)")
                    stream.close_now(conn)
                elif time.monotonic() - idle_since > self.context.limits.idle_timeout:
                    self.logger.info("closing a connection idle for %.0f s (--idle-timeout)",
                                     time.monotonic() - idle_since)
                    stream.close_now(conn)  # RPyC's close() would wait for an idle client to answer
        except EOFError:  # the client left: the usual end of a connection
            conn.close()
        finally:
            service.after_reply()

    def _sweep(self) -> None:
        next_prune = next_share = 0.0
        while not self._stop.is_set():  # the first sweep at start cleans up after a server that died
            try:
                self._sweep_once()
                self.tally.flush()
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + min(PRUNE_INTERVAL, self.context.limits.keep / 10)
                    sweep.prune(self.context.ledger, self.context.files, self.context.limits.keep)
                    for job_id in sweep.end_unqueued(self.context.ledger, self.context.files,
                                                     self.context.locks.queued_rows):
                        log.warning("job %s ended: its place in line was lost before it ran", job_id)
                if self.context.scheduling.policy == FAIR and time.monotonic() >= next_share:
                    next_share = time.monotonic() + FAIR_SHARE_REFRESH
                    fairshare.refresh(self.context.lock_dir, self.context.ledger, self.context.scheduling.fair_share)
            except Exception:  # a sweep must never take the server down
                log.exception("sweep failed")
            select.select([self._wake_r], [], [], SWEEP_INTERVAL)
            lockdir.drain(self._wake_r)

    def _sweep_once(self) -> None:
        """Kill what is left in the cgroups of jobs whose keeper died, and what this server adopted; then, unless
        some of it will not die, clear the orphaned grants of its dead connection processes; clear those of dead
        servers; end dead jobs' records; remove the files of jobs whose maker died before recording them; queue or
        end the rows that wait with no place in line (rpycdl.server.held, retries, elements)."""
        ctx = self.context
        if cgroups.sweep():  # what a job whose keeper and requester died left, however it daemonized
            log.warning("removed the cgroups of jobs whose keeper died")
        adopted = self._adopted()
        if adopted:
            log.warning("killing processes left by dead connection processes: %s", adopted)
        clean = not adopted or procs.kill_until_gone(self._adopted, KILL_WAIT)  # each reaped by _handle_sigchld
        if not clean:
            log.warning("processes left by dead connection processes still run after SIGKILL: %s", self._adopted())

        def claim(record: dict[str, Any]) -> bool:
            server = record.get("server_process")
            return (clean and record.get("server_id") == ctx.server_id) or not (server and procs.alive(*server))

        for record in ctx.locks.clear_orphans(claim):
            log.warning("GPUs of job %s granted again: its connection process died", record.get("job_id"))
        for record in sweep.end_orphaned(ctx.ledger, ctx.files, ctx.locks.queued_rows):
            log.warning("job %s %s: %s", record.job_id, "requeued (retries=)" if record.state is JobState.PENDING
                        else "ended", record.error)
            elements.ended(ctx, record)  # an element's: its array's next ones take their places, its last's files go
            ctx.locks.wake_all()
        for job_id in sweep.remove_unrecorded(ctx.ledger, ctx.files, ctx.locks.drop_row):
            log.warning("files of job %s removed: the process making them died before the job was recorded", job_id)
        for release in (held.release, retries.release, elements.release_all):  # queue (or end) rows that wait
            release(ctx)  # for their dependencies, for their last attempt to hold no GPU, for their array's room

    def _adopted(self) -> list[int]:
        """The running processes this server adopted (it is a child subreaper): its children that
        are neither spares nor connection processes (what dead connection processes left), and
        their descendants; but not its job forkserver, nor a job's keeper or a detached job's supervisor (with
        its job: adopted when the forkserver that forked it died), nor a job container's watcher, which
        removes its container, nor its load sampler."""
        launcher = self.context.launcher
        with self._forking:
            mine = self._spares | self._connections | (
                {launcher.process.pid} if isinstance(launcher, ForkServer) else set())
            found = [pid for pid in procs.children(os.getpid()) if pid not in mine]
        found = [pid for pid in found if not procs.named(pid, keeper.NAME) and not procs.named(pid, SUPERVISOR_NAME)
                 and not any(procs.runs_module(pid, module) for module in (container_watcher.__name__, SAMPLER_MODULE))]
        return [each for pid in found for each in (pid, *procs.subtree(pid)) if procs.alive(each)]


def _running(pid: int) -> bool:
    """Whether a child process still runs (an ended one is left for _handle_sigchld to reap)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _poke(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"!")


