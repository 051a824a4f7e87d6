"""A waiting request's payload test-loaded (LoadCheck), by the launcher of its job processes (rpycdl.server.runner)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import procs
from rpycdl.server import child, runner


class LoadCheck:
    """Unpickles a payload in a throwaway process, as its owner, while its request waits for GPUs, so a
    callable this server cannot load (a module it lacks) fails at once rather than after the wait.

    The process sees no GPU (CUDA_VISIBLE_DEVICES is empty). `fd` becomes readable when it is done; then
    `error()` says what went wrong, if anything."""

    def __init__(self, launcher: runner.Launcher, go: child.Go, buffers: Sequence[Any] = ()) -> None:
        go_r, go_w, read_end, write_end = runner.pipes(2)
        files, files_theirs = runner.files_socket()
        try:
            self._process = launcher.launch("check", [go_r, write_end, files_theirs])
        except BaseException:
            for fd in (go_w, read_end):
                os.close(fd)
            files.close()
            raise
        self.fd = read_end
        runner.send(go_w, files, go, buffers)

    def error(self) -> InvalidRequestError | None:
        """Once `fd` is readable: why the payload cannot be loaded here (cannot_load), or None if it can."""
        os.set_blocking(self.fd, True)
        message = os.read(self.fd, 4096).decode(errors="replace")
        return InvalidRequestError(message) if message else None

    def close(self) -> None:
        """Stop the check (if still running) and release what it holds."""
        with contextlib.suppress(LimitError):  # never started by its launcher: nothing of it runs
            procs.kill_group(self._process.pid)
        self._process.wait()
        self._process.close()
        os.close(self.fd)
