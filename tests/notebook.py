"""A Jupyter notebook for the tests: a real ipykernel, driven by nbclient as Jupyter drives one, whose cells are
run one at a time; each cell's messages are kept with the moment each arrived here, and a cell can be watched
while it runs (to interrupt its kernel, as Kernel > Interrupt does, or to act on what it printed)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import nbformat
from nbclient import NotebookClient

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class Message:
    """An output message of a cell, with the moment (time.time()) it arrived here."""

    at: float
    kind: str  # stream, display_data, execute_result, error, update_display_data
    content: dict[str, Any]

    @property
    def text(self) -> str:
        """A stream's text, or a result's or display's text/plain."""
        return self.content.get("text") or self.content.get("data", {}).get("text/plain", "")


@dataclass
class Cell:
    """What a cell did: its messages in order, and when it started and ended (time.time())."""

    source: str
    started: float = 0.0
    ended: float = 0.0
    messages: list[Message] = field(default_factory=list)

    def stream(self, name: str = "stdout") -> str:
        """All it printed on `name`."""
        return "".join(m.content["text"] for m in self.messages if m.kind == "stream" and m.content["name"] == name)

    @property
    def result(self) -> str:
        """Its value's text/plain ('' without one)."""
        return next((m.text for m in self.messages if m.kind == "execute_result"), "")

    def data(self, mime: str) -> list[Any]:
        """What its results and displays gave as `mime`."""
        return [m.content["data"][mime] for m in self.messages
                if m.kind in ("execute_result", "display_data") and mime in m.content.get("data", {})]

    @property
    def error(self) -> tuple[str, str, str]:
        """Its error: (name, value, the traceback as shown, colours left out); fails the test if it had none."""
        errors = [m.content for m in self.messages if m.kind == "error"]
        assert errors, f"the cell raised nothing: {self.messages}"
        return errors[0]["ename"], errors[0]["evalue"], ANSI.sub("", "\n".join(errors[0]["traceback"]))

    def first(self, pattern: str) -> Message:
        """The first message whose text matches `pattern`; fails the test if none does."""
        found = next((m for m in self.messages if re.search(pattern, m.text)), None)
        assert found is not None, f"no output matched {pattern!r}: {[m.text for m in self.messages]}"
        return found


class _Client(NotebookClient):
    """nbclient's client, keeping each output message of the running cell with when it arrived."""

    running: Cell | None = None

    def output(self, outs: list[Any], msg: dict[str, Any], display_id: str | None, cell_index: int) -> Any:
        if self.running is not None:
            self.running.messages.append(Message(time.time(), msg["msg_type"], msg["content"]))
        return super().output(outs, msg, display_id, cell_index)


class Notebook:
    """A kernel started in `cwd` (the notebook's directory); run() runs a cell in it."""

    def __init__(self, cwd: str, timeout: float = 120) -> None:
        self.nb = nbformat.v4.new_notebook()
        self.client = _Client(self.nb, kernel_name="python3", timeout=timeout, allow_errors=True,
                              resources={"metadata": {"path": cwd}})

    @contextmanager
    def started(self) -> Iterator[Notebook]:
        with self.client.setup_kernel():
            yield self

    def run(self, source: str, watch: Callable[[Cell], bool] | None = None, watch_for: float = 60) -> Cell:
        """Run a cell to its end. With `watch`, a thread calls watch(cell) as its messages come (every 20 ms)
        until it returns True, or for `watch_for` seconds."""
        cell = Cell(source)
        node = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(node)
        self.client.running = cell
        done = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(cell, watch, done, watch_for), daemon=True)
        cell.started = time.time()
        if watch is not None:
            watcher.start()
        try:
            self.client.execute_cell(node, len(self.nb.cells) - 1)
        finally:
            cell.ended = time.time()
            done.set()
            self.client.running = None
        if watch is not None:
            watcher.join(10)
        return cell

    def _watch(self, cell: Cell, watch: Callable[[Cell], bool], done: threading.Event, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not done.is_set() and time.monotonic() < deadline:
            if watch(cell):
                return
            time.sleep(0.02)

    def interrupt(self) -> None:
        """Kernel > Interrupt: SIGINT to the kernel (nbclient's kernel manager), from any thread."""
        asyncio.run(self.client.km.interrupt_kernel())
