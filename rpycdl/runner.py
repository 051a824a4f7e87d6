"""Runs one callable in a job process: environment, live output, result or exception, timeout, cancel.

The job process is forked from the connection process before its payload is needed: a
connection's first job process is forked with the connection process, before a client
connects (a spare, given its payload down a pipe), and any other as its request arrives. It
waits there for its GPUs. It leads its own process group, dies with its parent (PR_SET_PDEATHSIG),
gets its GPUs through the environment before the payload is unpickled (so before any framework
is imported), and writes its outcome to a pipe, which it then closes. Its stdout and stderr are
pipes at the file-descriptor level, so the output of any process it starts is streamed too.
However it ends, the whole group is killed before run() returns, and gone once close() returns.

The payload's out-of-band buffers (rpycdl.wire) reach the job process by the fork itself: they
are already in the connection process's memory, and a job forked as they arrive gets them
without a copy (so a call that has them never goes to a spare). Its
result pipe carries a header (how many out-of-band buffers, then the size and read-only flag of
each), the buffers (lent to the pipe by reference, transport.lend_to_pipe), then the outcome
bytes until the end; the connection process hands the buffers on as they come (run's
`on_buffers`), so a large result is never held in it.
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import select
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rpycdl import caps, procs, transport, wire
from rpycdl.defaults import KILL_WAIT
from rpycdl.errors import InvalidRequestError, LimitError

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_READ = 1 << 20
PIPE_SIZE = 1 << 20  # Linux's default pipe-max-size: fewer wake-ups for large results
STOP_POLL = 0.25  # seconds between calls of run()'s `stop` (cancel requests, the memory watchdog)
_GO = struct.Struct("<I?")  # go pipe header: length of the environment's JSON, out-of-band results
_COUNT = struct.Struct("<I")  # result pipe header: how many out-of-band buffers,
_ENTRY = struct.Struct("<Q?")  # then the size and read-only flag of each

_OWN: set[int] = set()
"""The job processes and load checks this process forked and has not reaped yet; any other
child it has was adopted (see _strays)."""

log = logging.getLogger("rpycdl.runner")


def _forked() -> None:
    """In a forked child: nothing is its own yet, and it is not a subreaper (prctl is not inherited)."""
    global _subreaper
    _OWN.clear()
    _subreaper = False


_subreaper = False
os.register_at_fork(after_in_child=_forked)


def adopt_orphans() -> None:
    """Make this process a child subreaper (once): what a job process leaves when it ends, however
    deep, becomes this process's child instead of init's, so close() finds and kills all of it."""
    global _subreaper
    if not _subreaper:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _subreaper = True


class Ending(str, Enum):
    """How a job process ended, as far as the runner can tell."""

    FINISHED = "finished"  # wrote an outcome (a value or the callable's exception)
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    CRASHED = "crashed"  # died without an outcome
    OVER_MEMORY = "over_memory"  # stopped by the memory watchdog


@dataclass
class Result:
    """What run() observed: how the job ended, its outcome bytes, and a readable reason."""

    ending: Ending
    outcome: bytes = b""
    reason: str = ""


def gpu_environment(indices: Sequence[int], uuids: Sequence[str]) -> dict[str, str]:
    """The variables that make exactly the granted GPUs visible, CUDA counting as NVML does."""
    index_list = ",".join(str(i) for i in indices)
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": index_list,
        "NV_GPU": index_list,
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
        "RPYCDL_GPU_UUIDS": ",".join(uuids),
    }


def die_with_parent(parent: int, die: bool = True) -> None:
    """Have the kernel SIGKILL this process when `parent`, its parent, exits (PR_SET_PDEATHSIG);
    exit now if it has already. With `die` False, undo that: this process outlives its parent."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL if die else 0)  # not Linux: the parent's sweep still cleans up
    if die and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def name_process(name: str) -> None:
    """Name this process as `ps` and /proc/PID/comm show it (15 bytes at most): rpycdl-server,
    rpycdl-spare, rpycdl-conn, rpycdl-job."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def _prctl(option: int, value: Any) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def _child(body: bytes | None, buffers: Sequence[Any], go_r: int, out_w: int, err_w: int, res_w: int,
           parent: int) -> None:
    """Body of the job process: waits for its environment (and, in a spare, its payload `body`)
    on `go_r`, then runs the payload. Never returns."""
    try:
        os.setsid()  # its own session and process group: procs finds what it starts by them
        die_with_parent(parent)
        name_process("rpycdl-job")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        with os.fdopen(go_r, "rb") as go:
            message = go.read()
        if not message:  # closed before its GPUs came: nothing to run
            os._exit(0)
        size, out_of_band = _GO.unpack_from(message)
        os.environ.update(json.loads(message[_GO.size:_GO.size + size]))
        body = body or message[_GO.size + size:]
        caps.install_caps()
        try:
            fn, args = wire.load_call(body, buffers)
        except BaseException as exc:  # noqa: BLE001 - told as what it is: a request this server cannot run
            fn, args = None, None
            outcome, result = wire.encode_error(cannot_load(exc), "".join(traceback.format_exception(exc))), []
        if fn is not None:
            try:
                outcome, result = wire.encode_value(fn(args), out_of_band)
            except BaseException as exc:  # noqa: BLE001 - the job's exception is its outcome
                outcome, result = wire.encode_error(exc, "".join(traceback.format_exception(exc))), []
        sys.stdout.flush()
        sys.stderr.flush()
        layout = wire.layout(result)
        _write(res_w, _COUNT.pack(len(layout)) + b"".join(_ENTRY.pack(*entry) for entry in layout))
        for buffer in result:
            with buffer.raw() as view:
                transport.lend_to_pipe(res_w, view)
        _write(res_w, outcome)
        os.close(res_w)  # end of file tells the parent the outcome is complete
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        os._exit(2)
    os._exit(0)


def _write(fd: int, data: Any) -> None:
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])


class _ResultPipe:
    """The connection process's end of the result pipe: the header, then the out-of-band buffers
    (`on_buffers(layout)` reads them from the pipe and says how many bytes it got), then the outcome.
    A result of more than `limit` bytes is not read: `over` then says why."""

    def __init__(self, fd: int, on_buffers: Callable[[wire.Layout], int] | None, limit: int | None) -> None:
        self.fd = fd
        self.header = bytearray()
        self.layout: wire.Layout | None = None
        self.outcome = bytearray()
        self.complete = True  # False: the buffers ended early, or the header made no sense
        self.over = ""
        self._on_buffers = on_buffers
        self._limit = limit

    def _too_large(self, size: int) -> bool:
        if self._limit is None or size <= self._limit:
            return False
        self.over = (f"the job's result is over this server's limit of {self._limit} bytes (--max-payload): "
                     "return less, or save it to a file and return its path")
        return True

    def read(self) -> bool:
        """Read what is there; False at end of file."""
        while self.layout is None:
            need = _COUNT.size
            if len(self.header) >= _COUNT.size:
                count = _COUNT.unpack_from(self.header)[0]
                if count > wire.MAX_BUFFERS or (count and self._on_buffers is None):
                    self.complete = False
                    return False
                need += count * _ENTRY.size
            if len(self.header) == need:
                self.layout = tuple(_ENTRY.unpack_from(self.header, offset)
                                    for offset in range(_COUNT.size, need, _ENTRY.size))
                if self._too_large(wire.layout_bytes(self.layout)):
                    return False
                if self.layout:
                    self.complete = self._on_buffers(self.layout) == wire.layout_bytes(self.layout)  # type: ignore[misc]
                break
            try:
                chunk = os.read(self.fd, need - len(self.header))
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.header += chunk
        more = _read_into(self.fd, self.outcome, self._limit)
        return more and not self._too_large(len(self.outcome))


def cannot_load(exc: BaseException) -> InvalidRequestError:
    """What a client is told of a callable this server cannot unpickle (a module it lacks), the
    same whether its request found out while waiting (LoadCheck) or as its job started."""
    if isinstance(exc, InvalidRequestError):
        return exc
    return InvalidRequestError(f"the callable cannot be loaded on this server: {type(exc).__name__}: {exc}")


def _fork(what: str, pipes: Sequence[int]) -> int:
    """os.fork(); if the machine has no process or memory to spare, the `pipes` made for the child
    are closed and LimitError names `what` the process was for."""
    try:
        return os.fork()
    except OSError as exc:
        for fd in pipes:
            os.close(fd)
        raise LimitError(f"this server could not start a process for {what} ({exc.strerror or exc}); try again "
                         "later or use another server") from exc


class LoadCheck:
    """Unpickles a payload in a throwaway process while its request waits for GPUs, so a callable
    this server cannot load (a module it lacks) fails at once rather than after the wait.

    The process sees no GPU (CUDA_VISIBLE_DEVICES is empty) and dies with its parent. `fd`
    becomes readable when it is done; then `error()` says what went wrong, if anything."""

    def __init__(self, body: bytes, buffers: Sequence[Any] = ()) -> None:
        read_end, write_end = os.pipe()
        parent = os.getpid()
        self.pid = _fork("a load check", (read_end, write_end))
        if self.pid == 0:
            os.close(read_end)
            message = b""
            try:
                os.setpgid(0, 0)
                die_with_parent(parent)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.environ["CUDA_VISIBLE_DEVICES"] = ""
                wire.load_call(body, buffers)
            except BaseException as exc:  # noqa: BLE001 - what failed is the answer
                message = str(cannot_load(exc)).encode(errors="replace")
            os.write(write_end, message[:4096])
            os._exit(0)
        _OWN.add(self.pid)
        os.close(write_end)
        self.fd = read_end

    def error(self) -> InvalidRequestError | None:
        """Once `fd` is readable: why the payload cannot be loaded here (cannot_load), or None if it can."""
        os.set_blocking(self.fd, True)
        message = os.read(self.fd, 4096).decode(errors="replace")
        return InvalidRequestError(message) if message else None

    def close(self) -> None:
        """Stop the check (if still running) and release what it holds."""
        procs.kill_group(self.pid)
        _reap(self.pid)
        os.close(self.fd)


class JobProcess:
    """One job process, forked before its GPUs come, so that it is ready when they do: it waits
    for its environment before it unpickles anything. Either it is forked with the payload `body`
    and its out-of-band `buffers` in its memory, as the request arrives; or it is a spare, forked
    before there is a request (no `body`), and give() names its payload. run() starts it and
    waits for its outcome; close() leaves nothing of it running, and must be called however the
    request ends (before its GPUs are released).

    Args:
        body: a payload body accepted by wire.check_payload; None for a spare.
        buffers: its out-of-band buffers. The job process gets them by the fork (shared until
            written); run() empties the list, so this process lets go of their memory once the
            job no longer waits (a LoadCheck may need them while it does).
        close_fds: descriptors of this process the job process must not keep (a spare's
            connection process still has the server's listening socket).

    Raises:
        LimitError: the machine has no process to spare for it.
    """

    def __init__(self, body: bytes | None = None, buffers: list[Any] | None = None,
                 close_fds: Sequence[int] = ()) -> None:
        go_r, self._go_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        res_r, res_w = os.pipe()
        with contextlib.suppress(OSError):  # not Linux, or a lower limit: the default size works too
            fcntl.fcntl(res_w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        parent = os.getpid()
        adopt_orphans()
        self.pid = _fork("the job", (go_r, self._go_w, out_r, out_w, err_r, err_w, res_r, res_w))
        if self.pid == 0:
            for fd in (self._go_w, out_r, err_r, res_r, *close_fds):
                os.close(fd)
            _child(body, buffers or (), go_r, out_w, err_w, res_w, parent)
        self._buffers = buffers
        self._body = b""  # a spare's payload, sent down the go pipe by run()
        self._spare = body is None
        _OWN.add(self.pid)
        self.identity = procs.identify(self.pid)
        for fd in (go_r, out_w, err_w, res_w):
            os.close(fd)
        self._pidfd = os.pidfd_open(self.pid)
        self._out, self._err, self._res = out_r, err_r, res_r
        for fd in (out_r, err_r, res_r):
            os.set_blocking(fd, False)
        self._status: int | None = None

    def give(self, body: bytes) -> bool:
        """Make a spare run the payload `body`; False if it cannot (not a spare, used, or gone)."""
        if not self._spare or self._body or self._pidfd < 0 or select.select([self._pidfd], [], [], 0)[0]:
            return False
        self._body = body
        return True

    def run(
        self,
        env: dict[str, str],
        on_stdout: Callable[[str], None],
        on_stderr: Callable[[str], None],
        on_start: Callable[[int], None] | None = None,
        timeout: float | None = None,
        watch_fds: Sequence[int] = (),
        on_watch: Callable[[], None] | None = None,
        stop: Callable[[int], tuple[Ending, str] | None] | None = None,
        on_buffers: Callable[[wire.Layout, int], int] | None = None,
        max_result: int | None = None,
    ) -> Result:
        """Run the payload with `env` set, and wait for its outcome. When this returns, the job
        process's group has been sent SIGKILL and all its output forwarded.

        Args:
            env: variables set in the job process before the payload is unpickled.
            on_stdout, on_stderr: receive the job's output, as text, as it arrives.
            on_start: called with the job process id (its group id too) once it runs.
            timeout: seconds the job may run; past it the group is killed.
            watch_fds: other descriptors to watch (the client connection).
            on_watch: called when one is readable; may raise (client gone), which kills the job.
            stop: called with the job's pid at least every STOP_POLL seconds; returning (ending, reason)
                kills the job, which then ends that way (a cancel request, the memory watchdog).
            on_buffers: given, a large result's buffers go out of band: once they come, the output
                printed so far has been handed on and `on_buffers(layout, fd)` must read exactly
                their total size from the blocking pipe `fd` and say how many bytes it got (fewer
                only if the pipe ended early). Timeout and `stop` wait until it returns.
            max_result: the most bytes the result may have (its buffers, or its outcome), which
                bounds the memory it takes here; a larger one ends the job with LimitError.
        """
        if self._buffers:
            self._buffers.clear()
        if self._spare and not self._body:
            raise RuntimeError("a spare job process runs only once give() named its payload")
        environment = json.dumps(env).encode()
        with contextlib.suppress(BrokenPipeError):  # it died: the wait below reports how
            _write(self._go_w, _GO.pack(len(environment), on_buffers is not None) + environment)
            _write(self._go_w, self._body)
        self._body = b""
        os.close(self._go_w)
        self._go_w = -1
        pid, pidfd = self.pid, self._pidfd
        streams = {self._out: (codecs.getincrementaldecoder("utf-8")("replace"), on_stdout),
                   self._err: (codecs.getincrementaldecoder("utf-8")("replace"), on_stderr)}

        def stream(layout: wire.Layout) -> int:
            for fd in streams:  # what the job printed before returning goes first
                _forward(fd, *streams[fd])
            os.set_blocking(self._res, True)
            try:
                return on_buffers(layout, self._res)  # type: ignore[misc]
            finally:
                os.set_blocking(self._res, False)

        result = _ResultPipe(self._res, stream if on_buffers is not None else None, max_result)
        deadline = None if timeout is None else time.monotonic() + timeout
        ending: Ending | None = None
        reason = ""
        try:
            if on_start is not None:
                on_start(pid)
            open_fds = [self._out, self._err, self._res]
            next_stop_check = 0.0
            while ending is None:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if stop is not None:
                    wait = STOP_POLL if wait is None else min(wait, STOP_POLL)
                readable, _, _ = select.select([*open_fds, pidfd, *watch_fds], [], [], wait)
                for fd in readable:
                    if fd == self._res:
                        if not result.read():  # end of file: the outcome is complete, or never will be
                            open_fds.remove(fd)
                            ending = Ending.FINISHED
                        elif not result.complete:  # it cannot send its result any more
                            ending = Ending.FINISHED
                    elif fd in streams:
                        if not _forward(fd, *streams[fd]):
                            open_fds.remove(fd)
                if pidfd in readable:
                    if self._res in open_fds:
                        result.read()
                    ending = Ending.FINISHED
                elif ending is None and watch_fds and on_watch is not None and set(watch_fds) & set(readable):
                    on_watch()
                if ending is None and stop is not None and time.monotonic() >= next_stop_check:
                    next_stop_check = time.monotonic() + STOP_POLL
                    procs.reap(_adopted())  # what the job's programs left, adopted here: no zombie piles up
                    ending, reason = stop(pid) or (None, "")
                if ending is None and deadline is not None and time.monotonic() >= deadline:
                    ending, reason = Ending.TIMED_OUT, f"the job ran past its timeout of {timeout:g} s and was stopped"
        finally:
            procs.kill_group(pid)
            procs.kill([pid])  # in case it died before it could lead its own group
            for fd in streams:
                _forward(fd, *streams[fd])
        if result.over:
            return Result(Ending.FINISHED, wire.encode_error(LimitError(result.over), tb=""), result.over)
        if ending is Ending.FINISHED and not result.complete:
            ending, reason = Ending.CRASHED, f"the job process {_describe(self._reap())} while sending its result"
        elif ending is Ending.FINISHED and not result.outcome:
            ending, reason = Ending.CRASHED, f"the job process {_describe(self._reap())} before returning a result"
        return Result(ending, bytes(result.outcome), reason)

    def close(self) -> None:
        """Kill the job process and everything it started, and wait until none of them runs (they
        are this process's own descendants, or adopted by it: see _strays). Closing twice is harmless."""
        if self._pidfd < 0:
            return
        procs.kill_group(self.pid)
        procs.kill([self.pid])
        self._reap()
        _kill_strays()
        for fd in (self._go_w, self._out, self._err, self._res, self._pidfd):
            if fd >= 0:
                os.close(fd)
        self._pidfd = -1

    def _reap(self) -> int:
        if self._status is None:
            self._status = _reap(self.pid)
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


def _reap(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return 0
    finally:
        _OWN.discard(pid)
    return status


def _adopted() -> list[int]:
    """Children of this process that it did not fork itself: what ended job processes left, adopted
    by this process (a child subreaper)."""
    return [pid for pid in procs.children(os.getpid()) if pid not in _OWN]


def _strays() -> list[int]:
    """The adopted processes and everything they started in turn."""
    adopted = _adopted()
    return adopted + [pid for stray in adopted for pid in procs.subtree(stray)]


def _kill_strays() -> None:
    """SIGKILL what the ended jobs of this process left running, until none of it runs. A process
    that cannot be killed (another user's, or stuck in the kernel) is waited for, however long:
    its GPUs are not free while it runs."""
    def running() -> list[int]:
        return [pid for pid in _strays() if procs.alive(pid)]

    def reap() -> None:
        procs.reap(_adopted())

    while not procs.kill_until_gone(running, KILL_WAIT, reap):
        log.warning("processes left by a job still run after SIGKILL: %s", running())
    reap()


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was terminated by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"
