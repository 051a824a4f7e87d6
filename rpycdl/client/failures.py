"""How the client's calls fail where a person reads them: Ctrl-C as a KeyboardInterrupt of one line that
says what it stopped (the connection it closed is opened again by the next call); a lost connection naming
what ended with it (the job, the session); a module the server does not have, with the `working_dir="."`
that sends it when it is a file beside the caller."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rpycdl.errors import ConnectionLostError, InvalidRequestError, short_traceback

if TYPE_CHECKING:
    from rpycdl.client.connection import Connection

_MISSING = re.compile(r"No module named '([\w.]+)'")


def interrupted(connection: Connection, what: str) -> KeyboardInterrupt:
    """Ctrl-C during a call that owns what runs on `connection` (an attached job, a session's wait): the
    connection is closed, which cancels it on the server, and opened again by the next call. `what` names it
    ("job 3f2a", or None: the call's job, whose id the server had not told)."""
    connection.interrupt()
    where = "{}:{}".format(*connection.address)
    return _short(KeyboardInterrupt(f"{what or 'the call'} was cancelled: the interrupt closed the connection to "
                                    f"{where} (the next call opens it again)"))


def stopped(what: str) -> KeyboardInterrupt:
    """Ctrl-C during a call that only waited or read (a detached job's wait, result, logs, download): what it
    waited for goes on."""
    return _short(KeyboardInterrupt(f"interrupted: {what}"))


def _short(exc: KeyboardInterrupt) -> KeyboardInterrupt:
    """`exc`, which IPython shows without rpycdl's frames, as it shows an RpycdlError."""
    exc._render_traceback_ = functools.partial(short_traceback, exc)  # type: ignore[attr-defined]
    return exc


def lost(exc: ConnectionLostError, then: str) -> ConnectionLostError:
    """`exc` saying what ended with the connection (`then`: 'the job was cancelled')."""
    return ConnectionLostError(f"{exc}; {then}", exc.address, exc.errno)


def hinted(exc: InvalidRequestError, working_dir: object) -> InvalidRequestError:
    """`exc`, or, when it says that the server has no module that is a file beside the caller (in the current
    directory, or beside the script) and the call sent no working directory, `exc` saying how to send it."""
    match = _MISSING.search(str(exc))
    if working_dir is not None or match is None:
        return exc
    top = match.group(1).partition(".")[0]
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    for directory in (Path.cwd(), *([Path(script).resolve().parent] if script else [])):
        for found in (directory / f"{top}.py", directory / top / "__init__.py"):
            if found.is_file():
                words = '"."' if directory == Path.cwd() else repr(str(directory))
                return InvalidRequestError(f"{exc}: {top} is {found}, beside you, which the server does not have: "
                                           f"pass working_dir={words} to send its directory with the job (the "
                                           "job runs in it, first on its sys.path)")
    return exc
