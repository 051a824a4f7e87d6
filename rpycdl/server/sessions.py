"""Sessions (issue 28): a job that takes its place in the queue like any other, then holds its GPUs and one
job process between calls, so that what a call leaves in the process (a model loaded, a dataset on the GPU)
is there for the next. It ends when its client closes it or goes, when it has been idle for its
idle_timeout or alive for its timeout, when it is cancelled, when its process dies, when the watchdog
stops it, or when its GPUs were idle past the server's --idle-reclaim (rpycdl.server.reclaim); a call's
exception (its Ctrl-C's too) ends the call, not the session. One row of the ledger, kind "session", counts
its calls.

SessionFlow is a job's flow (jobflow.JobFlow) cut in three: open (wait, grant, start the process), call (as
many as come), close; SessionCalls is what a connection's RPyC service offers of it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from rpycdl.defaults import SESSION_IDLE_TIMEOUT, SESSION_INTERRUPT_GRACE, SESSION_TICK
from rpycdl.errors import InvalidRequestError, JobCancelledError, RpycdlError
from rpycdl.server import jobdirs, preempting, reclaim, request, runner
from rpycdl.server.context import ServerContext
from rpycdl.server.jobcalls import refused
from rpycdl.server.jobflow import JobFlow
from rpycdl.server.outcomes import ERRORS
from rpycdl.states import JobState
from rpycdl.wire import bulk, codec

SAVE_EVERY = 1.0
"""Seconds at least between two writes of a session's row for its count of calls (its end writes it too)."""


