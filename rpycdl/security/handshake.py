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
    sent anything yet; `deadline` is when the gate drops it."""

    def __init__(self, sock: socket.socket, credentials: ServerCredentials, grace: float) -> None:
        sock.setblocking(False)
        self.sock: socket.socket = sock
        self.identity: Identity | None = None
        self.heard = False
        self.failed: AuthFailedError | None = None  # set while it lingers after a failed TLS handshake
        self.deadline = time.monotonic() + grace
        self._credentials = credentials
        self._steps = self._run()

    def advance(self, readable: bool = True) -> bool:
        """Take the steps the bytes that came allow; True once the client is in.

        Raises:
            AuthFailedError: the client failed a step, sent nonsense, or hung up.
        """
        self.heard |= readable
        try:
            next(self._steps)
        except StopIteration:
            return True
        return False

    def _run(self) -> Steps:
        mode, credentials = self._credentials.mode, self._credentials
        if not mode:  # no authentication: the client is in once it has said something
            yield from self._first_byte()
            return
        greeting = auth.BANNER + f"AUTH {mode}\n".encode()
        if credentials.tls is not None:
            self._send(greeting)
            greeting = b""
            yield from self._tls(credentials.tls)
        if credentials.secret is not None:
            yield from self._secret(credentials.secret, greeting)

    def _first_byte(self) -> Steps:
        while True:
            try:
                if self.sock.recv(1, socket.MSG_PEEK):
                    return
            except (BlockingIOError, InterruptedError):
                yield
                continue
            except OSError as exc:
                raise AuthFailedError(f"the client left before its first request ({exc.strerror})") from None
            raise AuthFailedError("the client left before its first request")

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

    def _secret(self, secret: bytes, greeting: bytes) -> Steps:
        nonce_s = os.urandom(auth.NONCE)
        self._send(greeting + nonce_s)
        reply = bytearray()
        want = auth.NONCE + auth.PROOF
        while len(reply) < want:
            try:
                chunk = self.sock.recv(want - len(reply))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                yield
                continue
            except OSError as exc:
                raise AuthFailedError(f"the shared-secret handshake failed: {_reason(exc)}") from None
            if not chunk:
                raise AuthFailedError("the client left during the shared-secret handshake")
            reply += chunk
        nonce_c, proof = bytes(reply[:auth.NONCE]), bytes(reply[auth.NONCE:])
        if not hmac.compare_digest(proof, auth.proof(secret, b"client", nonce_s, nonce_c)):
            raise AuthFailedError("wrong shared secret")
        self._send(auth.proof(secret, b"server", nonce_c, nonce_s))

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
