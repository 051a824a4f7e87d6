"""A connection to one server: `conn.root.run_code` with plain callables, large buffers beside the
call, remote errors re-raised; detached jobs (submit); status, jobs, cancel. A connection that died
(interrupted, closed by the server after its idle timeout, the server restarted) is opened again by the
next call that starts something new."""

from __future__ import annotations

import functools
import getpass
import json
import os
import sys
from collections.abc import Callable
from typing import IO, Any

import rpyc
from rpyc.core import consts

from rpycdl.artifacts import workdir
from rpycdl.artifacts.manifest import Manifests
from rpycdl.client import channel, failures
from rpycdl.client.arrays import ArrayCalls
from rpycdl.client.detached import DetachedCalls, given, idle_sent, priority_sent
from rpycdl.client.displays import GPUStatus, client_row
from rpycdl.client.notices import Notices
from rpycdl.client.session import Receiver, Session, sink
from rpycdl.defaults import MIN_MAX_PAYLOAD
from rpycdl.errors import ConnectionFailedError, ConnectionLostError, InvalidRequestError, LimitError
from rpycdl.security import auth
from rpycdl.wire import bulk, codec, stream

CLIENT_CONFIG = {
    "allow_public_attrs": False,
    "allow_pickle": False,
    "sync_request_timeout": None,  # a job takes as long as it takes; run_code(timeout=) bounds it
}

StateCallback = Callable[[str, dict[str, Any]], None]


