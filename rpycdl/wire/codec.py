"""What travels between client, connection process and job process: dill payloads and outcomes.

A payload is `MAGIC + (major, minor) + dill((fn, args, fn_is_dill))` (fn as dill bytes of its own where
the client keeps them between calls: rpycdl.wire.function_bytes): the Python version comes
first so a server can refuse code from another Python before unpickling anything. After that pickle
may come a second one: the source lines of the client's own functions (rpycdl.wire.tracebacks), which
the job puts in linecache so that its traceback shows them; a server before them reads the first pickle
only, as pickle does. An outcome
is `b"+" + dill(value)` or `b"-" + dill((dill(exception) or None, type name, message, traceback))`,
the first byte telling success from failure without unpickling anything. The exception is pickled
on its own, so a client that cannot rebuild it (its module exists only on the server, or its
__init__ takes other arguments than its args) still gets its type name, message and traceback.

Out of band: `encode_call` and `encode_value` pickle with protocol 5 and leave large buffers
(bytes, bytearrays, NumPy arrays of OUT_OF_BAND_MIN bytes or more) out of the pickle, which then
only refers to them in order. They travel raw beside it (rpycdl.transport) and are handed back to
the unpickler, so a gigabyte is never copied into a pickle, framed or sliced. Their `layout` (size
and read-only flag of each, in order) is all a receiver needs to allocate them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import pickletools
import sys
import traceback
import types
from collections.abc import Callable, Sequence
from typing import IO, Any

import dill

from rpycdl.errors import InvalidRequestError, RemoteError, RpycdlError, VersionMismatchError
from rpycdl.wire import function_bytes, tracebacks

MAGIC = b"RPYCDL1"
PYTHON = sys.version_info[:2]
OK = b"+"
FAILED = b"-"
OUT_OF_BAND_MIN = 1 << 20
"""Buffers at least this large travel beside the pickle; smaller ones stay in it."""
MAX_BUFFERS = 256
"""Most buffers one call or result sends out of band; any further ones stay in the pickle."""

Layout = tuple[tuple[int, bool], ...]
"""(size in bytes, read-only) of each out-of-band buffer, in the order the pickle refers to them."""


class _Pickler(dill.Pickler):
    """dill's pickler, naming every imported module instead of copying it, and (out of band) offering
    large bytes, bytearrays and NumPy arrays to the buffer callback.

    dill copies a module's namespace when its file lies outside the interpreter's prefix, as an editable
    install's does (`pip install -e`): a function using a top-level `import rpycdl` then dragged rpycdl's
    whole namespace, ctypes included, into its pickle and failed. A module imported by name is named, as
    an installed one is, whatever its file: the server imports its own copy (the only way it ever worked,
    since dill imports the module before restoring a copied namespace into it).

    Protocol 5 alone pickles bytes and bytearrays in band, and dill pickles every NumPy array
    through its `__reduce__` (a copy of its data as bytes); an array's `__reduce_ex__(5)` gives a
    PickleBuffer of its memory instead (a copy only if it is not contiguous)."""

    def __init__(self, file: IO[bytes], out_of_band: bool, **options: Any) -> None:
        super().__init__(file, recurse=True, **options)
        self._out_of_band = out_of_band

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is types.ModuleType and obj.__name__ != "__main__" and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        if not self._out_of_band:
            return NotImplemented
        if kind in (bytes, bytearray) and len(obj) >= OUT_OF_BAND_MIN:
            return kind, (pickle.PickleBuffer(obj),)  # bytes(buffer) is the buffer itself when it is bytes
        numpy = sys.modules.get("numpy")  # never imported here: an array means NumPy is loaded
        if numpy is not None and kind is numpy.ndarray and obj.nbytes >= OUT_OF_BAND_MIN:
            return obj.__reduce_ex__(5)
        return NotImplemented


def dumps(obj: Any, out_of_band: bool = False) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """dill bytes of `obj`, and (with `out_of_band`) the large buffers left out of them.

    Returns:
        The pickle, and the buffers it refers to, to be passed in order to loads().
    """
    file = io.BytesIO()
    if not out_of_band:
        _Pickler(file, False).dump(obj)
        return file.getvalue(), []
    buffers: list[pickle.PickleBuffer] = []

    def keep_in_band(buffer: pickle.PickleBuffer) -> bool:
        try:
            with buffer.raw() as view:
                large = view.nbytes >= OUT_OF_BAND_MIN
        except BufferError:  # not contiguous: in band, where pickle says why it cannot be pickled
            return True
        if large and len(buffers) < MAX_BUFFERS:
            buffers.append(buffer)
            return False
        return True

    _Pickler(file, True, protocol=5, buffer_callback=keep_in_band).dump(obj)
    return file.getvalue(), buffers


def layout(buffers: Sequence[Any]) -> Layout:
    """The layout of out-of-band buffers (a tuple, which RPyC passes by value): the PickleBuffers of
    encode_call, or buffers received (bytes, writable mmaps)."""
    sizes = []
    for buffer in buffers:
        with memoryview(buffer) as view:
            sizes.append((view.nbytes, view.readonly))
    return tuple(sizes)


def layout_bytes(layout: Sequence[tuple[int, bool]]) -> int:
    """How many bytes the buffers of `layout` hold together."""
    return sum(size for size, _ in layout)


def check_layout(value: Any) -> Layout:
    """Check a layout that came over the network: a tuple of at most MAX_BUFFERS (size > 0,
    read-only) tuples, which RPyC passes by value.

    Raises:
        InvalidRequestError: anything else.
    """
    if type(value) is not tuple or len(value) > MAX_BUFFERS or not all(
            type(entry) is tuple and len(entry) == 2 and type(entry[0]) is int and entry[0] > 0
            and type(entry[1]) is bool for entry in value):
        raise InvalidRequestError(f"the buffer layout must be a tuple of at most {MAX_BUFFERS} (size > 0, "
                                  "read-only) tuples")
    return value


def _version_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def encode_call(fn: Any, args: Any, out_of_band: bool = True) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialise a call for the server. `fn` may be a callable or dill bytes of one. A function whose bytes are
    kept (function_bytes) with plain arguments (`plain`) is pickled by the standard pickler, into the bytes dill
    writes: dill's own, in Python, cost a session call about 0.01 ms more.

    Returns:
        The payload, and the buffers left out of it (none without `out_of_band`).
    """
    fn_is_dill = isinstance(fn, (bytes, bytearray, memoryview))
    if not fn_is_dill and not callable(fn):
        raise InvalidRequestError(f"fn must be a callable or dill bytes of one, not {type(fn).__name__}")
    if fn_is_dill:
        check_pickle(bytes(fn), "fn")  # refuse unreadable dill bytes here, not after waiting for GPUs
    try:
        sent = bytes(fn) if fn_is_dill else function_bytes.kept(fn, lambda kept: dumps(kept)[0])
        call = (fn if sent is None else sent, args, sent is not None)
        if sent is not None and plain(call):  # the function as bytes, plain arguments: no dill needed
            body, buffers = pickle.dumps(call, protocol=5), []
        else:
            body, buffers = dumps(call, out_of_band)
    except MemoryError:
        raise
    except Exception as exc:  # one line naming what could not be pickled, not dill's frames
        raise InvalidRequestError(_unsendable(fn, args, exc)) from None
    sources = {} if fn_is_dill else tracebacks.client_sources(fn)
    trailer = pickle.dumps(sources, protocol=4) if sources else b""
    return MAGIC + bytes(PYTHON) + body + trailer, buffers


