"""A remote exception's traceback, end to end: the source lines of the client's own functions (those of its
`__main__`: a script, a notebook's cells, which dill sends as code, not source) go with a call
(`client_sources`), and the job process puts them in linecache (`remember`), so that the traceback it
formats shows them; that traceback keeps the job's own frames only (`formatted`: not rpycdl's, dill's or the
import machinery's); and the client raises the exception with those remote frames as frames of its own
traceback (`remote_frames`), so that IPython, pytest and Python show them, with their source lines, as they
show local ones."""

from __future__ import annotations

import functools
import linecache
import os
import pickle
import re
import sys
import traceback
import types
from collections.abc import Iterator
from typing import Any

import dill

Sources = dict[str, dict[int, str]]
"""Source lines by file name and line number."""

MAX_SOURCES = 256 * 1024
"""Characters of source lines one call sends at most (a notebook's functions take a few hundred)."""
MAX_FRAMES = 100
"""Remote frames rebuilt at most (the innermost): a deep recursion's traceback says the rest in its text."""
_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
             os.path.dirname(os.path.abspath(dill.__file__)) + os.sep, pickle.__file__, "<frozen importlib")
_INTERNAL_ELSEWHERE = re.compile(r"[/\\](rpycdl[/\\](server|wire|client)|dill)[/\\][^/\\]+\.py$")
"""Where frames come from that are not the job's own: rpycdl's, dill's and pickle's code, the import machinery
(here, or in another install: a server's)."""
_FRAME = re.compile(r'^  File "(?P<file>.+)", line (?P<line>\d+), in (?P<name>.+)$')


# -- the client's side of a call: its functions' source lines --------------------------------------------

def client_sources(fn: Any) -> Sources:
    """The source lines of the functions `fn` is made of that a server cannot read: `fn` itself, the
    functions, methods and classes it uses by global name or closes over, and theirs, where they are the
    client's `__main__`'s (a script's, a notebook cell's); at most MAX_SOURCES characters."""
    sources: Sources = {}
    size = 0
    for code in _main_codes(fn):
        lines = linecache.getlines(code.co_filename)
        last = max((line for _, _, line in _all_lines(code) if line), default=code.co_firstlineno)
        span = {number: lines[number - 1] for number in range(code.co_firstlineno, min(last, len(lines)) + 1)}
        size += sum(map(len, span.values()))
        if size > MAX_SOURCES:
            break
        sources.setdefault(code.co_filename, {}).update(span)
    return sources


def _main_codes(fn: Any, limit: int = 64) -> Iterator[types.CodeType]:
    """The code of the `__main__` functions `fn` reaches (at most `limit` of them)."""
    seen: set[int] = set()
    todo = [fn]
    while todo and len(seen) < limit:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, functools.partial):
            todo.append(item.func)
        elif isinstance(item, types.MethodType):
            todo.append(item.__func__)
        elif isinstance(item, type) and item.__module__ == "__main__":
            todo.extend(vars(item).values())
        elif isinstance(item, types.FunctionType) and item.__module__ == "__main__":
            yield item.__code__
            names = {name for code in _nested(item.__code__) for name in code.co_names}
            todo.extend(item.__globals__[name] for name in names if name in item.__globals__)
            todo.extend(cell.cell_contents for cell in item.__closure__ or () if _filled(cell))
        elif callable(item) and type(item).__module__ == "__main__":  # an instance of a class of the script
            todo.append(type(item))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL) or bool(_INTERNAL_ELSEWHERE.search(filename))


def _all_lines(code: types.CodeType) -> Iterator[tuple[int, int, int | None]]:
    for each in _nested(code):
        yield from each.co_lines()


# -- the job's side: its linecache, its traceback ----------------------------------------------------------

