"""RPyC's socket transport without its costs: zlib on every frame over 3000 bytes, a send loop
that copies the rest of the buffer after every 64 KiB (quadratic), and Nagle's algorithm (a
request-reply exchange of small frames waited up to 40 ms for delayed acknowledgements).

Frames still carry RPyC's compression flag, so peers that compress (original clients) and
peers that do not understand each other.

Large buffers (rpycdl.wire's out-of-band buffers) bypass RPyC: the side that needs them makes
an RPyC request to a callback of the other side (`pull`, `push`), and the raw bytes travel on
the same socket between that request and its reply, written straight from the sender's memory
and read straight into fresh memory of the receiver. Between that request and its reply neither
side sends or reads an RPyC message, only the raw bytes move, so the stream never gets out of
step; on any failure in the middle the connection is closed at once (closed_on_failure: RPyC's
own close would wait for an answer that never comes).

What a peer sends costs bounded memory and time: a frame is checked against the limit before it is
read and read into memory that grows with what arrives, a compressed one is inflated no further than
the limit (LimitedChannel), and arguments a plain RPyC client passes by reference are copied within
bounds on items, bytes, depth and time (materialize)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import pickle
import socket
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import rpyc
from rpyc.core import consts, netref
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream

from rpycdl import auth, tls, wire
from rpycdl.defaults import ARGUMENT_DEPTH, ARGUMENT_ITEMS, ARGUMENT_TIMEOUT
from rpycdl.errors import AuthFailedError, InvalidRequestError, LimitError

CHUNK = 1 << 24
"""Bytes per send, receive or splice of a large buffer."""

FIRST_PIECE = 1 << 20
"""Bytes a read of an RPyC frame allocates before any of them came: a larger frame is read in
pieces that grow with what arrived (BulkSocketStream.read), since its header may announce far more
than the peer ever sends."""

MADV_POPULATE_WRITE = 23
"""madvise(2) advice (Linux 5.14): fault pages in writable, without writing to them."""

_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p
_libc = ctypes.CDLL(None, use_errno=True)

log = logging.getLogger("rpycdl.transport")


class BulkSocketStream(SocketStream):
    """A SocketStream whose writes are one sendall and whose reads fill one buffer."""

    __slots__ = ()

    def write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self.close()
            raise EOFError(exc) from exc

    def read(self, count: int, keep: int | None = None) -> bytes:
        """Read exactly `count` bytes; return them, or only the first `keep` of them.

        Memory follows the bytes that arrive, not the count asked for: over FIRST_PIECE bytes are
        read in pieces that grow with what came, then joined (one copy, as for a single buffer)."""
        keep = count if keep is None else keep
        try:
            if count > FIRST_PIECE:
                return _receive_growing(self.sock, count, keep)
            buffer = bytearray(count)
            _receive(self.sock, memoryview(buffer))
        except EOFError:
            self.close()
            raise
        del buffer[keep:]
        return bytes(buffer)

    def poll(self, timeout: float) -> bool:
        """Also ready when TLS holds decrypted bytes that the socket no longer shows."""
        pending = getattr(self.sock, "pending", None)
        return bool(pending and pending()) or super().poll(timeout)


class ClientSocketStream(BulkSocketStream):
    """The client's stream: the first bytes it reads may be the server's banner line instead of
    RPyC (a refusal, or a greeting asking for credentials this client does not have)."""

    __slots__ = ("_first",)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self._first = True

    def read(self, count: int, keep: int | None = None) -> bytes:
        if not self._first:
            return super().read(count, keep)
        self._first = False
        data = super().read(count, keep)
        if auth.is_banner(data):
            modes = auth.read_banner(self.sock, data)  # raises LimitError on a refusal
            self.close()
            raise AuthFailedError(f"the server requires authentication ({'+'.join(sorted(modes))}): give this "
                                  "client a shared secret or a TLS certificate (see `rpycdl.connect` or README)")
        return data


class LimitedChannel(Channel):
    """A Channel that drops the connection rather than read a frame over `max_frame` bytes, or
    inflate a compressed one (as original clients send them) to more."""

    __slots__ = ("max_frame",)

    def __init__(self, stream: BulkSocketStream, max_frame: int) -> None:
        super().__init__(stream, compress=False)
        self.max_frame = max_frame

    def recv(self) -> bytes:
        header = self.stream.read(self.FRAME_HEADER.size)
        length, compressed = self.FRAME_HEADER.unpack(header)
        if length > self.max_frame:
            self._drop(f"a frame of {length} bytes is over this server's limit of {self.max_frame} (--max-payload)")
        data = self.stream.read(length + len(self.FLUSHER), keep=length)
        return self._inflate(data) if compressed else data

    def _inflate(self, data: bytes) -> bytes:
        """Decompress a frame, never to more than max_frame bytes."""
        inflater = zlib.decompressobj()
        try:
            inflated = inflater.decompress(data, self.max_frame + 1)
        except zlib.error as exc:
            self._drop(f"a compressed frame of {len(data)} bytes does not decompress ({exc})")
        if len(inflated) > self.max_frame:
            self._drop(f"a compressed frame of {len(data)} bytes inflates to over this server's limit of "
                       f"{self.max_frame} (--max-payload)")
        if not inflater.eof:
            self._drop(f"a compressed frame of {len(data)} bytes is cut short")
        return inflated

    def _drop(self, reason: str) -> NoReturn:
        """Close the connection unread: the peer sees it end; RPyC sees EOFError, as if it had left."""
        try:
            peer = "{}:{}".format(*self.stream.sock.getpeername()[:2])
        except (OSError, TypeError):
            peer = "a client"
        log.warning("dropped the connection of %s: %s", peer, reason)
        self.close()
        raise EOFError(reason)


def channel(sock: socket.socket, max_frame: int, stall: float | None = None) -> Channel:
    """An uncompressed RPyC channel over a connected socket, without Nagle's delay, that drops
    the connection on a frame over `max_frame` bytes, or when a read gets nothing for `stall`
    seconds (SO_RCVTIMEO: the socket stays blocking, so sends and splices are untouched). A read
    waits only inside a frame or a transfer (between frames the server polls), so a header alone
    holds a connection process no longer than an idle connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if stall is not None:
        seconds = int(min(stall, 2**31 - 1))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int((stall % 1) * 1e6)))
    return LimitedChannel(BulkSocketStream(sock), max_frame)