def _unsendable(fn: Any, args: Any, exc: Exception) -> str:
    """Why a call cannot be pickled: the first of fn's globals, closure variables and defaults, or the
    argument, that cannot be pickled alone, and what to do instead."""
    code = getattr(fn, "__code__", None)
    parts: list[tuple[str, Any]] = []
    if isinstance(code, types.CodeType):
        names = function_bytes.global_names(code)
        parts += [(f"{fn.__name__}'s global {name!r}", fn.__globals__[name]) for name in names
                  if name in fn.__globals__]
        for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True):
            with contextlib.suppress(ValueError):  # a variable not assigned yet
                parts.append((f"{fn.__name__}'s variable {name!r}", cell.cell_contents))
        parts += [(f"{fn.__name__}'s default argument", value) for value in fn.__defaults__ or ()]
    else:
        parts.append(("the callable", fn))
    for what, value in [*parts, ("the argument", args)]:
        try:
            dumps(value)
        except Exception as part_exc:
            fix = ("pass plain data (numbers, strings, lists, dicts, arrays)" if what == "the argument" else
                   "create or import it inside the function, or pass what the function needs as its argument")
            return f"{what} ({type(value).__name__}) cannot be sent: {_first_line(part_exc)}; {fix}"
    return f"the call cannot be sent: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def encode_payload(fn: Any, args: Any) -> bytes:
    """A call with everything in the payload, for servers that take no out-of-band buffers."""
    return encode_call(fn, args, out_of_band=False)[0]


