"""`conn.root.session(...)`: a session, which waits in the queue like any job, then holds its GPUs and one
process on the server between calls, so that what a call leaves in that process's globals (a model loaded,
a dataset on the GPU) is there for the next (rpycdl.server.sessions). A connection that drops raises
ConnectionLostError naming the server and saying that the session ended, as every call of the client names
what ended with it (rpycdl.client.channel.reported, rpycdl.client.failures); a session is never opened again
with its connection (what it held is gone)."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any

import rpyc
from rpyc.core import consts

from rpycdl.client import channel, failures
from rpycdl.client.notices import Notices
from rpycdl.defaults import SESSION_INTERRUPT_GRACE
from rpycdl.errors import ConnectionLostError, InvalidRequestError
from rpycdl.wire import codec, stream

if TYPE_CHECKING:
    from rpycdl.client.connection import RemoteRoot


class Session:
    """A session on one connection; use it as a context manager (`with conn.root.session(ngpus=1) as s:`),
    or open() and close() it.

    Attributes:
        id: the session's job id (rpycdl jobs lists it, kind "session"), once open.
        uuids: the GPUs it holds, once open.
    """

    def __init__(self, root: RemoteRoot, options: dict[str, Any], notices: Notices | None = None) -> None:
        self._root, self._options = root, options
        self._notices = notices or Notices(None, True, "session")
        self._conn: rpyc.Connection | None = None  # the connection it holds, once open
        self.id: str | None = None
        self.uuids: list[str] = []
        self._calls: int | None = None  # once closed: how many calls it ran
        self._callbacks: tuple[Any, ...] = (None, None, None)  # the server keeps them: sent once (run)

    def open(self) -> Session:
        """Wait in line for the GPUs (saying so where a person looks, as run_code does), then hold them and a
        process. Returns the session.

        Raises:
            QueueTimeoutError, InvalidRequestError, LimitError, NotAllowedError: as run_code for a job.
            KeyboardInterrupt: Ctrl-C while it waits or opens (one line; the connection is closed, which ends
                the session, and opened again by the connection's next call).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        connection = self._root._connection
        conn = connection.live()
        state = self._notices.callback()
        options = tuple({**self._options, **({"on_state": state} if state is not None else {})}.items())
        try:
            with channel.reported(connection.address, "calling session_open"):
                outcome = conn.sync_request(consts.HANDLE_CALLATTR, conn.root, "session_open", (), options)
        except KeyboardInterrupt:
            what = self._notices.job_id and f"session {self._notices.job_id}"
            raise failures.interrupted(connection, what or "the session") from None
        except ConnectionLostError as exc:
            raise failures.lost(exc, "the session ended") from None
        opened = codec.decode_outcome(outcome)
        self.id, self.uuids, self._conn = opened["job_id"], opened["uuids"], conn
        connection.session = self
        return self

    def run(self, fn: Callable[..., Any] | bytes, args: Any = None, *, stdout: IO[str] | None = None,
            stderr: IO[str] | None = None, timeout: float | None = None) -> Any:
        """Run `fn(args)` in the session's process, streaming its output, and return its value; what it
        leaves in module globals is there for the next call. Large arrays travel beside the call, as with
        run_code.

        Args:
            fn, args, stdout, stderr: as for run_code.
            timeout: seconds this call may run (the session's own timeout bounds it too); past it the
                session ends with JobTimeoutError.

        Raises:
            The call's own exception, re-raised here from its frames (as run_code does): the session goes on.
            KeyboardInterrupt (Ctrl-C) interrupts the call (KeyboardInterrupt in it) and the session goes on,
            unless the call does not stop within SESSION_INTERRUPT_GRACE seconds: then the session ends, and
            so does the connection (the message says which). JobTimeoutError, JobCancelledError,
            JobCrashedError, GPUMemoryExceededError, GPUNotGrantedError: the session ended (the message says
            why). ConnectionLostError: its connection closed (the message says why), which ended it.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        conn = self._held()
        payload, buffers = codec.encode_call(fn, args)
        layout = codec.layout(buffers)
        self._root._check_size(len(payload) + codec.layout_bytes(layout))
        received: list[Any] = []
        send = functools.partial(self._root._send, buffers) if buffers else None
        out, err = stdout or sys.stdout, stderr or sys.stderr
        with self._root._receiver.taken(received) as receive:
            callbacks = (receive, sink(out), sink(err))
            sent = [None if new is kept else new for new, kept in zip(callbacks, self._callbacks, strict=True)]
            self._callbacks = callbacks  # the server takes them first thing, before it may refuse the call
            outcome = self._interruptible(conn, "session_call", payload, layout, send, *sent, timeout)
        return codec.decode_outcome(outcome, received)

    def close(self) -> int:
        """End the session: its process goes, then its GPUs. Returns how many calls it ran. Closing again
        does nothing (and returns the same)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if self._calls is not None:
            return self._calls
        connection = self._root._connection
        if connection.session is self:
            connection.session = None
        conn, self._conn = self._conn, None
        if conn is None or conn.closed:
            self._calls = 0
        else:
            with channel.reported(connection.address, "calling session_close"):
                self._calls = codec.decode_outcome(
                    conn.sync_request(consts.HANDLE_CALLATTR, conn.root, "session_close", (), ()))
        return self._calls

    def _held(self) -> rpyc.Connection:
        """The connection the session lives on, if it is still open (a session is not opened again with it).

        Raises:
            ConnectionLostError: it closed, which ended the session.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        connection, conn = self._root._connection, self._conn
        if conn is None:
            raise InvalidRequestError("this session is not open: open it (with, or open()), or open a new one with "
                                      "conn.root.session()")
        try:
            with channel.reported(connection.address, "calling session_call", lambda: connection._why(conn)):
                try:
                    while not conn.closed and conn.poll(0):  # a late answer, or the end of the connection
                        pass
                except (EOFError, OSError):
                    stream.close_now(conn)
                if conn.closed:
                    raise EOFError("connection closed")
        except ConnectionLostError as exc:
            raise failures.lost(exc, "the session ended") from None
        return conn

    def _interruptible(self, conn: rpyc.Connection, name: str, *args: Any) -> bytes:
        """A call of the server that Ctrl-C interrupts on the server, not here: the interrupt is sent, then its
        answer waited for (SESSION_INTERRUPT_GRACE and a second more), then the connection closed."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        connection = self._root._connection
        try:
            with channel.reported(connection.address, f"calling {name}", lambda: connection._why(conn)):
                reply = conn.async_request(consts.HANDLE_CALLATTR, conn.root, name, args, ())
                try:
                    reply.wait()
                except KeyboardInterrupt:
                    try:
                        conn.async_request(consts.HANDLE_CALLATTR, conn.root, "session_interrupt", (), ())
                        reply.set_expiry(SESSION_INTERRUPT_GRACE + 1.0)
                        reply.wait()
                    except (KeyboardInterrupt, rpyc.AsyncResultTimeout):
                        raise failures.interrupted(connection, f"session {self.id}") from None
                    raise failures.stopped(f"the call in session {self.id} (KeyboardInterrupt in it; the session "
                                           "goes on)") from None
                return reply.value
        except ConnectionLostError as exc:
            raise failures.lost(exc, "the session ended") from None

    def __enter__(self) -> Session:
        return self.open()

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # the error that left the block is the one to see
            self.close()

    def __repr__(self) -> str:
        return f"<rpycdl.Session {self.id or '(not open)'} on {', '.join(self.uuids) or 'no GPU yet'}>"


class Receiver:
    """A connection's callback for a result's out-of-band buffers (wire.bulk.push), the same object for each of
    its calls, so that the server, which keeps it between calls (ConnectionLink.keep_sinks), drops no proxy of
    it. One call at a time: a call made while another holds it (which the server refuses) gets one of its own.

    Args:
        read: reads the buffers of a result's layout from the connection (in a bulk frame if told so).
    """

    def __init__(self, read: Callable[[Any, bool], list[Any]]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._into: list[Any] | None = None
        # What the server is handed: one bound method, made once. RPyC proxies a method with a class it has
        # (builtins.method), where a proxy of a Receiver needs the client asked for the class's methods first
        # (HANDLE_INSPECT: a request of the server's and its reply, once on each connection).
        self._callback = self.__call__

    @contextlib.contextmanager
    def taken(self, into: list[Any]) -> Iterator[Callable[[Any], None]]:
        """The callback for one call, putting what it receives `into` the call's list."""
        if not self._lock.acquire(blocking=False):
            yield lambda layout, framed=False: into.extend(self._read(layout, framed))
            return
        self._into = into
        try:
            yield self._callback
        finally:
            self._into = None
            self._lock.release()

    def __call__(self, layout: Any, framed: bool = False) -> None:
        into = self._into
        if into is None:
            raise InvalidRequestError("no call of this connection waits for a result")
        into.extend(self._read(layout, framed))


_SINKS: weakref.WeakKeyDictionary[Any, Callable[[str], None]] = weakref.WeakKeyDictionary()
"""Each stream's sink, as long as the stream lives."""


def sink(out: IO[str]) -> Callable[[str], None]:
    """What a job's output is handed to: written to `out`, flushed at once. The same stream gets the same sink
    each call, so that the server, which keeps a connection's last sinks (ConnectionLink.keep_sinks), finds
    the proxy it holds already and drops none (RPyC asks the client to let go of each proxy dropped: a request
    and its reply, per sink per call)."""
    with contextlib.suppress(KeyError, TypeError):  # TypeError: a stream that cannot be a key
        return _SINKS[out]
    try:
        write = _writer(weakref.ref(out))
    except TypeError:  # a stream that takes no weak reference: a sink of its own each call
        return _writer(lambda: out)
    with contextlib.suppress(TypeError):
        _SINKS[out] = write
    return write


def _writer(stream: Callable[[], IO[str] | None]) -> Callable[[str], None]:
    def write(text: str) -> None:
        out = stream()
        if out is not None:  # None: the stream is gone, and with it whoever read it
            out.write(text)
            out.flush()

    return write