class SessionFlow(JobFlow):
    """One session of one connection."""

    def open(self) -> None:
        """Wait in line for the GPUs, then start the session's process on them.

        Raises:
            RpycdlError: as a job that cannot wait or start does (QueueTimeoutError, JobCancelledError, ...);
                the session is over then.
        """
        record = self.record
        try:
            self.context.files.begin(record.job_id)
            self._env = jobdirs.prepare(self.context, record.job_id, self.request)
            self.job = self.link.take_spare() or runner.JobProcess(self.context.launcher)
            self.job.name_job(record.job_id)
            record.pgid, record.leader_start = self.job.identity
            self.grant = self._acquire()
            self._start_saves()
            self._save_running()
            self.job.start_session(self._environment(), self.request.account, self.fence())
        except BaseException as exc:
            record.state = JobState.CANCELLED if isinstance(exc, (JobCancelledError, EOFError)) else JobState.FAILED
            record.error, record.error_type = str(exc) or type(exc).__name__, type(exc).__name__
            self.close()
            raise
        self.opened = self._active = self._looked = time.monotonic()
        self._callbacks: tuple[Any, ...] = (None, None, None)  # receive, stdout, stderr (callbacks)
        self._saved = 0.0
        self._interrupted: float | None = None
        self._watch = self._stopper()  # between calls: a cancel, or the watchdog (one that lasts: it counts time)

    def callbacks(self, given: tuple[Any, ...], keep: Callable[..., Any]) -> tuple[Any, ...]:
        """A call's (receive, stdout, stderr): those `given`, and the session's where one is None; the session
        keeps them for its next calls. Those replaced are handed to `keep` (ConnectionLink.keep_sinks), which
        lets go of them after a reply, not during the call."""
        before = self._callbacks
        self._callbacks = tuple(old if new is None else new for new, old in zip(given, before, strict=True))
        replaced = [old for old, new in zip(before, self._callbacks, strict=True) if old is not new]
        if replaced:
            keep({}, *replaced)
        return self._callbacks

    @property
    def open_now(self) -> bool:
        return self.result is None and not self.record.state.finished

    def call(self, body: bytes, buffers: list[Any], output: request.Output, timeout: float | None) -> bytes:
        """Run one call in the session's process; its outcome (its exception's too).

        Raises:
            RpycdlError: the session ended meanwhile (timed out, cancelled, its process died, stopped by the
                watchdog, a Ctrl-C the call did not heed); the error says why.
        """
        record, job = self.record, self.job
        assert job is not None and self.open_now
        left = self._left()
        timeout = left if timeout is None else min(timeout, left) if left is not None else timeout
        record.request["calls"] = record.request.get("calls", 0) + 1
        if time.monotonic() - self._saved > SAVE_EVERY:
            self._saved = time.monotonic()
            self.context.ledger.save(record)
        self._interrupted = None
        following, self.say = self._following(output, timeout), output.stderr
        watch = following["stop"]
        following["stop"] = lambda pid: watch(pid) or self._unheeded()
        result = self._memory_stopped(job, job.call(body, buffers, output.stdout, output.stderr, **following))
        self._active = time.monotonic()
        if result.ending is runner.Ending.FINISHED:
            return result.outcome
        self._end_with(result)
        ended = self.result or result  # a preemption's (rpycdl.server.preempting) when one ended it
        raise preempting.error(record, ERRORS[result.ending])(f"session {record.job_id}: {ended.reason}")

    def interrupt(self) -> None:
        """Ctrl-C of the call under way: KeyboardInterrupt in it; if it has not stopped within
        SESSION_INTERRUPT_GRACE seconds, the session ends."""
        if self.job is not None and self._interrupted is None:
            self._interrupted = time.monotonic()
            self.job.interrupt()

    def _unheeded(self) -> tuple[runner.Ending, str] | None:
        if self._interrupted is None or time.monotonic() - self._interrupted < SESSION_INTERRUPT_GRACE:
            return None
        return (runner.Ending.CANCELLED, f"the call did not stop within {SESSION_INTERRUPT_GRACE:g} s of Ctrl-C, "
                                         "so the session was ended")

    def _left(self) -> float | None:
        """Seconds left of the session's timeout (None: no timeout)."""
        timeout = self.request.timeout
        return None if timeout is None else max(0.001, timeout - (time.monotonic() - self.opened))

    def tick(self) -> float:
        """Between calls, every SESSION_TICK seconds (a connection serves a request at a time, and asks after
        each): end the session if its process died, it was cancelled, it was idle for its idle_timeout or
        alive for its timeout, or the watchdog stops it. Returns seconds until the next look."""
        job, now = self.job, time.monotonic()
        assert job is not None
        if now - self._looked < SESSION_TICK:  # a call just ran: a look (a ledger read, NVML's) waits its time
            return SESSION_TICK - (now - self._looked)
        self._looked = now
        idle = self.request.idle_timeout or SESSION_IDLE_TIMEOUT
        why: tuple[runner.Ending, str] | None = None
        if job.ended():
            why = (runner.Ending.CRASHED, f"the session's process {runner.describe(job.exit_status())}")
        elif now - self._active > idle:
            why = (runner.Ending.TIMED_OUT, f"the session had no call for {idle:g} s (idle_timeout) and was closed")
        elif self._left() is not None and now - self.opened >= self.request.timeout:  # type: ignore[operator]
            why = (runner.Ending.TIMED_OUT, f"the session ran past its timeout of {self.request.timeout:g} s")
        else:
            self.say = reclaim.later(self._callbacks[2])  # its client may be waiting on its user
            why = self._watch(job.pid)
        if why is not None:
            self._end_with(runner.Result(*why[:1], reason=why[1]))
        return SESSION_TICK

    def close(self, reason: str = "") -> None:
        """End the session: its process and what it started go, then its GPUs; its row says how it ended
        (SUCCEEDED, for a session closed by its client)."""
        if self.result is None and not self.record.state.finished:
            self.result = runner.Result(runner.Ending.FINISHED, codec.encode_ok(self.record.request.get("calls", 0)))
        if reason and not self.record.state.finished:
            self.record.state, self.record.error, self.record.error_type = (JobState.CANCELLED, reason,
                                                                           JobCancelledError.__name__)
        self.record.ended = time.time()
        self._end()

    def _end_with(self, result: runner.Result) -> None:
        self.result = result
        self.close()


