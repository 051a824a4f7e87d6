"""Outcomes read where their writer is not trusted: a job's outcome as a server running as root reads it
(its writer, the job's process, runs as the job's owner and may write any bytes). Plain data only is
unpickled (numbers, strings, bytes, None, and tuples, lists, dicts and sets of them): no pickle read here can
run code or build an object of the writer's choosing, as it would with dill in the reader's account."""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any

from rpycdl.errors import RemoteError
from rpycdl.wire import codec


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler of plain data only: it finds no class nor function (but the few builtins plain data
    pickles with), so no pickle it reads can run code or build an object of the sender's choosing."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _PLAIN_BUILTINS:
            return getattr(builtins, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


_PLAIN_BUILTINS = frozenset({"complex", "set", "frozenset", "bytearray"})


def loads(data: bytes) -> Any:
    """Unpickle `data` if it holds plain data only (numbers, strings, bytes, None, and tuples, lists, dicts and
    sets of them): what a process reads of bytes that another account wrote (a job's outcome, read by a server
    running as root), where running the sender's code would run it as the reader.

    Raises:
        pickle.UnpicklingError: it names a class or a function (or is no pickle); nothing of it ran.
    """
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # truncated, or not a pickle
        raise pickle.UnpicklingError(f"not a pickle of plain data: {exc}") from None


def outcome(data: bytes) -> Any:
    """codec.decode_outcome for a reader that must not run the job's code (loads): a value of plain data, or the
    job's exception raised as RemoteError (its type's name, message and traceback: the type itself is not
    rebuilt).

    Raises:
        RemoteError: the job's exception; or "UnsafeResult", a value that is not plain data.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
    if data[:1] != codec.OK:
        name, message, tb = _failure(data)
        raise codec.with_remote_traceback(RemoteError(name, message, tb), tb)
    try:
        return loads(data[1:])
    except pickle.UnpicklingError as exc:
        raise RemoteError("UnsafeResult", f"the job returned a value this server does not unpickle ({exc}): a server "
                          "running jobs as their owners gives original clients plain data only (numbers, strings, "
                          "bytes, and tuples, lists, dicts and sets of them); rpycdl's client (rpycdl.connect) gets "
                          "any value") from None


def failure(data: bytes) -> tuple[str, str]:
    """The type's name (without its module) and the message of an exception outcome, read as plain data
    (loads): nothing of what the job wrote runs."""
    name, message, _ = _failure(data)
    return name.rpartition(".")[2], message


def _failure(data: bytes) -> tuple[str, str, str]:
    """An exception outcome's type name, message and traceback, read as plain data."""
    try:
        _, name, message, tb = loads(data[1:])
        if not all(type(text) is str for text in (name, message, tb)):
            raise pickle.UnpicklingError("not an exception outcome's texts")
        return name, message, tb
    except (pickle.UnpicklingError, TypeError, ValueError) as exc:  # not an outcome this codec wrote
        return "UnreadableResult", f"the job's outcome could not be read: {exc}", ""