def check_payload(payload: bytes, buffers: int = 0) -> bytes:
    """Check a payload without running any of it; return its dill body.

    Args:
        payload: from encode_call.
        buffers: how many out-of-band buffers come with it.

    Raises:
        VersionMismatchError: the client runs another Python minor version.
        InvalidRequestError: not a payload, corrupt or truncated dill bytes, or referring to
            another number of out-of-band buffers.
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
    referred = check_pickle(body, "payload")
    if referred != buffers:
        raise InvalidRequestError(f"the payload refers to {referred} out-of-band buffers, and {buffers} come with it")
    return body


def check_pickle(data: bytes, what: str) -> int:
    """Walk the pickle's opcodes (nothing is executed) to reject corrupt or truncated bytes.

    Returns:
        How many out-of-band buffers the pickle refers to.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise InvalidRequestError(f"{what} must be dill bytes, not {type(data).__name__}")
    buffers = 0
    try:
        for opcode, _, _ in pickletools.genops(data):
            if opcode.name == "STOP":
                return buffers
            buffers += opcode.name == "NEXT_BUFFER"
    except Exception as exc:
        raise InvalidRequestError(f"{what} is not readable dill data ({exc})") from None
    raise InvalidRequestError(f"{what} is not readable dill data (truncated)")


def load_call(body: bytes, buffers: Sequence[Any] = ()) -> tuple[Any, Any]:
    """Unpickle a checked payload body and its out-of-band buffers into (fn, args); runs in the job process,
    which it gives the source lines that came with the call (rpycdl.wire.tracebacks.remember)."""
    file = io.BytesIO(body)
    try:
        call = dill.Unpickler(file, buffers=buffers).load()
        trailer = file.read()
        if trailer:
            tracebacks.remember(_loads_checked(trailer, "the payload's source lines", pickle.loads))
    except pickle.UnpicklingError as exc:  # opcodes that read well but do not build (b"." alone)
        raise InvalidRequestError(f"the payload is not readable dill data ({exc})") from None
    if not isinstance(call, tuple) or len(call) != 3:
        raise InvalidRequestError(f"the payload holds a {type(call).__name__}, not an rpycdl call")
    fn, args, fn_is_dill = call
    if fn_is_dill:
        fn = _loads_checked(fn, "fn", dill.loads)
    if not callable(fn):
        raise InvalidRequestError(f"the payload holds a {type(fn).__name__}, not a callable")
    return fn, args


def _loads_checked(data: bytes, what: str, loads: Callable[[bytes], Any]) -> Any:
    """`loads(data)`; if it fails, InvalidRequestError where the bytes are not a pickle at all (check_pickle,
    which walks every opcode in Python: only then), else the failure itself (a module the server lacks)."""
    try:
        return loads(data)
    except Exception:
        check_pickle(data, what)
        raise


