"""RPyC's socket transport without its costs: zlib on every frame over 3000 bytes, a send loop
that copies the rest of the buffer after every 64 KiB (quadratic), and Nagle's algorithm (a
request-reply exchange of small frames waited up to 40 ms for delayed acknowledgements).

Frames still carry RPyC's compression flag, so peers that compress (original clients) and
peers that do not understand each other."""

from __future__ import annotations

import socket
import zlib
from typing import Any

import rpyc
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream

from rpycdl import auth


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
        view = memoryview(buffer)
        done = 0
        while done < count:
            try:
                received = self.sock.recv_into(view[done:], min(count - done, 1 << 24))
            except TimeoutError:
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                self.close()
                raise EOFError(exc) from exc
            if not received:
                self.close()
                raise EOFError("connection closed by peer")
            done += received
        return bytes(buffer)


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


def connect(host: str, port: int, config: dict[str, Any], secret: bytes | None = None) -> rpyc.Connection:
    """rpyc.connect(host, port, config=config) over the bulk transport, after the shared-secret
    handshake (rpycdl.auth) when a secret is given."""
    stream = BulkSocketStream.connect(host, port, nodelay=True)
    if secret is not None:
        try:
            auth.client_handshake(stream.sock, secret)
        except BaseException:
            stream.close()
            raise
    return rpyc.connect_channel(Channel(stream, compress=False), config=config)
