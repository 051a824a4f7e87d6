"""Builds and starts the ForkingServer: service names, registration, the lock directory, spare
connection processes, authentication, the sweeper."""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import importlib.metadata
import ipaddress
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rpyc
from rpyc.utils.server import ForkingServer

from rpycdl import auth, lockdir, procs, runner, tls, transport
from rpycdl.context import Limits, ServerContext
from rpycdl.defaults import KILL_WAIT, REREGISTER_INTERVAL, SPARE_CONNECTIONS, SWEEP_INTERVAL, lock_dir
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.gpus import load_inventory
from rpycdl.registry import registry_client
from rpycdl.service import GPUService
from rpycdl.shares import ShareRules

PR_SET_CHILD_SUBREAPER = 36

FRAMEWORK_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "pytorch": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly"),
    "jax": ("jax",),
    "caffe": (),
    "deeplearning": (),
}
"""Package whose version names the service version, per known service (read from metadata,
so the server parent never imports, let alone initialises, the framework)."""

CONTAINER_SERVICE = "deeplearning"
"""The generic service, whose jobs may run in containers of their own."""

CONTAINER_WATCHER = "rpycdl.containers"
"""The module a job container's watcher runs (`python -m`): it removes its container once the
connection process that ran the job has died."""

FRAME_SLACK = 1 << 20
"""Bytes an RPyC frame may carry beyond the payload limit (the call around the payload)."""

_PID = struct.Struct("i")  # what a spare connection process writes to the parent when it takes a client

PROTOCOL_CONFIG = {
    "allow_public_attrs": False,
    "allow_all_attrs": False,
    "allow_pickle": False,
    "sync_request_timeout": None,  # jobs call back into the client for as long as they run
}

log = logging.getLogger("rpycdl.server")


@dataclass
class ServerConfig:
    """Everything `rpycdl serve` takes."""

    service: str
    host: str = "127.0.0.1"
    port: int = 0
    registry: str | None = None  # HOST[:PORT]; None: $RPYCDL_REGISTRY or broadcast; "none": do not register
    gpus: str | None = None  # fake:N, fake:NxSIZE, nvml, or None for $RPYCDL_GPUS / NVML
    lock_dir: str | None = None
    insecure: bool = False
    secret_file: str | None = None  # None: $RPYCDL_SECRET_FILE, else no authentication
    tls_cert: str | None = None  # all three, or none: mutual TLS (rpycdl.tls)
    tls_key: str | None = None
    tls_ca: str | None = None
    limits: Limits = field(default_factory=Limits)
    shares: ShareRules = field(default_factory=ShareRules)
    version: str | None = None  # framework version to announce; None reads package metadata


