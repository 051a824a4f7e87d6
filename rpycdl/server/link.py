"""What a job's flow needs of the client connection it runs for (jobflow.Link), as the RPyC service of that
connection provides it: the client's socket, serving the client while the job runs, large results beside
RPyC, the connection's spare job process (one ready for the next job, started as each job from the second on
takes one), and the end of a job left for after its reply."""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable
from typing import Any

import rpyc

from rpycdl.errors import LimitError
from rpycdl.server import runner
from rpycdl.server.context import ServerContext
from rpycdl.wire import bulk, codec


class ConnectionLink:
    """jobflow.Link for GPUService: its `_conn`, `_spare`, `_taken`, `_busy` and `_after_reply` are the service's."""

    context: ServerContext
    _conn: rpyc.Connection
    _spare: runner.JobProcess | None
    _taken: int  # job processes its jobs took so far (take_spare)
    _busy: bool
    _after_reply: list[Callable[[], None]]
    _sinks: list[tuple[Any, ...]]
    end_session: Callable[[str], None]  # SessionCalls'

    def socket_fds(self) -> list[int]:
        try:
            return [self._conn.fileno()]
        except Exception:
            return []

    def serve_client(self) -> None:
        fds = self.socket_fds()
        if not fds:
            raise EOFError("client connection closed")
        while select.select(fds, [], [], 0)[0]:
            self._conn.serve(0)

    def push(self, receive: Callable[[Any], None], layout: codec.Layout, fd: int) -> int:
        return bulk.push(self._conn, receive, layout, fd)

    def keep_sinks(self, options: dict[str, Any], *callbacks: Any) -> dict[str, Any]:
        """`options`, whose client's output sinks (stdout, stderr), and its other `callbacks` (a result's receiver),
        are kept until the reply to the connection's next call: an rpycdl client sends the same ones each call
        (rpycdl.client.session.sink, Receiver), so RPyC finds their proxies here instead of dropping them after
        each call, which costs a request to the client and its reply each. Those of the call before are let go
        of after the reply (after_reply), not during a call, which they would slow down (that request, or its
        reply, may well come around a call's buffers: bulk frames keep it out of their bytes, wire.bulk)."""
        self._sinks.append((options.get("stdout"), options.get("stderr"), *callbacks))
        return options

    def take_spare(self) -> runner.JobProcess | None:
        """The spare job process, if one is ready. From a connection's second job on, the next job's is asked for
        now, while the client waits for this one (a core is free); not for its first, so that a connection that
        runs one job and closes (the usual round trip) has no spare forked only to be killed at its close."""
        spare, self._spare = self._spare, None
        self._taken += 1
        if self._taken > 1:
            self._new_spare()
        return spare

    def defer(self, end: Callable[[], None]) -> None:
        self._after_reply.append(end)

    def keep(self, outcome: bytes) -> None:
        return None  # an attached job's outcome goes to its client only

    def after_reply(self) -> None:
        """Finish what the last call left for after its reply (the end of its job: jobflow). The
        server calls this once each request is answered, and when the client has gone."""
        del self._sinks[:-1]  # the last call's stay (keep_sinks); the others go now, as the reply did
        while self._after_reply:
            self._after_reply.pop(0)()

    def _ended(self) -> None:
        """A job of this connection ended: from its second job on, if no spare is ready (the forkserver had
        none to give as the job took its process), the next one's process is started now, while the client
        reads the reply."""
        self._busy = False
        if self._spare is None and self._taken > 1:
            self._new_spare()

    def _new_spare(self) -> None:
        """Ask the forkserver for the next job's process (its reply is read when a job takes it)."""
        with contextlib.suppress(LimitError):  # none to spare: the next job starts one as its request comes
            self._spare = runner.JobProcess(self.context.launcher)

    def on_disconnect(self, conn: rpyc.Connection) -> None:
        self.end_session("its client went away")
        if self._spare is not None:
            self._spare.close()
            self._spare = None

