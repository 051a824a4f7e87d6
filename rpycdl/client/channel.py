"""A client's connection to one server: the socket, the authentication the server asks for, and
RPyC on top, with the server's first reply checked for a refusal or a greeting; the connection's
failures (OSError, EOFError) as errors that name the server (`reported`); an `Attempt` to connect that
another thread may give up on."""

from __future__ import annotations

import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import rpyc
from rpyc.core import netref

from rpycdl.defaults import CONNECT_TIMEOUT
from rpycdl.errors import (
    AuthFailedError,
    ConnectionDroppedError,
    ConnectionFailedError,
    ConnectionLostError,
    RpycdlError,
    connection_failed,
)
from rpycdl.security import auth, tls
from rpycdl.wire.stream import BulkSocketStream, FramedChannel

RETRY_PAUSE, RETRY_PAUSE_MAX = 0.02, 0.5
"""Seconds between a client's tries to get through a busy server's handshake: the first pause, and the most."""


GAVE_UP = "the client gave up on this server"
"""Why an Attempt given up (Attempt.abort) ended."""


class Attempt:
    """One attempt to connect to a server, which another thread may give up on (`abort`) while it has not
    connected yet: its socket is shut down, so that whatever waits on it (the greeting, TLS, RPyC's first
    answer) returns at once, and it connects no more. `on_connected` is called once it has connected."""

    def __init__(self, on_connected: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._on_connected = on_connected
        self.state = "connecting"
        """"connecting", then "connected", "failed" or "aborted"."""

    def adopt(self, sock: socket.socket) -> None:
        """Watch `sock` (through a duplicate of its descriptor: TLS takes the socket's own).

        Raises:
            ConnectionAbortedError: the attempt was given up.
        """
        with self._lock:
            if self.state == "aborted":
                raise ConnectionAbortedError(GAVE_UP)
            self._sockets.append(sock.dup())

    def abort(self) -> bool:
        """Give up on the attempt if it is still connecting; whether it was."""
        with self._lock:
            if self.state != "connecting":
                return False
            self.state = "aborted"
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # not connected (any more)
                    pass
            return True

    def done(self, connected: bool) -> None:
        """The attempt ended: connected or not.

        Raises:
            ConnectionAbortedError: it connected, but was given up meanwhile.
        """
        with self._lock:
            for sock in self._sockets:
                sock.close()
            self._sockets.clear()
            if self.state == "aborted":
                if connected:
                    raise ConnectionAbortedError(GAVE_UP)
                return
            self.state = "connected" if connected else "failed"
        if connected and self._on_connected is not None:
            self._on_connected()


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


def _authenticate(sock: socket.socket, host: str, secret: bytes | None,
                  tls_context: ssl.SSLContext | None) -> socket.socket:
    """Say hello, read the server's greeting and take every step it asks for; returns the socket to use."""
    sock.sendall(auth.HELLO)
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
            tls_context: ssl.SSLContext | None = None, timeout: float = CONNECT_TIMEOUT,
            attempt: Attempt | None = None) -> rpyc.Connection:
    """rpyc.connect(host, port, config=config) over the bulk transport, after the authentication
    the server asks for (rpycdl.auth), when this client has credentials. The first request
    (the root object) is made here, so a refusal is raised here. A busy server may drop the
    connection before it authenticated it (--max-startups): then it connects again, after a
    growing pause, for `timeout` seconds. `attempt`: another thread may give up on it (Attempt.abort).

    Raises:
        AuthFailedError: the server and this client could not authenticate each other.
        LimitError: the server refused the connection (--max-connections).
        ConnectionDroppedError: the server kept dropping it for `timeout` seconds.
        ConnectionFailedError: the server could not be reached, or `attempt` was given up.
    """
    if attempt is None:
        return _connect_again(host, port, config, secret, tls_context, timeout, None)
    try:
        conn = _connect_again(host, port, config, secret, tls_context, timeout, attempt)
    except BaseException:
        attempt.done(connected=False)
        raise
    try:
        attempt.done(connected=True)
    except ConnectionAbortedError as exc:
        conn.close()
        raise _failure(exc, (host, port), "connecting") from None
    return conn


