"""Arguments a plain RPyC client passes by reference (as the original clients do), copied into
local values within bounds on items, bytes, depth and time."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import rpyc
from rpyc.core import consts, netref

from rpycdl.defaults import ARGUMENT_DEPTH, ARGUMENT_ITEMS, ARGUMENT_TIMEOUT
from rpycdl.errors import InvalidRequestError, LimitError

COPIED = {"builtins.list": list, "builtins.tuple": tuple, "builtins.set": set, "builtins.frozenset": frozenset,
          "builtins.dict": dict}
"""The remote types whose netrefs materialize copies item by item, by the name RPyC gives them."""

COPY_CHUNK = 4096
"""Most items materialize asks a client for in one request: the netrefs of one answer cost the
connection process about a kilobyte each, and its unpacking is not interrupted by the deadline."""


def materialize(value: Any, max_bytes: int, max_items: int = ARGUMENT_ITEMS, max_depth: int = ARGUMENT_DEPTH,
                timeout: float = ARGUMENT_TIMEOUT) -> Any:
    """Copy a value that a plain RPyC client passed by reference into local values, within bounds.

    Original clients pass their arguments with plain RPyC: lists, dicts and sets (and tuples holding
    them) arrive as netrefs, proxies whose every use is a request to the client. This copies them:
    a container's items in one request (RPyC's HANDLE_BUFFITER; COPY_CHUNK items at most each), a
    dict's values one request each. Any other remote object (a generator, an instance of the
    client's classes) is copied only as the client pickles it (HANDLE_PICKLE, which its RPyC config
    allows with allow_pickle) and unpickled only where it is used, in the job. Nothing stays a netref.

    Args:
        value: what arrived; plain values come back as they are.
        max_bytes: most bytes of strings, bytes and pickles in all (the server's --max-payload).
        max_items: most items copied from remote containers, keys and values each counting one.
        max_depth: most levels of nested containers.
        timeout: most seconds for the whole copy; each request to the client is given what is left,
            so a client that never answers is bounded too (its late answer is then ignored).

    Returns:
        The value, its remote lists, tuples, sets, frozensets and dicts copied into local ones.

    Raises:
        LimitError: over one of the bounds; the message names it and what sets it.
        InvalidRequestError: a remote object that cannot be copied by value (a generator, or an
            object the client does not pickle).
        EOFError: the client went away.
    """
    copy = _Copy(max_bytes, max_items, max_depth, timeout)
    try:
        return copy.value(value, 0)
    finally:
        copy.restore()


class _Pickled:
    """An argument as the client pickled it: unpickled only where it is used (the job), since
    pickling this object again gives the client's bytes to pickle.loads."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return pickle.loads, (self.data,)


class _Copy:
    """One run of materialize: its bounds, what it used of them, and the connections whose RPyC
    request timeout it set (restored at the end)."""

    def __init__(self, max_bytes: int, max_items: int, max_depth: int, timeout: float) -> None:
        self.max_bytes, self.max_items, self.max_depth, self.timeout = max_bytes, max_items, max_depth, timeout
        self.bytes = self.items = 0
        self.deadline = time.monotonic() + timeout
        self.saved: dict[rpyc.Connection, Any] = {}

    def restore(self) -> None:
        for conn, timeout in self.saved.items():
            conn._config["sync_request_timeout"] = timeout

    def value(self, value: Any, depth: int) -> Any:
        if isinstance(value, netref.BaseNetref):
            return self.remote(value, depth)
        if type(value) in (str, bytes):
            self.count(0, len(value))
        elif type(value) is tuple:  # RPyC sends tuples by value, with netrefs in them
            self.check_depth(depth)
            return tuple(self.value(item, depth + 1) for item in value)
        return value

    def remote(self, proxy: Any, depth: int) -> Any:
        kind = object.__getattribute__(proxy, "____id_pack__")[0]
        if kind not in COPIED:
            return self.pickled(proxy, kind)
        self.check_depth(depth)
        copied = []
        for chunk in self.chunks(proxy):
            self.count(len(chunk), 0)
            if kind != "builtins.dict":
                copied.extend(self.value(item, depth + 1) for item in chunk)
                continue
            for key in chunk:
                value = self.request(proxy, consts.HANDLE_CALLATTR, "__getitem__", (key,), ())
                self.count(1, 0)
                copied.append((self.value(key, depth + 1), self.value(value, depth + 1)))
        return COPIED[kind](copied)

    def chunks(self, proxy: Any) -> Iterator[tuple[Any, ...]]:
        """A remote container's items (a dict's keys), COPY_CHUNK per request at most, so that what
        one answer holds stays small: all of a small container at once, and a larger one again from
        its start, through an iterator of it. Never more than one item over the bound on items."""
        asked = self.chunk_size()
        chunk = self.request(proxy, consts.HANDLE_BUFFITER, asked)
        if len(chunk) < asked or asked < COPY_CHUNK:  # all of it, or more than the bound allows
            yield chunk
            return
        del chunk
        iterator = self.request(proxy, consts.HANDLE_CALLATTR, "__iter__", (), ())
        while True:
            asked = self.chunk_size()
            chunk = self.request(iterator, consts.HANDLE_BUFFITER, asked)
            yield chunk
            if len(chunk) < asked:
                return

    def chunk_size(self) -> int:
        return min(COPY_CHUNK, self.max_items - self.items + 1)

    def pickled(self, proxy: Any, kind: str) -> _Pickled:
        try:
            data = self.request(proxy, consts.HANDLE_PICKLE, pickle.DEFAULT_PROTOCOL)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"an argument of type {kind} arrived by reference and cannot be copied by "
                                      f"value: {exc}; pass lists, tuples, dicts, sets and plain values, or objects "
                                      "the client may pickle (its RPyC config allow_pickle)") from None
        if type(data) is not bytes:
            raise InvalidRequestError(f"an argument of type {kind} arrived by reference and cannot be copied by value: "
                                      "the client did not pickle it")
        self.count(1, len(data))
        return _Pickled(data)

    def request(self, proxy: Any, handler: int, *args: Any) -> Any:
        """Ask the client (RPyC's `handler` on `proxy`), within what is left of the time."""
        conn = object.__getattribute__(proxy, "____conn__")
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.late()
        self.saved.setdefault(conn, conn._config["sync_request_timeout"])
        conn._config["sync_request_timeout"] = left  # bounds RPyC's own requests meanwhile (HANDLE_INSPECT)
        try:
            return conn.async_request(handler, proxy, *args, timeout=left).value
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                self.late()
            raise InvalidRequestError("the client's answer was a TimeoutError") from None
        except (EOFError, LimitError):
            raise
        except Exception as exc:  # raised by the client, or by RPyC reading its answer
            first = (str(exc).splitlines() or [""])[0]
            raise InvalidRequestError(f"the client answered {type(exc).__name__}: {first}") from None

    def check_depth(self, depth: int) -> None:
        if depth >= self.max_depth:
            raise LimitError(f"the arguments are nested more than {self.max_depth} levels deep, the most this server "
                             "copies (ARGUMENT_DEPTH in rpycdl.defaults)")

    def count(self, items: int, size: int) -> None:
        self.items += items
        self.bytes += size
        if self.items > self.max_items:
            raise LimitError(f"the arguments passed by reference hold more than {self.max_items} items, the most "
                             "this server copies (ARGUMENT_ITEMS in rpycdl.defaults); send large data as bytes")
        if self.bytes > self.max_bytes:
            raise LimitError(f"the arguments hold more than {self.max_bytes} bytes of strings, bytes and pickles, "
                             f"over this server's limit of {self.max_bytes} (--max-payload)")

    def late(self) -> NoReturn:
        raise LimitError(f"copying the arguments passed by reference took over {self.timeout:g} s, the most this "
                         "server waits for a client (ARGUMENT_TIMEOUT in rpycdl.defaults)")