def framework_version(service: str) -> str | None:
    """The installed version of the service's framework, from package metadata, or None."""
    for dist in FRAMEWORK_DISTRIBUTIONS.get(service.lower(), (service.lower(),)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def service_aliases(service: str, version: str | None) -> tuple[str, ...]:
    """`PYTORCH`, plus `PYTORCH-2.5` and `PYTORCH-2.5.1` when the version is known."""
    name = service.upper()
    if not name.replace("-", "").replace("_", "").isalnum():
        raise InvalidRequestError(f"bad service name {service!r}: letters, digits, '-' and '_' only")
    aliases = [name]
    if version:
        public = version.split("+")[0]
        parts = public.split(".")
        if len(parts) > 2:
            aliases.append(f"{name}-{'.'.join(parts[:2])}")
        aliases.append(f"{name}-{public}")
    return tuple(aliases)


def is_loopback(host: str) -> bool:
    """Whether a server listening on `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DLServer(ForkingServer):
    """The ForkingServer of one rpycdl service, with its forks made ahead of the clients.

    The parent only forks: it never imports a framework or touches CUDA. It keeps
    SPARE_CONNECTIONS connection processes forked and waiting in accept() on the listening
    socket they share, each with a spare job process (runner.JobProcess) forked already; a spare
    that takes a client writes its pid to the parent, which forks the next one. A connection
    process serves one client and exits, as with RPyC's ForkingServer. The parent counts them:
    at --max-connections it keeps no spare and accepts connections itself, to refuse them.

    It is a child subreaper, so what a connection process that died leaves running (its job
    process dies with it, not what the job started) becomes its child. When a child exits other
    than cleanly with 0 (and every SWEEP_INTERVAL anyway) its sweeper kills what it adopted,
    clears the orphaned grants of its own dead connection processes (and of servers that died)
    once nothing of their jobs runs, ends the records of jobs whose connection process died (of
    any server: rpycdl.jobs), and wakes the waiting requests."""

    # Self-pipes written from SIGCHLD: one wakes the sweeper, the other the loop that forks spares.
    _wake_r, _wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _exited_r, _exited_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def __init__(self, context: ServerContext, **kwargs) -> None:
        self.context = context
        service = type("GPUService", (GPUService,), {"ALIASES": context.aliases, "context": context})
        super().__init__(service, protocol_config=PROTOCOL_CONFIG, **kwargs)
        context.port = self.port
        self._stop = threading.Event()
        self._connections: set[int] = set()  # pids of the connection processes serving a client
        self._spares: set[int] = set()  # pids of those still waiting for one
        self._forking = threading.Lock()  # held while those sets change: the sweeper kills other children
        self._taken_r, self._taken_w = os.pipe2(os.O_CLOEXEC)  # a spare writes its pid here as it takes a client
        os.set_blocking(self._taken_r, False)
        self._spare_job: runner.JobProcess | None = None  # in a connection process: its spare job

    def start(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        threading.Thread(target=self._sweep, name="rpycdl-sweeper", daemon=True).start()
        super().start()

    def close(self) -> None:
        self._stop.set()
        _poke(self._wake_w)
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
        unclean = False
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                unclean |= status != 0
        signal.signal(signal.SIGCHLD, cls._handle_sigchld)
        _poke(cls._exited_w)
        if unclean:
            _poke(cls._wake_w)

    def accept(self) -> None:
        """One turn of the parent's loop (RPyC's start() repeats it while the server is active):
        fork the spares the limit leaves room for, note the ones that took a client, and refuse
        connections while there is no spare to take them."""
        if self._stop.is_set():  # stopped before RPyC's start() had set the server active
            self.active = False
            return
        with self._forking:
            self._connections = {pid for pid in self._connections if _running(pid)}
            self._spares = {pid for pid in self._spares if _running(pid)}
        limit = self.context.limits.max_connections
        room = limit - len(self._connections)
        try:
            while self.active and len(self._spares) < min(SPARE_CONNECTIONS, room):
                with self._forking:
                    self._spares.add(self._fork_spare())
        except OSError as exc:  # out of processes or memory: refuse, and try again next turn
            self.logger.error("could not fork a connection process: %s", exc)
        watched = [self._taken_r, self._exited_r] + ([] if self._spares else [self.listener])
        try:
            readable = select.select(watched, [], [], 1.0)[0]
        except (OSError, ValueError):  # the listener was closed: the server is stopping
            if self.active:
                raise
            return
        if self._exited_r in readable:
            lockdir.drain(self._exited_r)
        if self._taken_r in readable:
            with self._forking:
                for (pid,) in _PID.iter_unpack(lockdir.drain(self._taken_r)):
                    self._spares.discard(pid)
                    self._connections.add(pid)
        if self.listener in readable and self.active:
            try:
                sock, _ = self.listener.accept()
            except OSError:  # gone again, or taken by a spare forked meanwhile
                return
            reason = (f"this server serves at most {limit} connections at once (--max-connections)" if room <= 0
                      else "this server could not start a process for the connection")
            self.logger.warning("refused a connection: %s", reason)
            auth.refuse(sock, f"{reason}; try again later or another server")

    def _fork_spare(self) -> int:
        """Fork a connection process that waits for a client with a spare job process forked
        already, tells the parent when it has one, serves it, and exits."""
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
            runner.die_with_parent(parent)  # a spare must not outlive the server: it holds the port
            runner.name_process("rpycdl-spare")
            with contextlib.suppress(LimitError):  # none to spare: the first job forks as its request comes
                self._spare_job = runner.JobProcess(close_fds=[self.listener.fileno()])
            sock = self._take_client()
            os.write(self._taken_w, _PID.pack(os.getpid()))
            runner.die_with_parent(parent, die=False)  # from now on it serves a client, even past a stop
            runner.name_process("rpycdl-conn")
            self.listener.close()
            if self.authenticator is not None:
                auth.greet(sock, self.authenticator.mode)
            self._authenticate_and_serve_client(sock)
            code = 0
        except Exception:
            self.logger.exception("connection process failed")
        finally:
            if self._spare_job is not None:  # unused, or used and closed already (closing twice is harmless)
                self._spare_job.close()
            os._exit(code)  # not 0: the parent sweeps for jobs it left behind

    def _take_client(self) -> socket.socket:
        """Accept a client on the listening socket (shared with the other spares)."""
        while True:
            try:
                sock, _ = self.listener.accept()
            except (TimeoutError, BlockingIOError, InterruptedError):  # another spare took it, or none came
                continue
            sock.setblocking(True)
            return sock

    def _serve_client(self, sock: socket.socket, credentials: object) -> None:
        """RPyC's own, over the bulk transport (rpycdl.transport)."""
        config = dict(self.protocol_config, credentials=credentials,
                      endpoints=(sock.getsockname(), sock.getpeername()), logger=self.logger)
        limits = self.context.limits
        channel = transport.channel(sock, limits.max_payload + FRAME_SLACK, limits.idle_timeout)
        service = self.service(self._spare_job)
        self._handle_connection(service._connect(channel, config), service)

    def _handle_connection(self, conn: rpyc.Connection, service: GPUService) -> None:
        """Serve until the client leaves, or stays idle (no request, no job) for the idle timeout;
        after each answer, let the service finish what the call left for after its reply."""
        idle_since = time.monotonic()
        try:
            while not conn.closed:
                if conn.serve(1.0):
                    service.after_reply()
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > self.context.limits.idle_timeout:
                    self.logger.info("closing a connection idle for %.0f s (--idle-timeout)",
                                     time.monotonic() - idle_since)
                    conn.close()
        except EOFError:  # the client left: the usual end of a connection
            conn.close()
        finally:
            service.after_reply()

    def _sweep(self) -> None:
        while not self._stop.is_set():  # the first sweep at start cleans up after a server that died
            try:
                self._sweep_once()
            except Exception:  # a sweep must never take the server down
                log.exception("sweep failed")
            select.select([self._wake_r], [], [], SWEEP_INTERVAL)
            lockdir.drain(self._wake_r)

    def _sweep_once(self) -> None:
        """Kill what this server adopted; then, unless some of it will not die, clear the orphaned
        grants of its dead connection processes; clear those of dead servers; end dead jobs' records."""
        ctx = self.context
        clean = procs.kill_until_gone(self._adopted, KILL_WAIT)  # each is reaped by _handle_sigchld
        if not clean:
            log.warning("processes left by dead connection processes still run after SIGKILL: %s", self._adopted())

        def claim(record: dict[str, Any]) -> bool:
            server = record.get("server_process")
            return (clean and record.get("server_id") == ctx.server_id) or not (server and procs.alive(*server))

        for record in ctx.locks.clear_orphans(claim):
            log.warning("GPUs of job %s granted again: its connection process died", record.get("job_id"))
        for record in ctx.store.sweep():
            log.warning("job %s failed: %s", record.job_id, record.error)
            ctx.locks.wake_all()

    def _adopted(self) -> list[int]:
        """The running processes this server adopted (it is a child subreaper): its children that
        are neither spares nor connection processes (what dead connection processes left), and
        their descendants; but not a job container's watcher, which removes its container."""
        with self._forking:
            mine = self._spares | self._connections
            found = [pid for pid in procs.children(os.getpid()) if pid not in mine]
        found = [pid for pid in found if not procs.runs_module(pid, CONTAINER_WATCHER)]
        return [each for pid in found for each in (pid, *procs.subtree(pid)) if procs.alive(each)]


