"""What a person looking at a client sees while its calls wait: one line when a call starts waiting for its
GPUs (said again as its place in line, or why its owner's limits hold it back, changes), one when it starts
running, a progress bar while a download runs; where a person looks (a terminal, a Jupyter notebook), and nothing
in batch use (output to a file or a pipe, `quiet=True`, or $RPYCDL_QUIET=1)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rpycdl.client.displays import client_row
from rpycdl.defaults import QUIET_VARIABLE
from rpycdl.states import held_by, need_text

StateCallback = Callable[[str, dict[str, Any]], None]


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel's (its stderr is ipykernel's stream to the notebook)."""
    return type(sys.stderr).__module__.startswith("ipykernel")


def looking(quiet: bool | None) -> bool:
    """Whether to tell a person what a call does: `quiet` says, or (None) whether $RPYCDL_QUIET is unset and
    this process writes to a terminal or a notebook."""
    if quiet is not None:
        return not quiet
    if os.environ.get(QUIET_VARIABLE, "") not in ("", "0"):
        return False
    return in_notebook() or _is_terminal()


class Notices:
    """A call's on_state: keeps the job's id, says on stderr when the call starts waiting ('waiting for 1 GPU: 1
    job ahead; GPU 0 held by job 3f2a of alice since 10:02'), again as its place in line or why its owner's limits
    hold it back change, and, after a wait, when it starts ('running on GPU 0 after 8.1 s'), if a person looks; and
    hands the state on to the caller's own on_state, its info as the client gives rows (displays.client_row).

    Attributes:
        job_id: the job's id, once the server told it.
    """

    def __init__(self, on_state: StateCallback | None, quiet: bool | None, what: str = "job") -> None:
        self._on_state = on_state
        self._say = looking(quiet)
        self._what = what
        self._waiting_since: float | None = None
        self._waiting = ""  # the waiting line said last
        self.job_id: str | None = None

    @property
    def wanted(self) -> bool:
        """Whether the server needs to tell this call's states at all (they cost a round trip each)."""
        return self._say or self._on_state is not None

    def callback(self) -> Callable[[str, str], None] | None:
        """What the server calls as the job's state changes (its info as JSON); None where nobody listens."""
        return (lambda state, info: self(state, json.loads(info))) if self.wanted else None

    def __call__(self, state: str, info: dict[str, Any]) -> None:
        info = client_row(info)
        self.job_id = info.get("job_id", self.job_id)
        if self._say:
            self._tell(state, info)
        if self._on_state is not None:
            self._on_state(state, info)

    def _tell(self, state: str, info: dict[str, Any]) -> None:
        if state == "pending":
            line = self._waiting_line(info)
            if self._waiting_since is None:
                self._waiting_since = time.monotonic()
                say(line)
            elif line != self._waiting:  # its place in line, or why it waits, changed
                say(line, again=True)
            self._waiting = line
        elif state == "running" and self._waiting_since is not None:
            gpus = info.get("gpus") or []
            where = f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}" if gpus else "its GPUs"
            say(f"{self._what} {self.job_id} running on {where} after {time.monotonic() - self._waiting_since:.1f} s")


    def _waiting_line(self, info: dict[str, Any]) -> str:
        """'job 3f2a waiting for 1 GPU: 2 jobs ahead; GPU 0 held by job 1c0e of bob since 10:02', and why its owner's
        limits hold it back, when they do ('; held back: alice holds 4 GPUs, the limit of users.alice.gpus = 4')."""
        need = need_text(info.get("ngpus", 1), info.get("share_bytes", 0))
        ahead = info.get("ahead")
        jobs = "" if ahead is None else f": {ahead} job{'' if ahead == 1 else 's'} ahead"
        held = held_by(info.get("holders") or [])
        reason = info.get("reason")
        return (f"{self._what} {self.job_id} waiting for {need}{jobs}{'; ' + held if held else ''}"
                f"{'; held back: ' + reason if reason else ''}")


def say(line: str, again: bool = False) -> None:
    """One line for the person looking, on stderr at once; `again`: it replaces the last one said (in a terminal,
    over it; elsewhere, a notebook's stream, below it)."""
    if again and _is_terminal():
        print(f"\033[F\033[Krpycdl: {line}", file=sys.stderr, flush=True)  # the line above, cleared, written anew
        return
    print(f"rpycdl: {line}", file=sys.stderr, flush=True)


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


@contextlib.contextmanager
def progress(total: int, description: str, quiet: bool | None) -> Iterator[Callable[[int], Any]]:
    """A progress bar of `total` bytes where a person looks (tqdm.auto: a widget in Jupyter, text in a
    terminal; text in a notebook without ipywidgets); yields what to call with each count of bytes done."""
    if not looking(quiet):
        yield lambda done: None
        return
    if in_notebook() and importlib.util.find_spec("ipywidgets") is None:
        from tqdm.std import tqdm  # tqdm.auto would warn that the widget is missing, then draw this
    else:
        from tqdm.auto import tqdm
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=description) as bar:
        yield bar.update