def encode_value(value: Any, out_of_band: bool = False) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Serialise a return value, and (with `out_of_band`) return its large buffers beside it; a
    value dill cannot serialise becomes an error outcome. Small plain data (`plain`) takes the standard
    pickler: dill's, pure Python, costs a fresh job process about 0.3 ms for a pair of floats, the standard
    one 0.05 ms."""
    if plain(value):
        return encode_data(value), []
    try:
        body, buffers = dumps(value, out_of_band)
    except Exception as exc:
        return encode_error(TypeError(f"the job's return value could not be serialised: {exc}"), tb=""), []
    return OK + body, buffers


PLAIN_MAX = 256
"""Most items (scalars and containers, counted together) a value `plain` accepts."""
_SCALARS = (type(None), bool, int, float, complex)
_CONTAINERS = (tuple, list, dict, set, frozenset)


def plain(value: Any) -> bool:
    """Whether `value` is small plain data, which the standard pickler writes as dill would: None, numbers,
    strings and bytes under OUT_OF_BAND_MIN, and tuples, lists, dicts and sets of them (those types exactly,
    no subclass: a named tuple or an enum of the job's script is dill's), PLAIN_MAX items in all."""
    todo, count = [value], 0
    while todo:
        item = todo.pop()
        count += 1
        kind = type(item)
        if count > PLAIN_MAX:
            return False
        if kind in _SCALARS or (kind in (str, bytes) and len(item) < OUT_OF_BAND_MIN):
            continue
        if kind not in _CONTAINERS or len(item) > PLAIN_MAX:
            return False
        todo.extend(item.items() if kind is dict else item)
    return True


def encode_ok(value: Any) -> bytes:
    """Serialise a return value, all in band."""
    return encode_value(value)[0]


def encode_data(value: Any) -> bytes:
    """Serialise plain data a server answers with (dicts, lists, strings, numbers, None, bytes) with the
    standard pickler, which is many times faster than dill's and which decode_outcome reads alike."""
    return OK + pickle.dumps(value, protocol=5)


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
        message = str.__str__(str(exc))  # a str itself, not a subclass of the job's: readers read it as plain data
    except Exception:
        message = str.__str__(repr(exc))
    return FAILED + pickle.dumps((pickled, str.__str__(name), message, str.__str__(tb)), protocol=5)


def decode_outcome(data: bytes, buffers: Sequence[Any] = ()) -> Any:
    """Return the job's value, or raise its exception with the remote traceback attached.

    The exception is the remote type where it can be rebuilt here, else RemoteError; its
    `remote_traceback` attribute (and a note) carry the server's traceback. `buffers` are the
    value's out-of-band buffers."""
    __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
    try:
        outcome = dill.loads(data[1:], buffers=buffers)
    except (MemoryError, RpycdlError):  # out of memory, or a bound of the caller's (a timer's LimitError)
        raise
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
    raise with_remote_traceback(exc, tb)


def with_remote_traceback(exc: BaseException, tb: str) -> BaseException:
    """`exc` with the server's traceback `tb`: its frames as frames of `exc`'s traceback (the job's code, with
    its source lines: rpycdl.wire.tracebacks.remote_frames), its text as `remote_traceback`, and a note: the
    whole text where the frames do not tell it all (exceptions chained to it)."""
    exc.remote_traceback = tb  # type: ignore[attr-defined]
    if not tb:
        return exc
    frames = tracebacks.remote_frames(exc, tb)
    if frames is not None and tb.count("Traceback (most recent call last):") == 1:
        note = "(raised in the job on the rpycdl server: the frames above from the job's own code ran there)"
    else:
        note = "Remote traceback (most recent call last), from the rpycdl server:\n" + tb.rstrip()
    if hasattr(exc, "add_note"):  # Python 3.11 and later print notes under the exception
        exc.add_note(note)
    elif frames is None or note.startswith("Remote"):  # Python 3.10 prints the cause above it instead
        exc.__cause__ = RemoteTraceback(note)
    return exc.with_traceback(frames)


class RemoteTraceback(Exception):
    """The server's traceback as the cause of a re-raised remote exception, where exceptions have
    no notes (Python 3.10)."""

    def __str__(self) -> str:
        return str(self.args[0])


def succeeded(data: bytes) -> bool:
    """Whether an outcome holds a value rather than an exception (nothing is unpickled)."""
    return data[:1] == OK


__all__ = ["encode_call", "encode_payload", "check_payload", "check_pickle", "check_layout", "layout", "dumps",
           "load_call", "encode_value", "encode_ok", "encode_error", "decode_outcome", "succeeded",
           "with_remote_traceback"]
