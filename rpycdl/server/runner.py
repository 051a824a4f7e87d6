"""Runs one callable in a job process, from the connection process: its environment, its live output, its result or
exception, timeout, cancel, and nothing of it left running afterwards.

The job process (rpycdl.server.child) is forked before its payload is needed: a connection's first job process is
forked with the connection process, before a client connects (a spare, given its payload down a pipe), from its
second job on the next as a job takes the spare (ConnectionLink.take_spare), and one as its request arrives where
none is ready (a second job). It waits there for its GPUs, which it gets through the environment before the payload
is unpickled (so before any framework is imported). Its stdout and stderr are pipes at the file-descriptor level, so
the output of any process it starts is streamed too. However it ends, its group is killed before run() returns, and
everything it started is gone once close() returns (rpycdl.server.orphans).

The payload's out-of-band buffers (rpycdl.wire) reach the job process by the fork itself: they are already in the
connection process's memory, and a job forked as they arrive gets them without a copy (so a call that has them never
goes to a spare). Its result's buffers come back through its result pipe, and the connection process hands them on
as they come (run's `on_buffers`), so a large result is never held in it."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from rpycdl.errors import LimitError
from rpycdl.scheduler import procs
from rpycdl.security import cgroups
from rpycdl.security.accounts import Account
from rpycdl.security.fence import Fence
from rpycdl.server import child, orphans
from rpycdl.server.child import write_all
from rpycdl.server.resultpipe import ResultPipe
from rpycdl.wire import bulk, codec

_READ = 1 << 20
PIPE_SIZE = 1 << 20  # Linux's default pipe-max-size: fewer wake-ups for large results
STOP_POLL = 0.25  # seconds between calls of run()'s `stop` (cancel requests, the GPU watchdog)

Streams = dict[int, tuple[codecs.IncrementalDecoder, Callable[[str], None]]]
"""The job's output pipes, each with its decoder and where its text goes."""


class Ending(str, Enum):
    """How a job process ended, as far as the runner can tell."""

    FINISHED = "finished"  # wrote an outcome (a value or the callable's exception)
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    CRASHED = "crashed"  # died without an outcome
    OVER_MEMORY = "over_memory"  # stopped by the GPU watchdog: over its share of a GPU
    ELSEWHERE = "elsewhere"  # stopped by the GPU watchdog: on a GPU it was not granted
    OVER_HOST_MEMORY = "over_host_memory"  # killed by the kernel: over its cgroup's memory limit
    OVER_OUTPUT = "over_output"  # its output directory past --max-output (jobdirs.OutputQuota)
    IDLE = "idle"  # its GPUs idle past --idle-reclaim (rpycdl.server.reclaim)


@dataclass
class Result:
    """What run() observed: how the job ended, its outcome bytes, and a readable reason."""

    ending: Ending
    outcome: bytes = b""
    reason: str = ""


class Launched(Protocol):
    """A process a Launcher started: its pid and start time, a pidfd readable once it has exited."""

    pid: int
    start: int
    pidfd: int
    usage: cgroups.Usage | None  # once it has ended: what its job's cgroup measured, if it had one

    def name_job(self, job_id: str) -> None:
        """Say which job it runs: what the job starts is known by that id too."""

    def gone(self) -> bool:
        """Once it was killed: whether it has exited and nothing of its job runs, as far as that can be told here
        without its launcher's word (False: wait() for that)."""

    def wait(self) -> int:
        """Block until it and everything its job left are gone; its wait status."""

    def close(self) -> None:
        """Let go of it (it is killed if it still runs) and of its descriptors."""


class Launcher(Protocol):
    """What starts job processes and load checks (forklink.ForkServerLink, orphans.HERE)."""

    def launch(self, kind: str, fds: list[int]) -> Launched:
        """A process of `kind` ("job" or "check") with `fds` as its descriptors, closed here.

        Raises:
            LimitError: no process could be started.
        """


def pipes(count: int) -> list[int]:
    """`count` pipes' (read, write) descriptors, flat."""
    fds: list[int] = []
    try:
        for _ in range(count):
            fds.extend(os.pipe())
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise LimitError(f"this server could not start a process for the job ({exc.strerror}); try again later") \
            from None
    return fds


