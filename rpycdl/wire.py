"""What travels between client, connection process and job process: dill payloads and outcomes.

A payload is `MAGIC + (major, minor) + dill((fn, args, fn_is_dill))`: the Python version comes
first so a server can refuse code from another Python before unpickling anything. An outcome
is `b"+" + dill(value)` or `b"-" + dill((dill(exception) or None, type name, message, traceback))`,
the first byte telling success from failure without unpickling anything. The exception is pickled
on its own, so a client that cannot rebuild it (its module exists only on the server, or its
__init__ takes other arguments than its args) still gets its type name, message and traceback.
"""

from __future__ import annotations

import pickle
import pickletools
import sys
import traceback
from typing import Any

import dill

from rpycdl.errors import InvalidRequestError, RemoteError, VersionMismatchError

MAGIC = b"RPYCDL1"
PYTHON = sys.version_info[:2]
OK = b"+"
FAILED = b"-"


def _version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def encode_payload(fn: Any, args: Any) -> bytes:
    """Serialise a call for the server. `fn` may be a callable or dill bytes of one."""
    fn_is_dill = isinstance(fn, (bytes, bytearray, memoryview))
    if not fn_is_dill and not callable(fn):
        raise InvalidRequestError(f"fn must be a callable or dill bytes of one, not {type(fn).__name__}")
    if fn_is_dill:
        check_pickle(bytes(fn), "fn")  # refuse unreadable dill bytes here, not after waiting for GPUs
    body = dill.dumps((bytes(fn) if fn_is_dill else fn, args, fn_is_dill), recurse=True)
    return MAGIC + bytes(PYTHON) + body


def check_payload(payload: bytes) -> bytes:
    """Check a payload without running any of it; return its dill body.

    Raises:
        VersionMismatchError: the client runs another Python minor version.
        InvalidRequestError: not a payload, or corrupt or truncated dill bytes.
    """
    if not isinstance(payload, (bytes, bytearray)):
        raise InvalidRequestError(f"payload must be bytes, not {type(payload).__name__}")
    if not payload.startswith(MAGIC) or len(payload) < len(MAGIC) + 2:
        raise InvalidRequestError("payload is not an rpycdl payload")
    version = (payload[len(MAGIC)], payload[len(MAGIC) + 1])
    if version != PYTHON:
        raise VersionMismatchError(
            f"client runs Python {_version_text(version)} but this server runs Python {_version_text(PYTHON)}; "
            "dill moves bytecode, which only the same minor version can run: use a server with your Python")
    body = bytes(payload[len(MAGIC) + 2:])
    check_pickle(body, "payload")
    return body


def check_pickle(data: bytes, what: str) -> None:
    """Walk the pickle's opcodes (nothing is executed) to reject corrupt or truncated bytes."""
    if not isinstance(data, (bytes, bytearray)):
        raise InvalidRequestError(f"{what} must be dill bytes, not {type(data).__name__}")
    try:
        for opcode, _, _ in pickletools.genops(data):
            if opcode.name == "STOP":
                return
    except Exception as exc:
        raise InvalidRequestError(f"{what} is not readable dill data ({exc})") from None
    raise InvalidRequestError(f"{what} is not readable dill data (truncated)")


def load_call(body: bytes) -> tuple[Any, Any]:
    """Unpickle a checked payload body into (fn, args); runs in the job process."""
    try:
        call = dill.loads(body)
    except pickle.UnpicklingError as exc:  # opcodes that read well but do not build (b"." alone)
        raise InvalidRequestError(f"the payload is not readable dill data ({exc})") from None
    if not isinstance(call, tuple) or len(call) != 3:
        raise InvalidRequestError(f"the payload holds a {type(call).__name__}, not an rpycdl call")
    fn, args, fn_is_dill = call
    if fn_is_dill:
        check_pickle(fn, "fn")
        fn = dill.loads(fn)
    if not callable(fn):
        raise InvalidRequestError(f"the payload holds a {type(fn).__name__}, not a callable")
    return fn, args


def encode_ok(value: Any) -> bytes:
    """Serialise a return value; a value dill cannot serialise becomes an error outcome."""
    try:
        return OK + dill.dumps(value, recurse=True)
    except Exception as exc:
        return encode_error(TypeError(f"the job's return value could not be serialised: {exc}"), tb="")


def encode_error(exc: BaseException, tb: str | None = None) -> bytes:
    """Serialise an exception with its formatted traceback."""
    if tb is None:
        tb = "".join(traceback.format_exception(exc))
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        pickled: bytes | None = dill.dumps(exc, recurse=True)
    except Exception:
        pickled = None
    try:
        message = str(exc)
    except Exception:
        message = repr(exc)
    return FAILED + dill.dumps((pickled, name, message, tb))


def decode_outcome(data: bytes) -> Any:
    """Return the job's value, or raise its exception with the remote traceback attached.

    The exception is the remote type where it can be rebuilt here, else RemoteError; its
    `remote_traceback` attribute (and a note) carry the server's traceback."""
    try:
        outcome = dill.loads(data[1:])
    except Exception as exc:
        raise RemoteError("UnreadableResult", f"the job's result could not be loaded here: {exc}") from None
    if data[:1] == OK:
        return outcome
    pickled, name, message, tb = outcome
    try:
        exc = None if pickled is None else dill.loads(pickled)
    except Exception:  # its type cannot be rebuilt here: keep its name, message and traceback
        exc = None
    if not isinstance(exc, BaseException):
        exc = RemoteError(name, message, tb)
    exc.remote_traceback = tb  # type: ignore[attr-defined]
    if tb:
        exc.add_note("Remote traceback (most recent call last), from the rpycdl server:\n" + tb.rstrip())
    raise exc


def succeeded(data: bytes) -> bool:
    """Whether an outcome holds a value rather than an exception (nothing is unpickled)."""
    return data[:1] == OK


__all__ = ["encode_payload", "check_payload", "check_pickle", "load_call", "encode_ok", "encode_error",
           "decode_outcome", "succeeded"]
