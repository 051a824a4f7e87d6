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
own close would wait for an answer that never comes)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import ssl
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import rpyc
from rpyc.core import netref
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream

from rpycdl import auth, tls, wire
from rpycdl.errors import AuthFailedError

CHUNK = 1 << 24
"""Bytes per send, receive or splice of a large buffer."""

MADV_POPULATE_WRITE = 23
"""madvise(2) advice (Linux 5.14): fault pages in writable, without writing to them."""

_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p
_libc = ctypes.CDLL(None, use_errno=True)


class BulkSocketStream(SocketStream):
    """A SocketStream whose writes are one sendall and whose reads fill one buffer."""

    __slots__ = ()

    def write(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            self.close()
            raise EOFError(exc) from exc

    def read(self, count: int) -> bytes:
        buffer = bytearray(count)
        try:
            _receive(self.sock, memoryview(buffer))
        except EOFError:
            self.close()
            raise
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

    def read(self, count: int) -> bytes:
        if not self._first:
            return super().read(count)
        self._first = False
        data = super().read(count)
        if auth.is_banner(data):
            modes = auth.read_banner(self.sock, data)  # raises LimitError on a refusal
            self.close()
            raise AuthFailedError(f"the server requires authentication ({'+'.join(sorted(modes))}): give this "
                                  "client a shared secret or a TLS certificate (see `rpycdl.connect` or README)")
        return data


class LimitedChannel(Channel):
    """A Channel that drops the connection rather than read a frame over `max_frame` bytes."""

    __slots__ = ("max_frame",)

    def __init__(self, stream: SocketStream, max_frame: int) -> None:
        super().__init__(stream, compress=False)
        self.max_frame = max_frame

    def recv(self) -> bytes:
        header = self.stream.read(self.FRAME_HEADER.size)
        length, compressed = self.FRAME_HEADER.unpack(header)
        if length > self.max_frame:
            self.close()
            raise EOFError(f"a frame of {length} bytes is over this server's limit of {self.max_frame} (--max-payload)")
        data = self.stream.read(length + len(self.FLUSHER))[: -len(self.FLUSHER)]
        return zlib.decompress(data) if compressed else data


def channel(sock: socket.socket, max_frame: int) -> Channel:
    """An uncompressed RPyC channel over a connected socket, without Nagle's delay, that drops
    the connection on a frame over `max_frame` bytes."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def _receive(sock: socket.socket, view: memoryview) -> None:
    done = 0
    while done < len(view):
        try:
            received = sock.recv_into(view[done:], min(len(view) - done, CHUNK))
        except (TimeoutError, InterruptedError):
            continue
        except OSError as exc:
            raise EOFError(exc) from exc
        if not received:
            raise EOFError("connection closed by peer")
        done += received