def _remove_orphan_containers(lock_dir: str) -> None:
    """Remove job containers a killed server left running; before any thread or fork, since the
    parent must not use docker from a thread while it forks."""
    from rpycdl import containers  # only the generic server needs docker

    try:
        for name in containers.remove_orphans(lock_dir):
            print(f"removed orphaned job container {name}", flush=True)
    except Exception as exc:  # no engine reachable: nothing of ours can run there either
        log.info("orphaned job containers not checked: %s", exc)


def _running(pid: int) -> bool:
    """Whether a child process still runs (an ended one is left for _handle_sigchld to reap)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _poke(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"!")


def build_server(config: ServerConfig) -> DLServer:
    """Check the configuration, load the inventory, and bind the server (not started yet)."""
    secret = auth.load_secret(config.secret_file)
    tls_context = None
    if config.tls_cert or config.tls_key or config.tls_ca:
        tls_context = tls.server_context(config.tls_cert, config.tls_key, config.tls_ca)
    if not is_loopback(config.host) and not config.insecure and secret is None and tls_context is None:
        raise InvalidRequestError(
            f"refusing to listen on {config.host} without authentication: anyone who reaches it can run "
            "code here. Give TLS certificates (--tls-cert, --tls-key, --tls-ca) or a shared secret "
            "(--secret-file), bind to 127.0.0.1, or pass --insecure if the network is trusted")
    inventory = load_inventory(config.gpus)
    version = config.version or framework_version(config.service)
    directory = config.lock_dir or lock_dir()
    # Creates the lock directory's layout, so it fails early on permissions.
    context = ServerContext(name=config.service.lower(), aliases=service_aliases(config.service, version),
                            inventory=inventory, lock_dir=directory, server_id=uuid.uuid4().hex[:12],
                            host=config.host, framework_version=version, limits=config.limits,
                            shares=config.shares)
    lockdir.claim_pid_namespace(Path(directory))
    registrar = None
    if config.registry != "none":
        registrar = registry_client(config.registry)
        registrar.REREGISTER_INTERVAL = REREGISTER_INTERVAL
    return DLServer(context, hostname=config.host, port=config.port, registrar=registrar,
                    auto_register=registrar is not None, logger=logging.getLogger("rpycdl.rpyc"),
                    authenticator=auth.ServerAuthenticator(tls_context, secret) if secret or tls_context else None)


def serve(config: ServerConfig) -> None:
    """Build the server and serve until SIGTERM or Ctrl-C."""
    server = build_server(config)
    ctx = server.context
    if not is_loopback(config.host) and server.authenticator is None:
        print(f"WARNING: listening on {config.host} with --insecure: anyone who can reach port "
              f"{server.port} can run code as {getpass.getuser()}",
              file=sys.stderr, flush=True)
    server.listener.listen(server.backlog)  # before the ready line, so whoever reads it can connect at once
    gpus = ", ".join(f"{g.index}:{g.name}" for g in ctx.gpus)
    kind = "SIMULATED" if ctx.inventory.simulated else "NVML"
    print(f"rpycdl server {ctx.name} on {config.host}:{server.port} as {', '.join(ctx.aliases)}; "
          f"{len(ctx.gpus)} GPU(s) ({kind} {ctx.inventory.spec}): {gpus}; locks in {ctx.lock_dir}; "
          f"authentication: {server.authenticator.mode if server.authenticator else 'none'}", flush=True)
    if ctx.name == CONTAINER_SERVICE:
        _remove_orphan_containers(ctx.lock_dir)
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    runner.name_process("rpycdl-server")
    try:
        server.start()
    except (KeyboardInterrupt, OSError):
        pass
    finally:
        if server.active:
            server.close()

