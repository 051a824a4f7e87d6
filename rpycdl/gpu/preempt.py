"""In a job process: its side of preemption (`rpycdl serve --preempt`). A job whose GPUs a waiting job of a higher
priority needs gets SIGTERM (its whole process group), then SIGKILL after the server's --preempt-grace: the handler
it registered with `on_preempt` runs on the SIGTERM, in the job's main thread, to save what it needs to resume from
(under --preempt requeue a detached job runs again, its output directory kept, rpycdl.attempt() one more)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from rpycdl.errors import PreemptedError

_STATE = {"preempting": False}


def preempting() -> bool:
    """Inside a job: whether it is being preempted (its SIGTERM came, once `on_preempt` was called): a loop may
    check it between steps, save, and return."""
    return _STATE["preempting"]


def on_preempt(handler: Callable[[], Any] | None = None, *, stop: bool = True) -> None:
    """Inside a job: run `handler()` when the job is preempted (SIGTERM; SIGKILL follows after the server's
    --preempt-grace), say, to save a checkpoint to rpycdl.output_dir(). Then, with `stop`, the job ends there
    (PreemptedError is raised in its main thread, where the handler ran); without, it goes on (check
    `preempting()`) until it returns or the grace ends. Call it from the job's main thread (the signal module's
    rule); calling it again replaces the handler.

    Example:
        def train(config):
            state = load(rpycdl.output_dir() / "ckpt.pt") if rpycdl.attempt() > 1 else fresh(config)
            rpycdl.on_preempt(lambda: save(state, rpycdl.output_dir() / "ckpt.pt"))
            ...
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("rpycdl.on_preempt is called from the job's main thread (it sets a signal handler)")

    def preempted(signum: int, frame: Any) -> None:
        _STATE["preempting"] = True
        if handler is not None:
            handler()
        if stop:
            raise PreemptedError("the job was preempted: a job of a higher priority needed its GPUs")

    signal.signal(signal.SIGTERM, preempted)
