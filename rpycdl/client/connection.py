"""A connection to one server: `conn.root.run_code` with plain callables, large buffers beside the
call, remote errors re-raised; detached jobs (submit); status, jobs, cancel."""

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
from rpycdl.client import channel
from rpycdl.client.jobs import Job
from rpycdl.client.session import Session, sink
from rpycdl.defaults import MIN_MAX_PAYLOAD
from rpycdl.errors import ConnectionFailedError, InvalidRequestError, LimitError
from rpycdl.security import auth
from rpycdl.wire import bulk, codec, stream

CLIENT_CONFIG = {
    "allow_public_attrs": False,
    "allow_pickle": False,
    "sync_request_timeout": None,  # a job takes as long as it takes; run_code(timeout=) bounds it
}

StateCallback = Callable[[str, dict[str, Any]], None]


class RemoteRoot:
    """`conn.root` of an rpycdl connection: run_code with plain callables, status, jobs, cancel.

    Any other attribute is looked up on the server's RPyC root."""

    def __init__(self, conn: rpyc.Connection, connection: Connection) -> None:
        self._conn = conn
        self._connection = connection
        self._max_payload: int | None = None
        self._buffers_beside = True  # False once the server turned out to predate run_buffers

    def _check_size(self, size: int) -> None:
        """Refuse here, with the limit's name, a call of `size` bytes the server would refuse."""
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
                 on_state: StateCallback | None = None, working_dir: str | os.PathLike[str] | None = None) -> Any:
        """Run `fn(args)` on the server with `ngpus` GPUs of its own, or a share of one GPU, and
        return its value.

        Args:
            fn: a callable (serialised here with dill), or dill bytes of one.
            args: the single argument passed to fn.
            ngpus: whole GPUs to lock, or -1 for all of the server's (default 1).
            gpus: instead of ngpus, a share of one GPU (0.25: a quarter of its memory), or a whole
                number of GPUs.
            gpu_memory: instead of ngpus, a share of one GPU by memory ("6GiB", or bytes). A share
                is rounded up to the server's unit; the job is held to it (rpycdl.gpu.caps and the
                server's watchdog, which raises GPUMemoryExceededError).
            timeout: seconds the job may run; past it, JobTimeoutError.
            queue_timeout: seconds to wait for the GPUs; past it, QueueTimeoutError.
            stdout, stderr: where the job's output goes, live (default: this process's).
            on_state: called as on_state(state, info) when the job waits ("pending", with info["ahead"],
                the waiting requests before it, and info["holders"], the jobs holding the GPUs it waits for:
                see JobStatus) and when it starts ("running", with info["gpus"]).
            working_dir: a local directory the job runs in on the server: packed here (leaving out
                what its .rpycdlignore names), sent unless the server has it already (by content
                hash), unpacked for this job alone; its current directory and first on its sys.path.

        Raises:
            The job's own exception (same type where it can be rebuilt here, else RemoteError),
            with the remote traceback in `remote_traceback`; or an RpycdlError subclass: among them
            ConnectionLostError (also an EOFError) when the connection drops, which cancels the job.
            KeyboardInterrupt cancels the job: the connection is closed.

        Large bytes, bytearrays and NumPy arrays, in `args` or in the value, travel beside the call
        rather than in it (rpycdl.wire.codec, rpycdl.wire.bulk), unless the server predates that.
        """
        payload, buffers = codec.encode_call(fn, args)
        layout = codec.layout(buffers)
        self._check_size(len(payload) + codec.layout_bytes(layout))
        share = () if gpus is None and gpu_memory is None else (gpus, gpu_memory)  # servers before shares
        state_cb = None if on_state is None else (lambda state, info: on_state(state, json.loads(info)))
        options = (1 if ngpus is None and not share else ngpus, sink(stdout or sys.stdout),
                   sink(stderr or sys.stderr), timeout, queue_timeout, state_cb)
        received: list[Any] = []
        digest = self._working_dir(working_dir)
        try:
            outcome = self._run_buffers(payload, layout, buffers, received, (*options, gpus, gpu_memory, digest))
            if outcome is None:  # a server from before run_buffers: everything in band
                if buffers:
                    payload = codec.encode_payload(fn, args)
                outcome = self._connection.call("run", payload, *options, *share)
        except KeyboardInterrupt:
            stream.close_now(self._conn)  # the server sees the client go and cancels the job
            raise
        return codec.decode_outcome(outcome, received)

    def _run_buffers(self, payload: bytes, layout: codec.Layout, buffers: list[Any], received: list[Any],
                     options: tuple[Any, ...]) -> bytes | None:
        """The call through run_buffers, its buffers and its result's beside it (the result's into
        `received`); None if the server predates run_buffers (asked once per connection)."""
        if not self._buffers_beside:
            return None
        sock = bulk.bulk_socket(self._conn)
        try:
            return self._connection.call("run_buffers", payload, layout,
                        (lambda: self._send(sock, buffers)) if buffers else None,
                        lambda result: received.extend(self._receive(sock, result)), *options)
        except AttributeError as exc:
            if "run_buffers" not in str(exc):
                raise
            self._buffers_beside = False
            return None

    def _send(self, sock: Any, buffers: list[Any]) -> None:
        """The call's out-of-band buffers, written raw on the connection (bulk.pull)."""
        with stream.closed_on_failure(self._conn):
            bulk.send_buffers(sock, buffers)

    def _receive(self, sock: Any, layout: Any) -> list[Any]:
        """A result's out-of-band buffers, read raw from the connection (bulk.push)."""
        with stream.closed_on_failure(self._conn):
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
        out = stdout if stdout is not None else sys.stdout
        err = stderr if stderr is not None else sys.stderr
        state_cb = None if on_state is None else (lambda state, info: on_state(state, json.loads(info)))
        try:
            outcome = self._connection.call("run_container", image, command, ngpus, env, workdir, mounts, sink(out),
                                            sink(err), timeout, queue_timeout, state_cb)
        except KeyboardInterrupt:
            stream.close_now(self._conn)
            raise
        return codec.decode_outcome(outcome)

    def session(self, ngpus: int | None = None, *, gpus: float | None = None, gpu_memory: str | int | None = None,
                timeout: float | None = None, idle_timeout: float | None = None, queue_timeout: float | None = None,
                on_state: StateCallback | None = None, working_dir: str | os.PathLike[str] | None = None) -> Session:
        """A session: it waits in line for `ngpus` GPUs (or a share: `gpus`, `gpu_memory`) like any job, then
        holds them and one process on the server, in which `run()` calls one after another, so that what a
        call leaves in module globals is there for the next. Opened by `with` (or open()), ended by leaving
        it (or close()), by the client going away, after `idle_timeout` seconds without a call (default 600),
        after `timeout` seconds in all, or by a cancel (rpycdl cancel ID).

        Args:
            ngpus, gpus, gpu_memory, queue_timeout, on_state, working_dir: as for run_code.
            timeout: seconds the session may last; idle_timeout: seconds it may wait for its next call.
        """
        options = {"ngpus": 1 if ngpus is None and gpus is None and gpu_memory is None else ngpus, "gpus": gpus,
                   "gpu_memory": gpu_memory, "timeout": timeout, "idle_timeout": idle_timeout,
                   "queue_timeout": queue_timeout, "on_state": on_state, "working_dir": self._working_dir(working_dir)}
        return Session(self, {name: value for name, value in options.items() if value is not None})

    def gpu_status(self) -> dict[str, Any]:
        """This server's GPUs, who holds each, and the waiting queue (see `rpycdl status`)."""
        return json.loads(self._connection.call("gpu_status"))

    # -- detached jobs, and the host's ledger ------------------------------------------

    def submit(self, fn: Callable[..., Any] | bytes, args: Any = None, ngpus: int | None = None, *,
               gpus: float | None = None, gpu_memory: str | int | None = None, name: str | None = None,
               timeout: float | None = None, queue_timeout: float | None = None,
               working_dir: str | os.PathLike[str] | None = None) -> Job:
        """Submit `fn(args)` as a detached job: it takes its place in the same first-come-first-served
        queue as run_code, and runs to its end whatever happens to this client or to the server
        process that accepted it. Returns its handle once the server has recorded it.

        Args:
            fn, args, ngpus, gpus, gpu_memory, timeout, queue_timeout, working_dir: as for run_code (the
                working directory is unpacked for the job when it is submitted).
            name: a name to find it by (rpycdl.job(name)), unique among your unfinished jobs.

        Raises:
            InvalidRequestError: a request it could never run, or a name you use already.
            LimitError: over one of the server's limits (--max-payload, --max-queued).
        """
        payload = codec.encode_payload(fn, args)
        self._check_size(len(payload))
        digest = self._working_dir(working_dir)
        return self._submitted(self._connection.call("submit", payload, ngpus, gpus, gpu_memory, timeout, queue_timeout,
                                    name, digest))

    def submit_command(self, command: list[str], ngpus: int | None = None, *, gpus: float | None = None,
                       gpu_memory: str | int | None = None, name: str | None = None, timeout: float | None = None,
                       queue_timeout: float | None = None, working_dir: str | os.PathLike[str] | None = None) -> Job:
        """Submit a command (an argv, run on the server in its working directory) as a detached job; it
        fails unless it exits with 0, and its result is its exit code. Options as for submit."""
        digest = self._working_dir(working_dir)
        return self._submitted(self._connection.call("submit_command", list(command), ngpus, gpus, gpu_memory, timeout,
                                    queue_timeout, name, digest))

    def _working_dir(self, directory: str | os.PathLike[str] | None) -> str | None:
        """Make sure the server has `directory`, packed (rpycdl.artifacts.workdir): an unchanged directory
        this client sent it before (rpycdl.artifacts.manifest) is only named, else it is streamed raw beside
        RPyC, each file read once, and the server names it by the hash it computes as it arrives. Returns
        that content hash, which the job's request names; None for none."""
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
        sock, sent = bulk.bulk_socket(self._conn), {}
        racy = manifests.racy(scanned)

        def send() -> None:  # the server's callback: the archive, raw; a file changed meanwhile is told after
            with stream.closed_on_failure(self._conn):
                try:
                    sent["racy"] = scanned.stream(functools.partial(stream.send_view, sock), racy)
                except InvalidRequestError as exc:
                    sent["error"] = exc

        digest = codec.decode_outcome(self._connection.call("put_working_dir", None, scanned.size, send))
        if "error" in sent:
            raise sent["error"]
        manifests.remember(scanned, server, digest, sent["racy"])
        return digest

    def submit_container(self, image: str, command: list[str], ngpus: int = 1, *, env: dict[str, str] | None = None,
                         workdir: str | None = None, mounts: list[dict[str, Any]] | None = None,
                         name: str | None = None, timeout: float | None = None,
                         queue_timeout: float | None = None) -> Job:
        """Submit a command in a container of `image` as a detached job (the generic `deeplearning`
        server only); arguments as for run_container, and `name` as for submit."""
        return self._submitted(self._connection.call("submit_container", image, list(command), ngpus, env, workdir,
                                    mounts, timeout, queue_timeout, name))

    def _submitted(self, outcome: bytes) -> Job:
        return Job(codec.decode_outcome(outcome), self._connection)

    def job(self, ref: str) -> Job:
        """The handle of a job of this server's host, by id, or by name among your jobs.

        Raises:
            InvalidRequestError: no such job.
        """
        return Job(codec.decode_outcome(self._connection.call("job", ref)), self._connection)

    def jobs(self, *, all: bool = False, users: list[str] | None = None, states: list[str] | None = None,
             since: float | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """The rows of the jobs of this server's host (every server sharing its state directory), newest
        first: unfinished ones and those that ended in the last day, or with `all` every job kept.

        Args:
            all: every job the ledger keeps (--keep), not only the recent ones.
            users, states: only these users' jobs, only jobs in these states (PENDING, RUNNING, ...).
            since: the jobs submitted in the last so many seconds, however long ago they ended (instead
                of the recent ones).
            limit: at most so many (default 100; 0: no limit).
        """
        query = {key: value for key, value in
                 {"all": all, "users": users, "states": states, "since": since, "limit": limit}.items()
                 if value is not None}
        return codec.decode_outcome(self._connection.call("jobs", query))

    def cancel(self, ref: str) -> str:
        """Cancel a pending or running job by id or name; returns its state when the request was made.

        Raises:
            NotAllowedError: the job is another user's, and this user is no admin.
            InvalidRequestError: the server's host has no such job.
        """
        return codec.decode_outcome(self._connection.call("cancel", ref))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn.root, name)


