"""RPyC's socket stream without its costs: zlib on every frame over 3000 bytes, a send loop that
copies the rest of the buffer after every 64 KiB (quadratic), and Nagle's algorithm (a request-reply
exchange of small frames waited up to 40 ms for delayed acknowledgements); and the server's
channel, which bounds what a client's frames cost.

Frames still carry RPyC's compression flag, so peers that compress (original clients) and peers
that do not understand each other. What a peer sends costs bounded memory and time: a frame is
checked against the limit before it is read, and read into memory that grows with what arrives; a
compressed one is inflated no further than the limit (LimitedChannel); a read that gets nothing for
the server's stall time drops the connection (channel)."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import zlib
from collections.abc import Iterator
from typing import NoReturn

import rpyc
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream

CHUNK = 1 << 24
"""Bytes per send, receive or splice of a large buffer."""

FIRST_PIECE = 1 << 20
"""Bytes a read of an RPyC frame allocates before any of them came: a larger frame is read in
pieces that grow with what arrived (BulkSocketStream.read), since its header may announce far more
than the peer ever sends."""

log = logging.getLogger("rpycdl.wire")


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
            receive_view(self.sock, memoryview(buffer))
        except EOFError:
            self.close()
            raise
        del buffer[keep:]
        return bytes(buffer)

    def poll(self, timeout: float) -> bool:
        """Also ready when TLS holds decrypted bytes that the socket no longer shows."""
        pending = getattr(self.sock, "pending", None)
        return bool(pending and pending()) or super().poll(timeout)


BULK_FLAG = 0xB5
"""The flag byte of a bulk frame's header: RPyC's frame header (length, compressed flag), with a flag RPyC never
writes (it writes 0 or 1) and length 0. The raw bytes of large buffers follow it, as many as the reader's layout
says (rpycdl.wire.bulk)."""


class FramedChannel(Channel):
    """RPyC's channel, reading a frame in two steps (its header, then rest()), so that rpycdl.wire.bulk can tell a
    bulk frame from RPyC's; a bulk frame where RPyC reads a message of its own drops the connection."""

    __slots__ = ()

    def recv(self) -> bytes:
        length, compressed = self.FRAME_HEADER.unpack(self.stream.read(self.FRAME_HEADER.size))
        if compressed == BULK_FLAG:
            self._drop("raw bytes came where an RPyC message was expected")
        return self.rest(length, compressed)

    def rest(self, length: int, compressed: int) -> bytes:
        """The rest of an RPyC frame whose header said `length` and `compressed`: its message."""
        data = self.stream.read(length + len(self.FLUSHER), keep=length)
        return zlib.decompress(data) if compressed else data

    def _drop(self, reason: str) -> NoReturn:
        """Close the connection unread: the peer sees it end; RPyC sees EOFError, as if it had left."""
        try:
            peer = "{}:{}".format(*self.stream.sock.getpeername()[:2])
        except (OSError, TypeError):
            peer = "the peer"
        log.warning("dropped the connection of %s: %s", peer, reason)
        self.close()
        raise EOFError(reason)


class LimitedChannel(FramedChannel):
    """A FramedChannel that drops the connection rather than read a frame over `max_frame` bytes, or
    inflate a compressed one (as original clients send them) to more."""

    __slots__ = ("max_frame",)

    def __init__(self, stream: BulkSocketStream, max_frame: int) -> None:
        super().__init__(stream, compress=False)
        self.max_frame = max_frame

    def rest(self, length: int, compressed: int) -> bytes:
        if length > self.max_frame:
            self._drop(f"a frame of {length} bytes is over this server's limit of {self.max_frame} (--max-frame)")
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
                       f"{self.max_frame} (--max-frame)")
        if not inflater.eof:
            self._drop(f"a compressed frame of {len(data)} bytes is cut short")
        return inflated


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


def send_view(sock: socket.socket, view: memoryview) -> None:
    """Send all of `view`; EOFError if the peer is gone."""
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
        receive_view(sock, piece)
        pieces.append(piece)
        done += len(piece)
    while done > keep:  # drop the tail (RPyC's flusher)
        cut = min(done - keep, len(pieces[-1]))
        pieces[-1] = pieces[-1][:len(pieces[-1]) - cut]
        done -= cut
        if not pieces[-1]:
            pieces.pop()
    return b"".join(pieces)


def receive_view(sock: socket.socket, view: memoryview) -> None:
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
