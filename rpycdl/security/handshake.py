"""The server's side of a connection's way in, taken one step at a time as the client's bytes arrive and never
blocking, so that one process (the server parent's gate, rpycdl.server.gate) takes many at once: the greeting,
mutual TLS, the shared-secret proof (rpycdl.security.auth describes the protocol); on a server without
authentication, the client's first byte.

A handshake is a generator: each `yield` waits for the socket to be readable. What it costs is a socket, a
generator and, with TLS, an SSL object: memory, no process.
"""

from __future__ import annotations

import hmac
import os
import socket
import ssl
import time
from collections.abc import Generator

from rpycdl.errors import AuthFailedError
from rpycdl.security import auth, tls
from rpycdl.security.auth import Identity

LINGER = 1.0
"""Seconds a client whose TLS handshake failed has to read the alert before its connection is closed."""

Steps = Generator[None, None, None]


class ServerCredentials:
    """What a server asks of its clients: mutual TLS (when it has a certificate), then the shared secret
    (when it has one); neither, on a server without authentication."""

    def __init__(self, tls_context: ssl.SSLContext | None, secret: bytes | None) -> None:
        self.tls = tls_context
        self.secret = secret

    @property
    def mode(self) -> str:
        """The steps it takes, as the greeting names them ("" for none)."""
        return "+".join(name for name, used in (("tls", self.tls), ("secret", self.secret)) if used)

    def handshake(self, sock: socket.socket, grace: float) -> ServerHandshake:
        """Begin the handshake of a newly accepted socket, to end within `grace` seconds."""
        return ServerHandshake(sock, self, grace)


class ServerHandshake:
    """One connection's handshake. The gate calls advance() once at the start and whenever the socket is
    readable, until it returns True (then `sock`, TLS-wrapped if TLS was used, and `identity` are the
    connection's) or raises AuthFailedError (the client failed, or left). `heard` says whether the client has
    sent anything yet (a client with credentials says auth.HELLO as soon as it is connected, so that is usually
    true from the start); `deadline` is when the gate drops it."""

    def __init__(self, sock: socket.socket, credentials: ServerCredentials, grace: float) -> None:
        sock.setblocking(False)
        self.sock: socket.socket = sock
        self.identity: Identity | None = None
        self.heard = False
        self.failed: AuthFailedError | None = None  # set while it lingers after a failed TLS handshake
        self.deadline = time.monotonic() + grace
        self._credentials = credentials
        self._steps = self._run()

    def advance(self) -> bool:
        """Take the steps the bytes that came allow; True once the client is in.

        Raises:
            AuthFailedError: the client failed a step, sent nonsense, or hung up.
        """
        try:
            next(self._steps)
        except StopIteration:
            return True
        return False

    def _run(self) -> Steps:
        credentials = self._credentials
        if not credentials.mode:  # no authentication: the client is in once it has said something
            first = yield from self._first_bytes()
            if auth.HELLO.startswith(first):  # a client with credentials (no RPyC frame starts so: 1.3 GB)
                auth.unasked(self.sock, "this server asks for no credentials")
                raise AuthFailedError("a client with credentials came, and this server asks for none")
            return
        # the greeting, and the secret's nonce with it where no TLS comes first; then the client's first bytes
        nonce_s = os.urandom(auth.NONCE) if credentials.secret is not None else b""
        greeting = auth.BANNER + f"AUTH {credentials.mode}\n".encode()
        self._send(greeting if credentials.tls is not None else greeting + nonce_s)
        yield from self._hello()
        if credentials.tls is not None:
            yield from self._tls(credentials.tls)
            if nonce_s:
                self._send(nonce_s)
        if credentials.secret is not None:
            yield from self._secret(credentials.secret, nonce_s)

    def _first_bytes(self) -> Generator[None, None, bytes]:
        """Wait for the client's first bytes and return as many as a hello has, leaving them unread."""
        while True:
            try:
                first = self.sock.recv(len(auth.HELLO), socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                yield
                continue
            except OSError as exc:
                raise AuthFailedError(f"the client left before saying anything ({exc.strerror})") from None
            if not first:
                raise AuthFailedError("the client left before saying anything")
            self.heard = True
            return first

    def _hello(self) -> Steps:
        """Take the client's auth.HELLO, if its first bytes are that (an older client's go on to the handshake)."""
        first = yield from self._first_bytes()
        if first == auth.HELLO:
            self.sock.recv(len(auth.HELLO))
        elif auth.HELLO.startswith(first) and (yield from self._read(len(auth.HELLO))) != auth.HELLO:  # in pieces
            raise AuthFailedError("the client sent neither a hello nor a handshake")

    def _tls(self, context: ssl.SSLContext) -> Steps:
        wrapped = context.wrap_socket(self.sock, server_side=True, do_handshake_on_connect=False)
        self.sock = wrapped
        while True:
            try:
                wrapped.do_handshake()
                break
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                yield
            except (ssl.SSLError, OSError) as exc:
                yield from self._linger(AuthFailedError(f"TLS handshake failed: {_reason(exc)}"))
        user, admin = tls.peer_user(wrapped.getpeercert())
        if not user:
            raise AuthFailedError("the client certificate names no user (no common name)")
        self.identity = Identity(user, verified=True, admin=admin)

    def _linger(self, failure: AuthFailedError) -> Steps:
        """After a failed TLS handshake, let the client read the alert that says why: close our side with a FIN
        (a close with unread data would send a reset, which can discard the alert) and read what the client
        still sends, for LINGER seconds at most (the gate drops it then), before failing."""
        self.failed = failure
        self.deadline = min(self.deadline, time.monotonic() + LINGER)
        try:
            self.sock.shutdown(socket.SHUT_WR)  # also leaves TLS: recv reads the plain socket
            while self.sock.recv(4096):
                pass
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            while True:
                yield
                try:
                    if not self.sock.recv(4096):
                        break
                except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                    continue
                except OSError:
                    break
        except OSError:
            pass
        raise failure

    def _secret(self, secret: bytes, nonce_s: bytes) -> Steps:
        """Check the client's proof of the secret (`nonce_s` was sent) and send ours."""
        reply = yield from self._read(auth.NONCE + auth.PROOF, "the shared-secret handshake")
        nonce_c, proof = reply[:auth.NONCE], reply[auth.NONCE:]
        if not hmac.compare_digest(proof, auth.proof(secret, b"client", nonce_s, nonce_c)):
            raise AuthFailedError("wrong shared secret")
        self._send(auth.proof(secret, b"server", nonce_c, nonce_s))

    def _read(self, count: int, during: str = "the handshake") -> Generator[None, None, bytes]:
        """Read `count` bytes, as they come (`during` names the step, for errors)."""
        data = bytearray()
        while len(data) < count:
            try:
                chunk = self.sock.recv(count - len(data))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                yield
                continue
            except OSError as exc:
                raise AuthFailedError(f"{during} failed: {_reason(exc)}") from None
            if not chunk:
                raise AuthFailedError(f"the client left during {during}")
            data += chunk
        return bytes(data)

    def _send(self, data: bytes) -> None:
        """Send a few bytes at once: they fit in the socket's buffer, which the client has not filled."""
        try:
            sent = self.sock.send(data)
        except (OSError, ssl.SSLError) as exc:
            raise AuthFailedError(f"could not write to the client: {_reason(exc)}") from None
        if sent != len(data):
            raise AuthFailedError("could not write to the client: its socket is full")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