def _connect_again(host: str, port: int, config: dict[str, Any], secret: bytes | None,
                   tls_context: ssl.SSLContext | None, timeout: float, attempt: Attempt | None) -> rpyc.Connection:
    """_connect, again while the server drops the connection, for `timeout` seconds."""
    deadline, pause, tries = time.monotonic() + timeout, RETRY_PAUSE, 1
    while True:
        try:
            return _connect(host, port, config, secret, tls_context, attempt)
        except ConnectionDroppedError as exc:
            if attempt is not None and attempt.state == "aborted":  # dropped by the client itself
                raise _failure(ConnectionAbortedError(GAVE_UP), (host, port), "connecting") from None
            if time.monotonic() + pause > deadline:
                raise ConnectionDroppedError(f"{exc}; {tries} tries in {timeout:g} s: the server at {host}:{port} is "
                                             "busy with connections still authenticating") from None
            time.sleep(pause * random.uniform(0.5, 1.5))
            pause, tries = min(2 * pause, RETRY_PAUSE_MAX), tries + 1


def _connect(host: str, port: int, config: dict[str, Any], secret: bytes | None,
             tls_context: ssl.SSLContext | None, attempt: Attempt | None) -> rpyc.Connection:
    with reported((host, port), "connecting"):
        sock = BulkSocketStream._connect(host, port, nodelay=True)
        try:
            if attempt is not None:
                attempt.adopt(sock)
            if secret is not None or tls_context is not None:
                sock = _authenticate(sock, host, secret, tls_context)
            conn = rpyc.connect_channel(FramedChannel(ClientSocketStream(sock), compress=False), service=_ClientService,
                                        config=config)
            try:
                conn.root  # noqa: B018 - the first request: the server may still refuse our certificate
            except EOFError as exc:
                if isinstance(exc.__cause__, ssl.SSLError) and not isinstance(exc.__cause__, ssl.SSLEOFError):
                    raise tls.explain(exc.__cause__, host) from None
                raise ConnectionDroppedError(f"the server closed the connection before its first answer ({exc})") \
                    from None
        except BaseException:
            sock.close()
            raise
    return conn


class reported:  # noqa: N801 - used as a function: `with reported(address, "calling run"):`
    """Raise the OSError or EOFError of the connection to `address` as ConnectionFailedError (an OSError too)
    or ConnectionLostError (an EOFError too), naming the server and what the client was doing (`during`:
    "connecting", or "calling NAME"), and why the connection closed where this client knows (`why`, asked then:
    "interrupted"). RpycdlErrors, and errors the server raised that RPyC re-raises here, pass as they are. The
    error RPyC raised is its context, not shown (its frames are RPyC's)."""

    def __init__(self, address: tuple[str, int], during: str, why: Callable[[], str] | None = None) -> None:
        self.address, self.during, self.why = address, during, why

    def __enter__(self) -> reported:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if not isinstance(exc, (OSError, EOFError)):
            return
        if isinstance(exc, RpycdlError) or hasattr(exc, "_remote_tb"):  # ours, or the server's own
            return
        raise _failure(exc, self.address, self.during, self.why() if self.why is not None else "") from None


def _failure(exc: OSError | EOFError, address: tuple[str, int], during: str, why: str = "") -> ConnectionFailedError:
    """What the client says of a connection's failure."""
    where = f"{address[0]}:{address[1]}"
    reason = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc) or "connection closed"
    errno = exc.errno if isinstance(exc, OSError) else None
    if during == "connecting" and isinstance(exc, OSError):
        return connection_failed(f"cannot reach the server at {where}: {reason} (is it running, and is that its "
                                 "address? `rpycdl status` lists the servers the registry knows)", address, type(exc),
                                 errno)
    if why:
        return ConnectionLostError(f"the connection to {where} closed ({why}) while {during}", address, errno)
    return ConnectionLostError(f"the connection to {where} closed while {during} ({reason}): the server or its "
                               "connection process ended, or the network dropped it (the server's log tells)",
                               address, errno)
