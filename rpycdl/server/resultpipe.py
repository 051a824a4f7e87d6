"""The connection process's end of a job process's result pipe, for one call: what child._answer writes, read
as it comes without blocking (runner.JobProcess watches it with the job's output); and an original client's value
made from it within bounds (decode_bounded)."""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Callable
from typing import Any

from rpycdl.defaults import RESULT_DECODE_TIMEOUT, RESULT_MEMORY_FACTOR, RESULT_MEMORY_MIN
from rpycdl.errors import LimitError
from rpycdl.server.child import COUNT, ENTRY, SIZE
from rpycdl.wire import codec, untrusted

_READ = 1 << 20
"""Bytes read at a time."""


class ResultPipe:
    """The connection process's end of the result pipe, for one call: the header, then the out-of-band
    buffers (`on_buffers(layout)` reads them from the pipe and says how many bytes it got), then the
    outcome's size and the outcome. A result of more than `limit` bytes is not read: `over` then says why."""

    def __init__(self, fd: int, on_buffers: Callable[[codec.Layout], int] | None,
                 limit: tuple[int, str] | None) -> None:
        self.fd = fd
        self.header = bytearray()
        self.layout: codec.Layout | None = None
        self.size: int | None = None  # the outcome's, once read
        self.outcome = bytearray()
        self.complete = True  # False: the buffers ended early, or the header made no sense
        self.over = ""
        self._on_buffers = on_buffers
        self._limit, self._option = limit or (None, "")

    def _too_large(self, size: int) -> bool:
        if self._limit is None or size <= self._limit:
            return False
        self.over = (f"the job's result is over this server's limit of {self._limit} bytes ({self._option}): "
                     "return less, or save it to a file and return its path")
        return True

    @property
    def done(self) -> bool:
        """Whether the whole outcome has been read."""
        return self.size is not None and len(self.outcome) == self.size

    def read(self) -> bool:
        """Read what is there; False once the outcome is whole, or it never will be (end of file, too large)."""
        while self.layout is None:
            need = COUNT.size
            if len(self.header) >= COUNT.size:
                count = COUNT.unpack_from(self.header)[0]
                if count > codec.MAX_BUFFERS or (count and self._on_buffers is None):
                    self.complete = False
                    return False
                need += count * ENTRY.size
            if len(self.header) == need:
                self.layout = tuple(ENTRY.unpack_from(self.header, offset)
                                    for offset in range(COUNT.size, need, ENTRY.size))
                if self._too_large(codec.layout_bytes(self.layout)):
                    return False
                if self.layout:
                    self.complete = self._on_buffers(self.layout) == codec.layout_bytes(self.layout)  # type: ignore[misc]
                self.header.clear()
                break
            had = len(self.header)
            if not self._read(self.header, need):
                return False
            if len(self.header) == had:  # nothing more there yet (a process the job started may hold the pipe)
                return True
        if self.size is None:
            if not self._read(self.header, SIZE.size):
                return False
            if len(self.header) < SIZE.size:
                return True
            self.size = SIZE.unpack(self.header)[0]
            if self._too_large(self.size):
                return False
        if not self._read(self.outcome, self.size):
            return False
        return not self.done

    def _read(self, into: bytearray, size: int) -> bool:
        """Read into `into` up to `size` bytes of what is there; False at end of file."""
        while len(into) < size:
            try:
                chunk = os.read(self.fd, min(size - len(into), _READ))
            except BlockingIOError:
                return True
            if not chunk:
                return False
            into += chunk
        return True


def decode_bounded(data: bytes, plain: bool) -> Any:
    """The job's value (or its exception, raised) from its outcome `data`, for an original client, which gets it
    by reference from this process: made here within RESULT_DECODE_TIMEOUT seconds and RESULT_MEMORY_FACTOR times
    the outcome's size (RESULT_MEMORY_MIN at least) of new memory, whatever its pickle asks for. With `plain`
    (this process runs as another account than the job: a root server's), only plain data is unpickled
    (untrusted.outcome): nothing of the job's runs here.

    Raises:
        LimitError: it took longer, or needed more memory.
        RemoteError: `plain`, and the job raised, or returned a value that is not plain data.
    """
    def too_slow(*_: Any) -> None:
        raise LimitError(f"the job's result took longer than {RESULT_DECODE_TIMEOUT:g} s to load on the server")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    budget = mapped + max(RESULT_MEMORY_FACTOR * len(data), RESULT_MEMORY_MIN)
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, RESULT_DECODE_TIMEOUT)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (budget if hard == resource.RLIM_INFINITY else min(budget, hard), hard))
        return untrusted.outcome(data) if plain else codec.decode_outcome(data)
    except MemoryError:
        raise LimitError(f"the job's result needs more than {budget - mapped} bytes of memory to load on the server "
                         "(it returned something that grows when unpickled)") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
