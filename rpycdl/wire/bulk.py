"""Large buffers beside RPyC: the out-of-band buffers of rpycdl.wire.codec travel raw on the
connection's socket, written straight from the sender's memory and read straight into fresh
memory of the receiver, without a pickle or a copy.

The side that needs them makes an RPyC request to a callback of the other side (`pull`, `push`),
and the raw bytes travel between that request and its reply, in one bulk frame: RPyC's frame header
with a flag of its own (stream.BULK_FLAG), then the bytes. No RPyC message can fall among them, as
none can be written or read where raw bytes are expected:
- the writer holds RPyC's send lock from the header to the last byte (sending): a message another
  thread sends meanwhile (the garbage collector's request to release a proxy, a job's output) waits
  in RPyC's send queue and goes after, whole;
- the reader holds RPyC's receive lock and, until the bulk header comes, serves the messages the peer
  sent before it as RPyC's serve() would (receiving): a reply to our own request to release a proxy,
  say, that was on its way when we asked for the bytes. The bytes count is the layout's, known to both.
On any failure in the middle the connection is closed at once (stream.closed_on_failure: RPyC's own
close would wait for an answer that never comes)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import ssl
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import rpyc

from rpycdl.defaults import SPOOL_MIN
from rpycdl.wire.codec import layout_bytes
from rpycdl.wire.stream import BULK_FLAG, CHUNK, FramedChannel, closed_on_failure, receive_view, send_view

PIECE = 1024**2
"""Bytes received at a time by pull_pieces: one buffer, reused, small enough to stay in the CPU's caches."""

MADV_POPULATE_WRITE = 23
"""madvise(2) advice (Linux 5.14): fault pages in writable, without writing to them."""

_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p
_libc = ctypes.CDLL(None, use_errno=True)


def bulk_socket(conn: rpyc.Connection) -> socket.socket:
    """The socket under an RPyC connection."""
    return conn._channel.stream.sock


BULK_HEADER = FramedChannel.FRAME_HEADER.pack(0, BULK_FLAG)
"""What a bulk frame begins with, before its raw bytes."""


@contextlib.contextmanager
def sending(conn: rpyc.Connection, framed: bool = True) -> Iterator[socket.socket]:
    """The socket to write raw bytes on, after a bulk frame's header (unless not `framed`: a peer from before
    bulk frames), with RPyC's send lock held until they are all written: another thread's message, or one
    the garbage collector makes here, waits in RPyC's send queue, and goes once they are through."""
    with conn._sendlock:
        sock = bulk_socket(conn)
        if framed:
            send_view(sock, memoryview(BULK_HEADER))
        yield sock
    while conn._send_queue and conn._sendlock.acquire(blocking=False):  # as RPyC's _send drains it
        try:
            if conn._send_queue:
                conn._channel.send(conn._send_queue.pop(0))
        finally:
            conn._sendlock.release()


@contextlib.contextmanager
def receiving(conn: rpyc.Connection, reply: rpyc.AsyncResult | None = None,
              framed: bool = True) -> Iterator[socket.socket]:
    """The socket to read a bulk frame's raw bytes from, once its header came (unless not `framed`), with RPyC's
    receive lock held until they are all read (no other thread reads them as a message). RPyC's messages that
    came before the header are served on the way, as RPyC's serve() would (nested requests included).

    Raises:
        EOFError: `reply` (to our request for the bytes) came first: the peer sends none (its error, if any,
            is the cause).
    """
    channel = conn._channel
    try:
        with conn._recvlock:
            while framed:
                length, flag = channel.FRAME_HEADER.unpack(channel.stream.read(channel.FRAME_HEADER.size))
                if flag == BULK_FLAG:
                    break
                data = channel.rest(length, flag)
                conn._recvlock.acquire()  # _dispatch lets go of it once, as it does in serve()
                conn._dispatch(data)
                if reply is not None and reply._is_ready:  # not .ready, which would read on
                    raise EOFError("the peer answered the request for its buffers without sending them (an rpycdl "
                                   "client from before bulk frames?)") from _error(reply)
            yield bulk_socket(conn)
    finally:
        with conn._recv_event:  # threads waiting for the lock (RPyC's serve) look again
            conn._recv_event.notify_all()


def _error(reply: rpyc.AsyncResult) -> BaseException | None:
    """The error a reply carries, if any."""
    try:
        reply.value  # noqa: B018 - raises it
    except Exception as exc:  # noqa: BLE001 - whatever the peer raised
        return exc
    return None


