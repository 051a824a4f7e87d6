"""RPyC's socket transport without its costs: zlib on every frame over 3000 bytes, a send loop
that copies the rest of the buffer after every 64 KiB (quadratic), and Nagle's algorithm (a
request-reply exchange of small frames waited up to 40 ms for delayed acknowledgements).

Frames still carry RPyC's compression flag, so peers that compress (original clients) and
peers that do not understand each other."""

from __future__ import annotations

import socket
import ssl
import zlib
from typing import Any

import rpyc
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream

from rpycdl import auth, tls
from rpycdl.errors import AuthFailedError


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
        conn = rpyc.connect_channel(Channel(ClientSocketStream(sock), compress=False), config=config)
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
    send a close request and wait for the peer to act on it."""
    if not conn.closed:
        conn._channel.close()
    conn.close()  # its close request now fails at once; it still releases what the connection holds