class SessionCalls:
    """The session calls of a connection's RPyC service (GPUService): one session at a time, which keeps
    the connection busy (no other job on it) until it ends."""

    context: ServerContext
    _session: SessionFlow | None = None
    _busy: bool
    _conn: Any
    _ended: Callable[[], None]
    _request: Callable[..., request.JobRequest]
    keep_sinks: Callable[..., dict[str, Any]]  # ConnectionLink's

    def exposed_session_open(self, *args: Any, **kwargs: Any) -> bytes:
        """Open a session (request.SESSION_OPTIONS, positionally or by name): it waits in line for its GPUs,
        then holds them and one process. Returns outcome bytes: {"job_id", "gpus", "uuids"} once it holds them."""
        def open_() -> dict[str, Any]:
            if self._busy:
                raise InvalidRequestError("this connection is already running a job or a session: use one "
                                          "connection per concurrent job (rpycdl.connect() again)")
            options = request.named(request.SESSION_OPTIONS, args, kwargs)
            idle = request.check_seconds(options.pop("idle_timeout", None), "idle_timeout")
            checked = dataclasses.replace(self._request(options, output=request.output(options)), session=True,
                                          idle_timeout=idle)
            self._busy = True
            flow = SessionFlow(self.context, checked, self, on_end=self._session_ended)  # type: ignore[arg-type]
            flow.open()
            self._session = flow
            return {"job_id": flow.record.job_id, "uuids": list(flow.grant.uuids)}  # type: ignore[union-attr]

        return self._answer(open_)

    def exposed_session_call(self, payload: bytes, layout: Any, send: Callable[[], None] | None,
                             receive: Callable[[Any], None] | None, *args: Any, **kwargs: Any) -> bytes:
        """Run a call in the open session (as run_buffers runs a job); request.SESSION_CALL_OPTIONS after the
        client's callbacks. Its result's receiver and its output's sinks (stdout, stderr) are the session's
        from the call that gives them on: a call that gives None for one uses the one given last, so that an
        rpycdl client sends them once (RPyC passes each by reference: a proxy made and looked up each call).
        Returns outcome bytes."""
        try:
            session = self._open_session()
            options = request.named(request.SESSION_CALL_OPTIONS, args, kwargs)
            receive, options["stdout"], options["stderr"] = session.callbacks(
                (receive, options.get("stdout"), options.get("stderr")), self.keep_sinks)
            layout = codec.check_layout(layout)
            request.check_size(payload, "payload", self.context.limits.max_payload, codec.layout_bytes(layout))
            body = codec.check_payload(payload, len(layout))
            timeout = request.check_seconds(options.pop("timeout", None), "timeout")
            if layout and send is None:
                raise InvalidRequestError("a payload with out-of-band buffers needs the client's send callback")
            buffers = bulk.pull(self._conn, send, layout, self.context.state_dir) if layout else []  # type: ignore[arg-type]
            return session.call(body, buffers, request.output(options, receive), timeout)
        except RpycdlError as exc:
            return codec.encode_error(refused(self.context, exc), tb="")

    def exposed_session_interrupt(self) -> None:
        """Ctrl-C of the open session's call under way (sent by the client while that call waits)."""
        if self._session is not None and self._session.open_now:
            self._session.interrupt()

    def exposed_session_close(self) -> bytes:
        """End the open session; outcome bytes: how many calls it ran."""
        def close() -> int:
            session = self._open_session()
            session.close()
            return session.record.request.get("calls", 0)

        return self._answer(close)

    def tick(self) -> float:
        """Look at the open session between calls (SessionFlow.tick); seconds until the next look."""
        if self._session is None or not self._session.open_now:
            return 1.0
        return self._session.tick()

    def end_session(self, reason: str) -> None:
        """End the open session, if any (its client went)."""
        if self._session is not None and self._session.open_now:
            self._session.close(reason)

    def _open_session(self) -> SessionFlow:
        session = self._session
        if session is None or not session.open_now:
            reclaimed = reclaim.ended_error(session.record) if session else None
            if reclaimed:
                raise reclaimed
            why = f": it ended ({session.record.state.value}: {session.record.error})" if session else ""
            kind = InvalidRequestError if session is None else preempting.error(session.record, InvalidRequestError)
            raise kind(f"this connection has no open session{why}; open one with conn.root.session()")
        return session

    def _session_ended(self) -> None:
        self._ended()

    def _answer(self, make: Callable[[], Any]) -> bytes:
        try:
            return codec.encode_data(make())
        except RpycdlError as exc:
            return codec.encode_error(refused(self.context, exc), tb="")