def allocate(size: int, readonly: bool, spool: str | None = None) -> tuple[Any, ctypes.Array]:
    """Fresh memory for a buffer of `size` bytes (at least 1), and a ctypes array over it to fill it.

    A read-only buffer is a bytes object, so that the bytes a client sent arrive as bytes with no
    copy; it is filled through the array before anything else sees it, as C code fills the result
    of PyBytes_FromStringAndSize(NULL, size). A writable one is an anonymous private mmap (NumPy
    arrays wrap it); over SPOOL_MIN bytes, given a `spool` directory, a shared mmap of a file there
    (spooled). Both are zero pages until written, so untouched memory costs nothing.
    """
    if size < 1:
        raise ValueError("an empty buffer has no memory of its own (bytes(0) is shared)")
    if readonly:
        data = bytes(size)  # calloc, and a new object for any size but 0
        return data, (ctypes.c_char * size).from_address(_bytes_address(data))
    memory = (spooled(size, spool) if spool is not None and size > SPOOL_MIN else None) \
        or mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return memory, (ctypes.c_char * size).from_buffer(memory)


class Spooled(mmap.mmap):
    """A shared mapping of a file without a name (spooled), with the file's descriptor (`fd`, closed with
    the mapping), so that a job process can map the same file rather than be sent its bytes."""

    fd: int


def spooled(size: int, directory: str) -> Spooled | None:
    """Writable memory of `size` bytes backed by a file in `directory` that has no name (O_TMPFILE, else one
    removed as it is made), its blocks reserved: pages the kernel may write out to disk and drop under memory
    pressure, where anonymous ones could only stay; the file goes with the last mapping and descriptor. None
    if the directory cannot have it (no room: filling a mapping past the disk's room would kill the process)."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        try:
            fd, path = tempfile.mkstemp(dir=directory)
        except OSError:
            return None
        os.unlink(path)
    try:
        os.posix_fallocate(fd, 0, size)
        memory = Spooled(fd, size, flags=mmap.MAP_SHARED)
    except OSError:
        os.close(fd)
        return None
    memory.fd = fd
    weakref.finalize(memory, os.close, fd)
    return memory


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Write `buffers` (the PickleBuffers of wire.encode_call) raw on `sock`, in order."""
    for buffer in buffers:
        with buffer.raw() as view:
            send_view(sock, view)


def receive_buffers(sock: socket.socket, layout: Sequence[tuple[int, bool]], spool: str | None = None) -> list[Any]:
    """Read buffers of `layout` (wire.Layout) from `sock`, each into fresh memory (allocate, which spools a
    large writable one into a file of `spool`, as it arrives)."""
    buffers = []
    for size, readonly in layout:
        buffer, cells = allocate(size, readonly, spool)
        with _populated(ctypes.addressof(cells), size), memoryview(cells) as raw, raw.cast("B") as view:
            receive_view(sock, view)
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


def pull(conn: rpyc.Connection, send: Callable[[], None], layout: Sequence[tuple[int, bool]],
         spool: str | None = None) -> list[Any]:
    """Read the buffers of `layout` from the peer: its callback `send(framed=True)` writes them in a bulk frame
    (sending, send_buffers) after our request to call it, before its reply (large writable ones into files of
    `spool`)."""
    reply = rpyc.async_(send)(True)  # framed: in a bulk frame
    with closed_on_failure(conn), receiving(conn, reply) as sock:
        buffers = receive_buffers(sock, layout, spool)
    reply.wait()
    return buffers


def pull_pieces(conn: rpyc.Connection, send: Callable[[], None], size: int, sink: Callable[[memoryview], None],
                piece: int = PIECE) -> None:
    """Read `size` bytes from the peer as pull() does, handing them to `sink` piece by piece through one
    buffer (a piece is valid only during the call): memory bounded whatever the size. Should `sink`
    raise, the rest is read all the same (the stream stays in step), then its exception raised."""
    reply = rpyc.async_(send)(True)
    failure: Exception | None = None
    buffer = memoryview(bytearray(min(size, piece)))
    with closed_on_failure(conn), receiving(conn, reply) as sock:
        done = 0
        while done < size:
            view = buffer[:min(len(buffer), size - done)]
            receive_view(sock, view)
            done += len(view)
            if failure is None:
                try:
                    sink(view)
                except Exception as exc:  # noqa: BLE001 - raised once the stream is through
                    failure = exc
    reply.wait()
    if failure is not None:
        raise failure


def push(conn: rpyc.Connection, receive: Callable[[Any], None], layout: Sequence[tuple[int, bool]], fd: int) -> int:
    """Send the peer buffers of `layout` read from the pipe `fd`: its callback `receive(layout, framed=True)`
    reads them (receiving, receive_buffers) while we write them in a bulk frame after our request to call it.

    Returns:
        How many bytes came from `fd` (all of them unless it ended early; see forward).
    """
    reply = rpyc.async_(receive)(tuple(layout), True)  # framed: in a bulk frame
    with closed_on_failure(conn), sending(conn) as sock:
        sent = forward(sock, fd, layout_bytes(layout))
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
                    send_view(sock, view[:read])
                    done += read
    except OSError as exc:
        raise EOFError(exc) from exc
    left = count - done
    if left:
        zeros = memoryview(bytes(min(left, CHUNK)))
        while left:
            send_view(sock, zeros[:left])
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