class Connection:
    """A connection to one rpycdl server. Use as a context manager, or call close().

    Attributes:
        address: the server's (host, port).
        identity: who the server takes this client for: {"user", "verified", "admin", "label"}.
    """

    def __init__(self, conn: rpyc.Connection, address: tuple[str, int],
                 reopen: Callable[[], Connection] | None = None) -> None:
        self._conn = conn
        self.address = address
        self._reopen = reopen
        self.root = RemoteRoot(conn, self)
        user = getpass.getuser()
        user = user if auth.is_user_name(user) else "unknown"
        # Not waited for: the server handles it before any request sent after it.
        with channel.reported(address, "calling identify"):
            self._identity: rpyc.AsyncResult | dict[str, Any] = conn.async_request(
                consts.HANDLE_CALLATTR, conn.root, "identify", (user,), ())

    @property
    def identity(self) -> dict[str, Any]:
        if not isinstance(self._identity, dict):
            with channel.reported(self.address, "calling identify"):
                self._identity = json.loads(self._identity.value)
        return self._identity

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        """Close the connection without waiting for the server to acknowledge it."""
        stream.close_now(self._conn)

    def call(self, name: str, *args: Any) -> Any:
        """The server's answer to `conn.root.<name>(*args)`, as it sent it.

        Raises:
            ConnectionLostError: the connection closed before the answer came (also an EOFError).
            ConnectionFailedError: the connection failed otherwise (also an OSError).
        """
        with channel.reported(self.address, f"calling {name}"):
            return call(self._conn, name, *args)

    def reopen(self) -> Connection:
        """A new connection to the same server, with the same credentials.

        Raises:
            ConnectionFailedError: the server cannot be reached, or this connection cannot be reopened.
        """
        if self._reopen is None:
            raise ConnectionFailedError(f"the connection to the server at {self.address[0]}:{self.address[1]} is "
                                        "closed", self.address)
        return self._reopen()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<rpycdl.Connection {self.address[0]}:{self.address[1]}>"


def call(conn: rpyc.Connection, name: str, *args: Any) -> Any:
    """`conn.root.<name>(*args)` in one request (RPyC's CALLATTR) instead of two (GETATTR, CALL)."""
    return conn.sync_request(consts.HANDLE_CALLATTR, conn.root, name, args, ())