def _authenticate(sock: socket.socket, host: str, secret: bytes | None,
                  tls_context: ssl.SSLContext | None) -> socket.socket:
    """Read the server's greeting and take every step it asks for; returns the socket to use."""
    modes = auth.read_banner(sock)
    missing = [mode for mode, have in (("tls", tls_context), ("secret", secret)) if mode in modes and not have]
    if missing or not modes <= {"tls", "secret"}:
        raise AuthFailedError(f"the server asks for {'+'.join(sorted(modes))} authentication and this client has "
                              f"no {' or '.join(missing) or 'such'} credentials")
    try:
        if "tls" in modes:
            sock = tls.connect(sock, tls_context, host)  # type: ignore[arg-type]
        if "secret" in modes:
            auth.client_handshake(sock, secret)  # type: ignore[arg-type]
    except ssl.SSLError as exc:  # TLS refused our certificate during the secret handshake
        raise tls.explain(exc, host) from None
    return sock


class _Connection(rpyc.Connection):
    """RPyC's client connection, without RPyC's request for a description of the server's root
    class (HANDLE_INSPECT): the root's proxy gets a class without methods, since rpycdl's client
    calls the root only by name (CALLATTR, or GETATTR for other attributes). One request fewer
    per connection."""

    def _netref_factory(self, id_pack: tuple[str, int, int]) -> Any:
        if self._remote_root is None and id_pack[2] != 0:  # the root object, the first the server names
            return netref.class_factory(id_pack, [])(self, id_pack)
        return super()._netref_factory(id_pack)


class _ClientService(rpyc.VoidService):
    _protocol = _Connection


def connect(host: str, port: int, config: dict[str, Any], secret: bytes | None = None,
            tls_context: ssl.SSLContext | None = None) -> rpyc.Connection:
    """rpyc.connect(host, port, config=config) over the bulk transport, after the authentication
    the server asks for (rpycdl.auth), when this client has credentials. The first request
    (the root object) is made here, so a refusal is raised here.

    Raises:
        AuthFailedError: the server and this client could not authenticate each other.
        LimitError: the server refused the connection (--max-connections).
    """
    sock = BulkSocketStream._connect(host, port, nodelay=True)
    try:
        if secret is not None or tls_context is not None:
            sock = _authenticate(sock, host, secret, tls_context)
        conn = rpyc.connect_channel(Channel(ClientSocketStream(sock), compress=False), service=_ClientService,
                                    config=config)
        try:
            conn.root  # noqa: B018 - the first request: the server may still refuse our certificate
        except EOFError as exc:
            if isinstance(exc.__cause__, ssl.SSLError):
                raise tls.explain(exc.__cause__, host) from None
            raise
    except BaseException:
        sock.close()
        raise
    return conn