class RemoteRoot(DetachedCalls, ArrayCalls):
    """`conn.root` of an rpycdl connection: run_code with plain callables, sessions, status; detached jobs,
    the host's jobs and cancel (DetachedCalls).

    Any other attribute is looked up on the server's RPyC root."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._max_payload: int | None = None
        self._buffers_beside = True  # False once the server turned out to predate run_buffers
        self._receiver = Receiver(self._receive)

    @property
    def _conn(self) -> rpyc.Connection:
        """The RPyC connection now (the one a call in its middle uses: not opened again here)."""
        return self._connection._conn

    def _check_size(self, size: int) -> None:
        """Refuse here, with the limit's name, a call of `size` bytes the server would refuse."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if size <= MIN_MAX_PAYLOAD:  # every server takes this much: no round trip
            return
        if self._max_payload is None:
            try:
                self._max_payload = int(json.loads(self._connection.call("limits"))["max_payload"])
            except AttributeError:  # a server from before limits: it checks nothing either
                self._max_payload = sys.maxsize
        if size > self._max_payload:
            raise LimitError(f"the call is {size} bytes, over the server's limit of {self._max_payload} "
                             "(--max-payload)")

    def run_code(self, fn: Callable[..., Any] | bytes, args: Any = None, ngpus: int | None = None, *,
                 gpus: float | None = None, gpu_memory: str | int | None = None,
                 timeout: float | None = None, queue_timeout: float | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                 on_state: StateCallback | None = None, working_dir: str | os.PathLike[str] | None = None,
                 memory: str | int | None = None, cpus: float | None = None, idle_reclaim: bool = True,
                 priority: int = 0) -> Any:
        """Run `fn(args)` on the server with `ngpus` GPUs of its own, or a share of one GPU, and
        return its value. While it waits for its GPUs, a line on stderr says what it waits for, and one
        when it starts, where a person looks, unless the connection is quiet (rpycdl.client.notices).

        Args:
            fn, args: a callable (serialised here with dill), or dill bytes of one; the one argument it gets.
            ngpus: whole GPUs to lock, or -1 for all of the server's (default 1).
            gpus: instead of ngpus, a share of one GPU (0.25: a quarter of its memory), or a whole number of GPUs.
            gpu_memory: instead of ngpus, a share of one GPU by memory ("6GiB", or bytes). A share is rounded up to
                the server's unit; the job is held to it (rpycdl.gpu.caps, the watchdog: GPUMemoryExceededError).
            timeout, queue_timeout: seconds the job may run, and wait for its GPUs; JobTimeoutError, QueueTimeoutError.
            stdout, stderr: where the job's output goes, live (default: this process's).
            on_state: called as on_state(state, info) as the job waits ("pending": info["ahead"], the jobs holding
                its GPUs and the requests before it, info["holders"], info["reason"]: its owner's limit, if one holds
                it back; see JobStatus), and when it starts ("running": info["gpus"]); times as datetimes.
            working_dir: a local directory the job runs in on the server: packed here (leaving out
                what its .rpycdlignore names), sent unless the server has it already (by content
                hash), unpacked for this job alone; its current directory and first on its sys.path.
            memory, cpus: host memory ("16GiB") and CPU cores (4, 0.5) the job may use where the server fences
                jobs; past it, HostMemoryExceededError (default: its --job-memory, --job-cpus).
            idle_reclaim: False keeps the GPUs however idle (else --idle-reclaim: IdleReclaimedError), if allowed.
            priority: -10 to 10 (default 0): a higher one waits before lower ones; above 0 within your ceiling.

        Raises:
            The job's own exception (its type where it can be rebuilt here, else RemoteError) from the job's
            frames, with their source lines (a notebook's too; the text in `remote_traceback`); an
            RpycdlError: ConnectionLostError when the connection drops, which cancels the job,
            InvalidRequestError for a function the server cannot load (naming `working_dir="."` when its
            module is beside you), ... KeyboardInterrupt (one line) cancels the job: the connection closes.

        Large bytes, bytearrays and NumPy arrays travel beside the call (rpycdl.wire.bulk)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        payload, buffers = codec.encode_call(fn, args)
        layout = codec.layout(buffers)
        self._check_size(len(payload) + codec.layout_bytes(layout))
        share = () if gpus is None and gpu_memory is None else (gpus, gpu_memory)  # servers before shares
        notices = Notices(on_state, self._connection.quiet)
        options = (1 if ngpus is None and not share else ngpus, sink(stdout or sys.stdout),
                   sink(stderr or sys.stderr), timeout, queue_timeout, notices.callback())
        received: list[Any] = []
        digest = self._working_dir(working_dir)
        try:
            asked = (*options, gpus, gpu_memory, digest, *given(memory, cpus, idle_sent(idle_reclaim),
                                                                    priority_sent(priority)))  # old: none
            outcome = self._run_buffers(payload, layout, buffers, received, asked)
            if outcome is None:  # a server from before run_buffers: everything in band
                outcome = self._connection.call("run", codec.encode_payload(fn, args) if buffers else payload,
                                                *options, *share)
        except KeyboardInterrupt:  # the server sees the client go and cancels the job
            raise failures.interrupted(self._connection, notices.job_id and f"job {notices.job_id}") from None
        except ConnectionLostError as exc:
            raise failures.lost(exc, "the job was cancelled") from None
        return _decoded(outcome, received, working_dir)

    def _run_buffers(self, payload: bytes, layout: codec.Layout, buffers: list[Any], received: list[Any],
                     options: tuple[Any, ...]) -> bytes | None:
        """The call through run_buffers, its buffers and its result's beside it (the result's into
        `received`); None if the server predates run_buffers (asked once per connection)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if not self._buffers_beside:
            return None
        self._connection.live()
        try:
            send = functools.partial(self._send, buffers) if buffers else None
            with self._receiver.taken(received) as receive:
                return self._connection.call("run_buffers", payload, layout, send, receive, *options)
        except AttributeError as exc:
            if "run_buffers" not in str(exc):
                raise
            self._buffers_beside = False
            return None

    def _send(self, buffers: list[Any], framed: bool = False) -> None:
        """The call's out-of-band buffers, written raw on the connection (bulk.pull), in a bulk frame if the
        server asks for one (a server from before bulk frames does not)."""
        with stream.closed_on_failure(self._conn), bulk.sending(self._conn, framed) as sock:
            bulk.send_buffers(sock, buffers)

    def _receive(self, layout: Any, framed: bool = False) -> list[Any]:
        """A result's out-of-band buffers, read raw from the connection (bulk.push), in a bulk frame if the
        server says so."""
        with stream.closed_on_failure(self._conn), bulk.receiving(self._conn, framed=framed) as sock:
            return bulk.receive_buffers(sock, codec.check_layout(layout))

    def run_container(self, image: str, command: list[str], ngpus: int = 1, *, env: dict[str, str] | None = None,
                      workdir: str | None = None, mounts: list[dict[str, Any]] | None = None,
                      timeout: float | None = None, queue_timeout: float | None = None,
                      stdout: IO[str] | None = None, stderr: IO[str] | None = None,
                      on_state: StateCallback | None = None) -> int:
        """Run `command` in a container of `image` with `ngpus` GPUs (the generic `deeplearning`
        server only) and stream its output; returns its exit code, 0.

        Args:
            image: an image the server's Docker engine has.
            command: the argument list (never a shell string).
            env, workdir: the container's environment and working directory.
            mounts: [{"source": host dir, "target": container dir, "read_only": bool}], sources
                under the server's $RPYCDL_MOUNT_ROOTS.
            timeout, queue_timeout, stdout, stderr, on_state: as for run_code.

        Raises:
            rpycdl.containers.ContainerError: a non-zero exit, with the last log lines.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        out = stdout if stdout is not None else sys.stdout
        err = stderr if stderr is not None else sys.stderr
        notices = Notices(on_state, self._connection.quiet)
        try:
            outcome = self._connection.call("run_container", image, command, ngpus, env, workdir, mounts, sink(out),
                                            sink(err), timeout, queue_timeout, notices.callback())
        except KeyboardInterrupt:
            raise failures.interrupted(self._connection, notices.job_id and f"job {notices.job_id}") from None
        except ConnectionLostError as exc:
            raise failures.lost(exc, "the job was cancelled") from None
        return codec.decode_outcome(outcome)

    def session(self, ngpus: int | None = None, *, gpus: float | None = None, gpu_memory: str | int | None = None,
                timeout: float | None = None, idle_timeout: float | None = None, queue_timeout: float | None = None,
                on_state: StateCallback | None = None, working_dir: str | os.PathLike[str] | None = None,
                memory: str | int | None = None, cpus: float | None = None, idle_reclaim: bool = True,
                priority: int = 0) -> Session:
        """A session: it waits in line for `ngpus` GPUs (or a share: `gpus`, `gpu_memory`) like any job, then
        holds them and one process on the server, in which `run()` calls one after another, so that what a
        call leaves in module globals is there for the next. Opened by `with` (or open()), ended by leaving
        it (or close()), by the client going away, after `idle_timeout` seconds without a call (default 600),
        after `timeout` seconds in all, or by a cancel (rpycdl cancel ID).

        Args:
            ngpus, gpus, gpu_memory, queue_timeout, on_state, working_dir, memory, cpus, priority: as for run_code
                (the waiting line, the memory and the CPUs are the session's).
            timeout: seconds the session may last; idle_timeout: seconds it may wait for its next call.
            idle_reclaim: False keeps its GPUs however long they show no utilization (run_code's idle_reclaim).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        options = {"ngpus": 1 if ngpus is None and gpus is None and gpu_memory is None else ngpus, "gpus": gpus,
                   "gpu_memory": gpu_memory, "timeout": timeout, "idle_timeout": idle_timeout,
                   "queue_timeout": queue_timeout, "working_dir": self._working_dir(working_dir), "memory": memory,
                   "cpus": cpus, "idle_reclaim": idle_sent(idle_reclaim),
                   "priority": priority_sent(priority)}
        return Session(self, {name: value for name, value in options.items() if value is not None},
                       Notices(on_state, self._connection.quiet, "session"))

    def gpu_status(self) -> GPUStatus:
        """This server's GPUs, who holds each (since when: datetimes), and the waiting queue, as `rpycdl status`
        shows them; a dict, which Jupyter shows as tables."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return GPUStatus(client_row(json.loads(self._connection.call("gpu_status"))))

    def identify(self, user: str) -> dict[str, Any]:
        """Declare who this client is (a user name; a client certificate's user wins), for this connection and
        the connections that replace it. Returns who the server takes it for (Connection.identity)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return self._connection.declare(user)

    def _working_dir(self, directory: str | os.PathLike[str] | None) -> str | None:
        """Make sure the server has `directory`, packed (rpycdl.artifacts.workdir): an unchanged directory
        this client sent it before (rpycdl.artifacts.manifest) is only named, else it is streamed raw beside
        RPyC, each file read once, and the server names it by the hash it computes as it arrives. Returns
        that content hash, which the job's request names; None for none."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if directory is None:
            return None
        limits = json.loads(self._connection.call("limits"))
        if "max_working_dir" not in limits:
            raise InvalidRequestError("this server predates working directories: upgrade it, or run without one")
        scanned = workdir.scan(directory, limits["max_working_dir"])
        manifests, server = Manifests(), "{}:{}".format(*self._connection.address)
        known = manifests.known(scanned, server)
        if known is not None and self._connection.call("has_working_dir", known):
            return known
        sent: dict[str, Any] = {}
        racy = manifests.racy(scanned)

        def send(framed: bool = False) -> None:  # the server's callback: the archive, raw; a file changed meanwhile
            with stream.closed_on_failure(self._conn), bulk.sending(self._conn, framed) as sock:  # is told after
                try:
                    sent["racy"] = scanned.stream(functools.partial(stream.send_view, sock), racy)
                except InvalidRequestError as exc:
                    sent["error"] = exc

        digest = codec.decode_outcome(self._connection.call("put_working_dir", None, scanned.size, send))
        if "error" in sent:
            raise sent["error"]
        manifests.remember(scanned, server, digest, sent["racy"])
        return digest

    def __getattr__(self, name: str) -> Any:
        """Any other method of the server (`conn.root.server_info()`), as RPyC gives it, its answer unchanged; a
        connection that dies meanwhile raises ConnectionLostError or ConnectionFailedError, as every call does.

        Raises:
            AttributeError: the server has no such method.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        connection = self._connection
        conn = connection.live()
        with channel.reported(connection.address, f"getting {name}", lambda: connection._why(conn)):
            method = getattr(conn.root, name)

        def remote(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
            with channel.reported(connection.address, f"calling {name}", lambda: connection._why(conn)):
                return method(*args, **kwargs)

        return remote


class Connection:
    """A connection to one rpycdl server. Use as a context manager, or call close().

    A connection that died (an interrupt closed it, the server closed it after its idle timeout, the server
    restarted) is opened again, with the same credentials and the same declared user, by the next call that
    starts something new; a call cut in its middle raises ConnectionLostError, saying what ended with it.

    Attributes:
        address: the server's (host, port).
        identity: who the server takes this client for: {"user", "verified", "admin", "label"}.
        session: the session open on this connection (conn.root.session()), or None.
        quiet: whether its calls keep quiet: True, no waiting line and no download bar; False, them even in
            batch use; None (default), them where a person looks (a terminal, a notebook) unless
            $RPYCDL_QUIET=1 (rpycdl.client.notices).
    """

    def __init__(self, conn: rpyc.Connection, address: tuple[str, int],
                 reopen: Callable[[], rpyc.Connection] | None = None, user: str | None = None,
                 quiet: bool | None = None) -> None:
        self._conn = conn
        self.quiet = quiet
        self.address = address
        self._open = reopen
        self._closed = False  # close() was called: never opened again
        self._interrupted: rpyc.Connection | None = None  # the connection an interrupt closed
        self.session: Session | None = None
        self.root = RemoteRoot(self)
        if user is None:
            user = getpass.getuser()
            user = user if auth.is_user_name(user) else "unknown"
        self._user = user
        self._identify()

    def _identify(self) -> None:
        """Declare the user, not waited for: the server handles it before any request sent after it."""
        conn = self._conn
        with channel.reported(self.address, "calling identify"):
            self._identity: rpyc.AsyncResult | dict[str, Any] = conn.async_request(
                consts.HANDLE_CALLATTR, conn.root, "identify", (self._user,), ())

    @property
    def identity(self) -> dict[str, Any]:
        if not isinstance(self._identity, dict):
            with channel.reported(self.address, "calling identify"):
                self._identity = json.loads(self._identity.value)
        return self._identity

    def declare(self, user: str) -> dict[str, Any]:
        """Declare `user` (RemoteRoot.identify), now and on every connection that replaces this one."""
        self._user = user
        self.live()
        self._identify()
        return self.identity

    @property
    def closed(self) -> bool:
        """Whether the connection is closed now: by close(), or it died (the next call opens it again)."""
        return self._closed or self._conn.closed

    @property
    def closed_by_user(self) -> bool:
        """Whether close() was called: calls on it fail then (job handles open a connection of their own)."""
        return self._closed

    def close(self) -> None:
        """Close the connection without waiting for the server to acknowledge it."""
        self._closed = True
        stream.close_now(self._conn)

    def interrupt(self) -> None:
        """Close the connection now, as Ctrl-C of a call does (the server cancels what runs on it); the next call
        opens it again."""
        self._interrupted = self._conn
        stream.close_now(self._conn)

    def live(self) -> rpyc.Connection:
        """The RPyC connection, opened again first if it has died: what a call that starts something new uses.

        Raises:
            ConnectionFailedError: close() was called, or the server cannot be reached again.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        conn = self._conn
        try:
            while not conn.closed and conn.poll(0):  # a late answer, or the end of the connection
                pass
        except (EOFError, OSError):
            stream.close_now(conn)
        if self._closed or (conn.closed and self._open is None):
            raise ConnectionFailedError(f"the connection to {self.address[0]}:{self.address[1]} is closed"
                                        f"{' (close() was called)' if self._closed else ''}: connect again",
                                        self.address)
        if conn.closed:
            self._conn = self._open()  # type: ignore[misc]
            self._identify()
        return self._conn

    def call(self, name: str, *args: Any) -> Any:
        """The server's answer to `conn.root.<name>(*args)`, as it sent it, on the connection opened again if it
        had died.

        Raises:
            ConnectionLostError: the connection closed before the answer came (also an EOFError).
            ConnectionFailedError: the connection failed otherwise (also an OSError).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        conn = self.live()
        with channel.reported(self.address, f"calling {name}", lambda: self._why(conn)):
            return call(conn, name, *args)

    def _why(self, conn: rpyc.Connection) -> str:
        """Why `conn` closed, where this client closed it."""
        return "interrupted" if conn is self._interrupted else "closed by this client" if self._closed else ""

    def reopen(self) -> Connection:
        """A new connection to the same server, with the same credentials and declared user.

        Raises:
            ConnectionFailedError: the server cannot be reached, or this connection cannot be reopened.
        """
        if self._open is None:
            raise ConnectionFailedError(f"the connection to the server at {self.address[0]}:{self.address[1]} is "
                                        "closed", self.address)
        return Connection(self._open(), self.address, self._open, self._user, self.quiet)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<rpycdl.Connection {self.address[0]}:{self.address[1]}>"


def _decoded(outcome: bytes, received: list[Any], working_dir: object) -> Any:
    """A job's value, or its exception raised; a module the server lacks, with how to send it (failures.hinted)."""
    __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
    try:
        return codec.decode_outcome(outcome, received)
    except InvalidRequestError as exc:
        raise failures.hinted(exc, working_dir) from None


def call(conn: rpyc.Connection, name: str, *args: Any) -> Any:
    """`conn.root.<name>(*args)` in one request (RPyC's CALLATTR) instead of two (GETATTR, CALL)."""
    return conn.sync_request(consts.HANDLE_CALLATTR, conn.root, name, args, ())