def remember(sources: Any) -> None:
    """Put the source lines a call brought (client_sources) in linecache, for the files this process cannot
    read itself, so that tracebacks show them."""
    if not isinstance(sources, dict):
        return
    for filename, numbered in sources.items():
        if not isinstance(filename, str) or not isinstance(numbered, dict) or linecache.getlines(filename):
            continue
        lines = ["\n"] * max((number for number in numbered if isinstance(number, int)), default=0)
        for number, line in numbered.items():
            if isinstance(number, int) and number > 0 and isinstance(line, str):
                lines[number - 1] = line if line.endswith("\n") else line + "\n"
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def formatted(exc: BaseException) -> str:
    """`exc`'s traceback as Python formats it, with the frames of rpycdl, dill, pickle and the import machinery
    left out (and of the exceptions chained to it); '' when no frame of the job's own is left and nothing is
    chained (the message says it all: a module the server does not have)."""
    shown = traceback.TracebackException.from_exception(exc)
    chained, has_frames, todo = False, False, [shown]
    while todo:
        each = todo.pop()
        each.stack = traceback.StackSummary.from_list(
            [frame for frame in each.stack if not _internal(frame.filename)])
        has_frames = has_frames or bool(each.stack)
        for other in (each.__cause__, each.__context__):
            if other is not None:
                chained = True
                todo.append(other)
    return "".join(shown.format()) if has_frames or chained else ""


# -- the client's side of an outcome: the remote frames as its own -----------------------------------------

def remote_frames(exc: BaseException, text: str) -> types.TracebackType | None:
    """A traceback made of the frames of the last exception of a remote traceback's `text` (the innermost
    MAX_FRAMES), each a frame of this process at that file, line and function, raising `exc`: Python, IPython
    and pytest show them as the frames they are. A line this process cannot read is taken from the text.
    None if the text has no frame."""
    frames = _parse(text)[-MAX_FRAMES:]
    context, suppress = exc.__context__, exc.__suppress_context__
    made = [tb for tb in (_frame(exc, *frame) for frame in frames) if tb is not None]
    exc.__context__, exc.__suppress_context__, exc.__traceback__ = context, suppress, None
    for outer, inner in zip(made, made[1:], strict=False):
        outer.tb_next = inner
    return made[0] if made else None


def _parse(text: str) -> list[tuple[str, int, str, str]]:
    """(file, line, function, source line) of each frame of the last traceback in `text`."""
    lines = text.rpartition("Traceback (most recent call last):\n")[2].splitlines()
    frames = []
    for index, line in enumerate(lines):
        match = _FRAME.match(line)
        if match is None or _internal(match.group("file")):
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        source = following.strip() if following.startswith("    ") and not _FRAME.match(following) else ""
        frames.append((match.group("file"), int(match.group("line")), match.group("name"), source))
    return frames


def _frame(exc: BaseException, filename: str, lineno: int, name: str, source: str) -> types.TracebackType | None:
    """A traceback entry of a frame at `filename`:`lineno` in the function `name` that raises `exc`: a frame of a
    function whose code starts where `name`'s does in the source this process has of the file (else at that
    line), so that tools that show a frame's function around it (IPython) show the right lines."""
    if not 0 < lineno <= 1_000_000:
        return None
    if source and not linecache.getlines(filename):  # a file of the server's: the line its traceback showed
        remember({filename: {lineno: source}})
    first = _def_line(filename, lineno, name) or lineno
    body = " raise __rpycdl_exception__"
    text = "\n" * (first - 1) + "def __rpycdl_frame__():" + (body if first == lineno else
                                                              "\n" * (lineno - first) + body)
    namespace: dict[str, Any] = {"__rpycdl_exception__": exc, "__name__": "__rpycdl_remote__"}
    exec(compile(text, filename, "exec"), namespace)
    function = namespace["__rpycdl_frame__"]
    try:
        function.__code__ = function.__code__.replace(co_name=name, co_qualname=name)
    except TypeError:  # Python 3.10: no qualified name
        function.__code__ = function.__code__.replace(co_name=name)
    exc.__traceback__ = None
    try:
        function()
    except BaseException:  # noqa: BLE001 - the exception it raised on purpose
        return sys.exc_info()[2].tb_next  # type: ignore[union-attr]
    return None


def _def_line(filename: str, lineno: int, name: str) -> int | None:
    """The line where the function `name` around line `lineno` of the file begins, as this process reads the
    file; None if it cannot tell (no source, a module's or a lambda's code)."""
    lines = linecache.getlines(filename)
    if not name.isidentifier() or not 0 < lineno <= len(lines):
        return None
    indent = len(lines[lineno - 1]) - len(lines[lineno - 1].lstrip())
    header = re.compile(rf"^(\s*)(async\s+)?def\s+{re.escape(name)}\s*\(")
    for number in range(lineno - 1, 0, -1):
        match = header.match(lines[number - 1])
        if match and len(match.group(1)) < indent:
            return number
    return None