def close_now(conn: rpyc.Connection) -> None:
    """Close an RPyC connection at once: the peer sees end of file, where RPyC's close() would
    send a close request and wait for the peer to answer it (forever, mid-transfer, when the
    stream holds raw bytes instead of an answer)."""
    if not conn.closed:
        conn._channel.close()
    conn.close()  # its close request now fails at once; it still releases what the connection holds


@contextlib.contextmanager
def closed_on_failure(conn: rpyc.Connection) -> Iterator[None]:
    """Close `conn` at once (close_now) if the block raises: a raw transfer cut short leaves the
    stream out of step, and the peer must see the connection end."""
    try:
        yield
    except BaseException:
        close_now(conn)
        raise


# -- arguments passed by reference ----------------------------------------------------------------

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


# -- large buffers beside RPyC ---------------------------------------------------------------------


def bulk_socket(conn: rpyc.Connection) -> socket.socket:
    """The socket under an RPyC connection."""
    return conn._channel.stream.sock


def allocate(size: int, readonly: bool) -> tuple[Any, ctypes.Array]:
    """Fresh memory for a buffer of `size` bytes (at least 1), and a ctypes array over it to fill it.

    A read-only buffer is a bytes object, so that the bytes a client sent arrive as bytes with no
    copy; it is filled through the array before anything else sees it, as C code fills the result
    of PyBytes_FromStringAndSize(NULL, size). A writable one is an anonymous private mmap (NumPy
    arrays wrap it). Both are zero pages until written, so untouched memory costs nothing.
    """
    if size < 1:
        raise ValueError("an empty buffer has no memory of its own (bytes(0) is shared)")
    if readonly:
        data = bytes(size)  # calloc, and a new object for any size but 0
        return data, (ctypes.c_char * size).from_address(_bytes_address(data))
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return memory, (ctypes.c_char * size).from_buffer(memory)


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Write `buffers` (the PickleBuffers of wire.encode_call) raw on `sock`, in order."""
    for buffer in buffers:
        with buffer.raw() as view:
            _send(sock, view)


def receive_buffers(sock: socket.socket, layout: Sequence[tuple[int, bool]]) -> list[Any]:
    """Read buffers of `layout` (wire.Layout) from `sock`, each into fresh memory (allocate)."""
    buffers = []
    for size, readonly in layout:
        buffer, cells = allocate(size, readonly)
        with _populated(ctypes.addressof(cells), size), memoryview(cells) as raw, raw.cast("B") as view:
            _receive(sock, view)
        del cells  # lets go of the mmap
        buffers.append(buffer)
    return buffers


@contextlib.contextmanager
def _populated(address: int, size: int) -> Iterator[None]:
    """Fault in the memory at `address` from another thread while the caller receives into it.

    The kernel zeroes every fresh page at its first touch: done ahead on the other core, that
    overlaps the receive's copy instead of interrupting it (a third faster on the development
    machine). Contents are never changed, so it does not matter who touches a page first."""
    stop = threading.Event()

    def populate() -> None:
        start, end = address & ~(mmap.PAGESIZE - 1), address + size
        while start < end and not stop.is_set():
            length = min(CHUNK, end - start)
            if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_WRITE):
                return  # a kernel before 5.14: the receive faults pages in itself
            start += length

    thread = threading.Thread(target=populate, name="rpycdl-populate", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()  # gone before anything forks


def pull(conn: rpyc.Connection, send: Callable[[], None], layout: Sequence[tuple[int, bool]]) -> list[Any]:
    """Read the buffers of `layout` from the peer: its callback `send` writes them raw (send_buffers)
    right after our request to call it, before its reply."""
    call = rpyc.async_(send)
    reply = call()
    with closed_on_failure(conn):
        buffers = receive_buffers(bulk_socket(conn), layout)
    reply.wait()
    return buffers


def push(conn: rpyc.Connection, receive: Callable[[Any], None], layout: Sequence[tuple[int, bool]], fd: int) -> int:
    """Send the peer buffers of `layout` read from the pipe `fd`: its callback `receive(layout)`
    reads them (receive_buffers) while we write them raw after our request to call it.

    Returns:
        How many bytes came from `fd` (all of them unless it ended early; see forward).
    """
    call = rpyc.async_(receive)
    reply = call(tuple(layout))
    with closed_on_failure(conn):
        sent = forward(bulk_socket(conn), fd, wire.layout_bytes(layout))
    reply.wait()
    return sent


def forward(sock: socket.socket, fd: int, count: int) -> int:
    """Send exactly `count` bytes read from the blocking pipe `fd` to `sock`: spliced in the kernel
    (no copy here) on a plain blocking socket, through a buffer on a TLS one. Should the pipe end
    first, zeros make up the rest, so the peer's read completes and the stream stays in step.

    Returns:
        How many bytes came from `fd`.
    """
    done = 0
    try:
        if not isinstance(sock, ssl.SSLSocket) and sock.gettimeout() is None:
            while done < count:
                more = os.SPLICE_F_MORE if count - done > CHUNK else 0  # never cork the last bytes
                moved = os.splice(fd, sock.fileno(), min(count - done, CHUNK), flags=more)
                if not moved:
                    break
                done += moved
        else:
            buffer = bytearray(min(count, CHUNK))
            with memoryview(buffer) as view:
                while done < count:
                    read = os.readv(fd, [view[:min(count - done, len(view))]])
                    if not read:
                        break
                    _send(sock, view[:read])
                    done += read
    except OSError as exc:
        raise EOFError(exc) from exc
    left = count - done
    if left:
        zeros = memoryview(bytes(min(left, CHUNK)))
        while left:
            _send(sock, zeros[:left])
            left -= min(left, len(zeros))
    return done


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def lend_to_pipe(fd: int, view: memoryview) -> None:
    """Write the bytes of `view` (a contiguous "B" view) to the blocking pipe `fd`.

    Where the memory's address can be had (a writable buffer, or a whole bytes object) the pipe is
    given its pages by reference (vmsplice(2)): no copy here, and with splice (forward) none until
    the receiver's. The memory must then stay unchanged until the reader has consumed it, which
    holds for a job's result: the job process only writes its outcome after it, then exits (the
    pages live on while the pipe or the socket holds them). Other memory is copied by write(2)."""
    address = None
    if not view.readonly:
        cells = (ctypes.c_char * len(view)).from_buffer(view)
        address = ctypes.addressof(cells)
        del cells  # only the address was wanted; the view keeps the memory
    elif type(view.obj) is bytes and len(view) == len(view.obj):
        address = _bytes_address(view.obj)
    done = 0
    while done < len(view):
        if address is None:
            done += os.write(fd, view[done:])
            continue
        iov = _IOVec(address + done, len(view) - done)
        lent = _libc.vmsplice(fd, ctypes.byref(iov), 1, 0)
        if lent < 0:
            raise OSError(ctypes.get_errno(), f"vmsplice: {os.strerror(ctypes.get_errno())}")
        done += lent


def _send(sock: socket.socket, view: memoryview) -> None:
    done = 0
    while done < len(view):
        try:
            done += sock.send(view[done:done + CHUNK])
        except (TimeoutError, InterruptedError):  # a client socket keeps RPyC's connect timeout
            continue
        except OSError as exc:
            raise EOFError(exc) from exc


def _receive_growing(sock: socket.socket, count: int, keep: int) -> bytes:
    """Receive exactly `count` bytes into pieces that grow with what arrived (each at most CHUNK, and
    never more than came before it, after the first FIRST_PIECE); return the first `keep`, joined."""
    pieces: list[memoryview] = []
    done = 0
    while done < count:
        piece = memoryview(bytearray(min(count - done, max(FIRST_PIECE, min(done, CHUNK)))))
        _receive(sock, piece)
        pieces.append(piece)
        done += len(piece)
    while done > keep:  # drop the tail (RPyC's flusher)
        cut = min(done - keep, len(pieces[-1]))
        pieces[-1] = pieces[-1][:len(pieces[-1]) - cut]
        done -= cut
        if not pieces[-1]:
            pieces.pop()
    return b"".join(pieces)


def _receive(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; EOFError if the peer leaves, or sends nothing for as long as the
    socket's receive timeout (SO_RCVTIMEO, set by channel()) allows."""
    done = 0
    while done < len(view):
        try:
            received = sock.recv_into(view[done:], min(len(view) - done, CHUNK))
        except (BlockingIOError, ssl.SSLWantReadError):  # SO_RCVTIMEO passed without a byte
            raise EOFError("the peer sent nothing in the middle of a message for --idle-timeout") from None
        except (TimeoutError, InterruptedError):
            continue
        except OSError as exc:
            raise EOFError(exc) from exc
        if not received:
            raise EOFError("connection closed by peer")
        done += received
