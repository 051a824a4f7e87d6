"""The connection process's end of a job process's result pipe, for one call: what child._answer writes, read
as it comes without blocking (runner.JobProcess watches it with the job's output)."""

from __future__ import annotations

import os
from collections.abc import Callable

from rpycdl.server.child import COUNT, ENTRY, SIZE
from rpycdl.wire import codec

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
            if not self._read(self.header, need):
                return False
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