def files_socket() -> tuple[socket.socket, int]:
    """The socket on which a job process gets the files of spooled buffers: ours, and its end's descriptor."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return ours, theirs.detach()


def send(fd: int, files: socket.socket, go: child.Go, buffers: Sequence[Any], close: bool = True) -> None:
    """Write `go` and its buffers down the go pipe `fd` (blocking), the files of spooled ones on `files`,
    then close both (unless not `close`: a session's next call comes the same way); a process that died
    meanwhile has its end told by its wait."""
    spooled = [index for index, buffer in enumerate(buffers) if isinstance(buffer, bulk.Spooled)]
    with contextlib.suppress(BrokenPipeError, ConnectionError):
        for index in spooled:
            socket.send_fds(files, [b"f"], [buffers[index].fd])
        write_all(fd, go.header(spooled))
        for buffer in buffers:
            if not isinstance(buffer, bulk.Spooled):
                with memoryview(buffer) as raw, raw.cast("B") as view:
                    bulk.lend_to_pipe(fd, view)
    if close:
        os.close(fd)
        files.close()


class JobProcess:
    """One job process, started before its GPUs come, so that it is ready when they do: it waits for
    what to run before it unpickles anything. give() names its payload; run() starts it and waits for its
    outcome; close() leaves nothing of it running, and must be called however the request ends (before
    its GPUs are released).

    Args:
        launcher: what starts it (the server's forkserver; a supervisor's own fork, for its first job).

    Raises:
        LimitError: the machine has no process to spare for it.
    """

    def __init__(self, launcher: Launcher) -> None:
        go_r, self._go_w, out_r, out_w, err_r, err_w, res_r, res_w = pipes(4)
        with contextlib.suppress(OSError):  # not Linux, or a lower limit: the default size works too
            fcntl.fcntl(res_w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self._files, files_theirs = files_socket()
        try:
            self._process = launcher.launch("job", [go_r, out_w, err_w, res_w, files_theirs])
        except BaseException:
            for fd in (self._go_w, out_r, err_r, res_r):
                os.close(fd)
            self._files.close()
            raise
        self._closed = self._ended = False
        self._out, self._err, self._res = out_r, err_r, res_r
        for fd in (out_r, err_r, res_r):
            os.set_blocking(fd, False)
        self._body: bytes | None = None
        self._buffers: list[Any] = []
        self._status: int | None = None

    @property
    def pid(self) -> int:
        """Its pid (its group's and session's id too). Raises LimitError if its launcher could not start it."""
        return self._process.pid

    @property
    def identity(self) -> procs.Pid:
        """Its pid and start time."""
        return self.pid, self._process.start

    @property
    def _pidfd(self) -> int:
        return -1 if self._closed else self._process.pidfd

    def give(self, body: bytes, buffers: list[Any] | None = None) -> bool:
        """Name the payload `body` and its out-of-band `buffers` (sent when it runs); False if it cannot
        take one (named already, gone, or never started)."""
        try:
            if self._body is not None or self._pidfd < 0 or select.select([self._pidfd], [], [], 0)[0]:
                return False
        except LimitError:  # its launcher could not start it: the caller starts another
            return False
        self._body, self._buffers = body, buffers or []
        return True

    def name_job(self, job_id: str) -> None:
        """Say which job it runs (its launcher knows what the job starts by that id too)."""
        self._process.name_job(job_id)

    def ended(self) -> bool:
        """Whether the process has exited (a session's, between its calls)."""
        return self._pidfd < 0 or bool(select.select([self._pidfd], [], [], 0)[0])

    def exit_status(self) -> int:  # once it has ended: its wait status, when nothing of its job runs any more
        return self._reap()

    @property
    def usage(self) -> cgroups.Usage | None:  # once it has ended (exit_status, close): what its cgroup measured
        return self._process.usage if self._status is not None else None

    def run(self, env: dict[str, str], on_stdout: Callable[[str], None], on_stderr: Callable[[str], None], *,
            account: Account | None = None, fence: Fence | None = None,
            on_start: Callable[[int], None] | None = None, on_sent: Callable[[], None] | None = None,
            timeout: float | None = None, watch_fds: Sequence[int] = (), on_watch: Callable[[], None] | None = None,
            stop: Callable[[int], tuple[Ending, str] | None] | None = None,
            on_buffers: Callable[[codec.Layout, int], int] | None = None,
            max_result: tuple[int, str] | None = None) -> Result:
        """Run the payload with `env` set, and wait for its outcome. When this returns, the job
        process's group has been sent SIGKILL and all its output forwarded.

        Args:
            env: variables set in the job process before the payload is unpickled.
            account, fence: the account it runs as (a root server's; None: its own), and its fence (or None).
            on_stdout, on_stderr: receive the job's output, as text, as it arrives.
            on_start: called with the job process id (its group id too) just before the payload
                is let go, so that whatever it records is there before the job can be seen running.
            on_sent: called once the payload is let go, before its output is followed (rpycdl.server.handover).
            timeout: seconds the job may run; past it the group is killed.
            watch_fds: other descriptors to watch (the client connection).
            on_watch: called when one is readable; may raise (client gone), which kills the job.
            stop: called with the job's pid at least every STOP_POLL seconds; returning (ending, reason)
                kills the job, which then ends that way (a cancel request, the GPU watchdog).
            on_buffers: given, a large result's buffers go out of band: once they come, the output
                printed so far has been handed on and `on_buffers(layout, fd)` must read exactly
                their total size from the blocking pipe `fd` and say how many bytes it got (fewer
                only if the pipe ended early). Timeout and `stop` wait until it returns.
            max_result: the most bytes the result may have (its buffers, or its outcome), which
                bounds the memory it takes here, and the option that sets it; a larger one ends the
                job with LimitError.
        """
        if on_start is not None:
            on_start(self.pid)
        if self._body is None:
            raise RuntimeError("a job process runs only once give() named its payload")
        buffers, self._buffers = self._buffers, []  # sent: this process lets go of their memory
        self._send(child.Go(env, account, self._body, codec.layout(buffers), on_buffers is not None, fence=fence),
                   buffers)
        if on_sent is not None:
            on_sent()
        return self._follow(on_stdout, on_stderr, timeout=timeout, watch_fds=watch_fds, on_watch=on_watch, stop=stop,
                            on_buffers=on_buffers, max_result=max_result)

    def start_session(self, env: dict[str, str], account: Account | None = None, fence: Fence | None = None) -> None:
        """Make it a session's process (its GPUs granted): it takes `env`, is fenced by `fence`, becomes `account`,
        and then runs one call() after another, keeping what each leaves in its globals, until close()."""
        self._send(child.Go(env, account, b"", session=True, fence=fence), (), keep=True)

    def call(self, body: bytes, buffers: list[Any], on_stdout: Callable[[str], None],
             on_stderr: Callable[[str], None], **follow: Any) -> Result:
        """A session's next call: the payload `body` (and its out-of-band `buffers`) run in its process; the
        options are run()'s. The process is killed unless the call ran to its outcome (its exception too)."""
        self._send(child.Go({}, None, body, codec.layout(buffers), follow.get("on_buffers") is not None, True),
                   buffers, keep=True)
        return self._follow(on_stdout, on_stderr, keep=True, **follow)

    def interrupt(self) -> None:
        """Send a session's call Ctrl-C: KeyboardInterrupt in the call, which ends it, not the session."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGINT)

    def _follow(self, on_stdout: Callable[[str], None], on_stderr: Callable[[str], None], *, keep: bool = False,
                timeout: float | None = None, watch_fds: Sequence[int] = (),
                on_watch: Callable[[], None] | None = None,
                stop: Callable[[int], tuple[Ending, str] | None] | None = None,
                on_buffers: Callable[[codec.Layout, int], int] | None = None,
                max_result: tuple[int, str] | None = None) -> Result:
        """Forward the output and read the outcome of what was sent (run's options); then kill the job's
        group, unless `keep` and the call ran to its outcome."""
        streams: Streams = {self._out: (codecs.getincrementaldecoder("utf-8")("replace"), on_stdout),
                            self._err: (codecs.getincrementaldecoder("utf-8")("replace"), on_stderr)}
        handed = self._handing(streams, on_buffers) if on_buffers is not None else None
        result = ResultPipe(self._res, handed, max_result)
        ending = None
        try:
            ending, reason = self._wait(result, streams, timeout=timeout, watch_fds=watch_fds, on_watch=on_watch,
                                        stop=stop)
        finally:
            if not (keep and ending is Ending.FINISHED and result.done and result.complete):
                procs.kill_group(self.pid)
                with contextlib.suppress(ProcessLookupError):  # in case it died before it could lead its own group
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            for fd in streams:
                _forward(fd, *streams[fd])
        if result.over:
            return Result(Ending.FINISHED, codec.encode_error(LimitError(result.over), tb=""), result.over)
        if ending is Ending.FINISHED and not result.complete:
            ending, reason = Ending.CRASHED, f"the job process {describe(self._reap())} while sending its result"
        elif ending is Ending.FINISHED and not result.done:
            ending, reason = Ending.CRASHED, f"the job process {describe(self._reap())} before returning a result"
        return Result(ending, bytes(result.outcome), reason)

    def _send(self, go: child.Go, buffers: Sequence[Any], keep: bool = False) -> None:
        """Send `go` and its buffers down the go pipe (closed after, unless `keep`: a session's)."""
        if self._go_w < 0:
            raise RuntimeError("this job process has been given what it runs already")
        send(self._go_w, self._files, go, buffers, close=not keep)
        if not keep:
            self._go_w = -1

    def _handing(self, streams: Streams,
                 on_buffers: Callable[[codec.Layout, int], int]) -> Callable[[codec.Layout], int]:
        """What reads a result's buffers: the output printed so far first, then `on_buffers` from the
        result pipe, made blocking meanwhile."""
        def hand(layout: codec.Layout) -> int:
            for fd in streams:  # what the job printed before returning goes first
                _forward(fd, *streams[fd])
            os.set_blocking(self._res, True)
            try:
                return on_buffers(layout, self._res)
            finally:
                os.set_blocking(self._res, False)

        return hand

    def _wait(self, result: ResultPipe, streams: Streams, *, timeout: float | None, watch_fds: Sequence[int],
              on_watch: Callable[[], None] | None,
              stop: Callable[[int], tuple[Ending, str] | None] | None) -> tuple[Ending, str]:
        """Forward output and read the result until the job ends, or must (run's loop)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        open_fds = [self._out, self._err, self._res]
        next_stop_check = next_reap = time.monotonic() + STOP_POLL  # a call that ends sooner reads no ledger
        ending: Ending | None = None
        reason = ""
        while ending is None:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if stop is not None:
                wait = STOP_POLL if wait is None else min(wait, STOP_POLL)
            readable, _, _ = select.select([*open_fds, self._pidfd, *watch_fds], [], [], wait)
            for fd in readable:
                if fd == self._res:
                    if not result.read():  # end of file: the outcome is complete, or never will be
                        open_fds.remove(fd)
                        ending = Ending.FINISHED
                    elif not result.complete:  # it cannot send its result any more
                        ending = Ending.FINISHED
                elif fd in streams and not _forward(fd, *streams[fd]):
                    open_fds.remove(fd)
            if self._pidfd in readable:
                if self._res in open_fds:
                    result.read()
                ending = Ending.FINISHED
            elif ending is None and on_watch is not None and set(watch_fds) & set(readable):
                on_watch()
            if time.monotonic() >= next_reap:  # what the job's programs left, adopted here: no zombie piles up
                next_reap = time.monotonic() + STOP_POLL
                procs.reap(orphans.adopted())  # a supervisor's: a forkserver reaps its own
            if ending is None and stop is not None and time.monotonic() >= next_stop_check:
                next_stop_check = time.monotonic() + STOP_POLL
                ending, reason = stop(self.pid) or (None, "")
            if ending is None and deadline is not None and time.monotonic() >= deadline:
                ending, reason = Ending.TIMED_OUT, f"the job ran past its timeout of {timeout:g} s and was stopped"
        return ending, reason

    def end(self) -> None:
        """Kill the job process and everything it started, and return once none of them runs: as soon as that is
        seen here (Launched.gone), else once its launcher says so. Its exit status and usage come with close()."""
        if self._ended:
            return
        with contextlib.suppress(LimitError):  # never started by its launcher: nothing of it runs
            procs.kill_group(self.pid)
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            if not self._process.gone():
                self._reap()
        self._ended = True

    def close(self) -> None:
        """end(), and its launcher's word on its end (its exit status and usage); then let go of its descriptors.
        Closing twice is harmless."""
        if self._closed:
            return
        self.end()
        with contextlib.suppress(LimitError):
            self._reap()
        self._closed = True
        self._process.close()
        self._files.close()
        for fd in (self._go_w, self._out, self._err, self._res):
            if fd >= 0:
                os.close(fd)

    def _reap(self) -> int:
        if self._status is None:
            self._status = self._process.wait()
        return self._status


def _read_into(fd: int, buffer: bytearray, limit: int | None = None) -> bool:
    """Read what is there (stopping once `buffer` holds more than `limit` bytes); False at end of file."""
    while limit is None or len(buffer) <= limit:
        try:
            chunk = os.read(fd, _READ)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        buffer += chunk
    return True


def _forward(fd: int, decoder: codecs.IncrementalDecoder, sink: Callable[[str], None]) -> bool:
    """Hand what the job printed to `sink`; False at end of file."""
    data = bytearray()
    more = _read_into(fd, data)
    if data:
        sink(decoder.decode(bytes(data)))
    return more


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was terminated by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"
