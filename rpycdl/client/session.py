"""`conn.root.session(...)`: a session, which waits in the queue like any job, then holds its GPUs and one
process on the server between calls, so that what a call leaves in that process's globals (a model loaded,
a dataset on the GPU) is there for the next (rpycdl.server.sessions). A connection that drops raises
ConnectionLostError naming the server, as every call of the client does (rpycdl.client.channel.reported)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

import rpyc
from rpyc.core import consts

from rpycdl.client import channel
from rpycdl.defaults import SESSION_INTERRUPT_GRACE
from rpycdl.wire import bulk, codec, stream

if TYPE_CHECKING:
    from rpycdl.client.connection import RemoteRoot


class Session:
    """A session on one connection; use it as a context manager (`with conn.root.session(ngpus=1) as s:`),
    or open() and close() it.

    Attributes:
        id: the session's job id (rpycdl jobs lists it, kind "session"), once open.
        uuids: the GPUs it holds, once open.
    """

    def __init__(self, root: RemoteRoot, options: dict[str, Any]) -> None:
        self._root, self._options = root, options
        self.id: str | None = None
        self.uuids: list[str] = []
        self._calls: int | None = None  # once closed: how many calls it ran

    def open(self) -> Session:
        """Wait in line for the GPUs, then hold them and a process. Returns the session.

        Raises:
            QueueTimeoutError, InvalidRequestError, LimitError, NotAllowedError: as run_code for a job.
        """
        opened = codec.decode_outcome(self._call("session_open", **self._options))
        self.id, self.uuids = opened["job_id"], opened["uuids"]
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
            The call's own exception, re-raised here: the session goes on. KeyboardInterrupt (Ctrl-C)
            interrupts the call (KeyboardInterrupt in it) and the session goes on, unless the call does not
            stop within SESSION_INTERRUPT_GRACE seconds: then the session ends, and so does the connection.
            JobTimeoutError, JobCancelledError, JobCrashedError, GPUMemoryExceededError, GPUNotGrantedError:
            the session ended (the message says why).
        """
        payload, buffers = codec.encode_call(fn, args)
        layout = codec.layout(buffers)
        self._root._check_size(len(payload) + codec.layout_bytes(layout))
        sock, received = bulk.bulk_socket(self._root._conn), []
        send = (lambda: self._root._send(sock, buffers)) if buffers else None
        receive = lambda result: received.extend(self._root._receive(sock, result))  # noqa: E731
        out, err = stdout or sys.stdout, stderr or sys.stderr
        outcome = self._interruptible("session_call", payload, layout, send, receive, sink(out), sink(err), timeout)
        return codec.decode_outcome(outcome, received)

    def close(self) -> int:
        """End the session: its process goes, then its GPUs. Returns how many calls it ran. Closing again
        does nothing (and returns the same)."""
        if self._calls is None:
            self._calls = 0 if self._root._conn.closed else codec.decode_outcome(self._call("session_close"))
        return self._calls

    def _interruptible(self, name: str, *args: Any) -> bytes:
        """A call of the server that Ctrl-C interrupts on the server, not here: the interrupt is sent, then its
        answer waited for (SESSION_INTERRUPT_GRACE and a second more), then the connection closed."""
        conn = self._root._conn
        with channel.reported(self._root._connection.address, f"calling {name}"):
            reply = conn.async_request(consts.HANDLE_CALLATTR, conn.root, name, args, ())
            try:
                reply.wait()
            except KeyboardInterrupt:
                try:
                    conn.async_request(consts.HANDLE_CALLATTR, conn.root, "session_interrupt", (), ())
                    reply.set_expiry(SESSION_INTERRUPT_GRACE + 1.0)
                    reply.wait()
                except (KeyboardInterrupt, rpyc.AsyncResultTimeout):
                    stream.close_now(conn)
                raise
            return reply.value

    def _call(self, name: str, **options: Any) -> bytes:
        """`conn.root.<name>(**options)`; Ctrl-C closes the connection, which ends the session (or its wait)."""
        state = options.pop("on_state", None)
        if state is not None:
            options["on_state"] = lambda what, info: state(what, json.loads(info))
        conn = self._root._conn
        try:
            with channel.reported(self._root._connection.address, f"calling {name}"):
                return conn.sync_request(consts.HANDLE_CALLATTR, conn.root, name, (), tuple(options.items()))
        except KeyboardInterrupt:
            stream.close_now(conn)
            raise

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


def sink(out: IO[str]) -> Callable[[str], None]:
    """What a job's output is handed to: written to `out`, flushed at once."""
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write
