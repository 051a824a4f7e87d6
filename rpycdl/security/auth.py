"""Who may talk to a server, said before RPyC says a word: the server's greeting (or refusal),
mutual TLS (rpycdl.tls), the shared-secret handshake, and the identity a connection gets.

A server that requires authentication greets every client with one line from the connection
process that took it, `RPYCDL-AUTH tls`, `RPYCDL-AUTH secret` or `RPYCDL-AUTH tls+secret`;
a server over its connection limit answers `RPYCDL-REFUSED <why>` from its parent and closes,
whatever its mode. A client with credentials reads the greeting, then does every step it names (TLS first,
then the secret), each of which also proves the server; a client without credentials sees the
line where it expected RPyC's first reply. The greeting steers nothing the client has not
configured, so a forged one can only make a connection fail.

The shared-secret handshake (HMAC-SHA256, fresh nonces both ways, so nothing can be replayed):

    server -> client   nonce_s (32 bytes)
    client -> server   nonce_c (32 bytes) + HMAC(secret, "client" + nonce_s + nonce_c)
    server -> client   HMAC(secret, "server" + nonce_c + nonce_s)

The secret authenticates; it does not encrypt: without TLS, payloads cross the network in clear.
A shared secret names no user: such connections (and those of servers without authentication)
carry the user name the client declares, marked unverified.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from rpyc.utils.authenticators import AuthenticationError

from rpycdl.defaults import ENV_SECRET_FILE, HANDSHAKE_TIMEOUT
from rpycdl.errors import AuthFailedError, InvalidRequestError, LimitError
from rpycdl.security import tls

NONCE = 32
BANNER = b"RPYCDL-"
MAX_BANNER = 512
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What a user name looks like (a certificate's common name, or a declared OS user)."""


@dataclass(frozen=True)
class Identity:
    """Who is on the other end of a connection.

    Attributes:
        user: the client certificate's common name, or the OS user the client declared.
        verified: proven by a client certificate (a declared name proves nothing).
        admin: may cancel anyone's job (a certificate with tls.ADMIN_UNIT).
    """

    user: str
    verified: bool = False
    admin: bool = False

    @property
    def label(self) -> str:
        return self.user if self.verified else f"{self.user} (unverified)"


ANONYMOUS = Identity("unknown")
"""A connection that has not declared a user (e.g. an original client made with plain rpyc)."""


def declared(user: object) -> Identity:
    """The unverified identity of a client that says it is `user`.

    Raises:
        InvalidRequestError: not a plausible user name.
    """
    if not is_user_name(user):
        raise InvalidRequestError(f"not a user name: {user!r} (1 to 64 letters, digits, '.', '_' or '-')")
    return Identity(user)


def is_user_name(value: object) -> TypeGuard[str]:
    """Whether `value` is a user (or host) name rpycdl accepts: USER_NAME."""
    return isinstance(value, str) and USER_NAME.match(value) is not None


def load_secret(path: str | None = None) -> bytes | None:
    """The secret in `path`, else in $RPYCDL_SECRET_FILE, else None (no authentication).

    Raises:
        InvalidRequestError: the file is missing, empty, or readable by other users.
    """
    path = path or os.environ.get(ENV_SECRET_FILE)
    if not path:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the secret file {path}: {exc.strerror}: give the path of a file "
                                  "holding the secret, readable by you alone (chmod 600)") from None
    tls.check_private(path, "secret file")
    if len(secret) < 16:
        raise InvalidRequestError(f"the secret in {path} is too short: use at least 16 characters "
                                  "(e.g. `openssl rand -hex 32`)")
    return secret


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise AuthFailedError("the other side closed the connection during the handshake")
        data += chunk
    return data


# -- the parent's first line --------------------------------------------------------------


def _send_line(sock: socket.socket, text: str) -> None:
    """Send one short line without ever blocking the server parent (a fresh socket's buffer is empty)."""
    try:
        sock.send(BANNER + text.encode()[: MAX_BANNER - len(BANNER) - 1] + b"\n", socket.MSG_DONTWAIT)
    except OSError:
        pass


def greet(sock: socket.socket, mode: str) -> None:
    """Tell a new client which authentication steps follow ("tls", "secret", "tls+secret")."""
    _send_line(sock, f"AUTH {mode}")


def refuse(sock: socket.socket, why: str) -> None:
    """Tell a client why it is refused, and close its socket."""
    _send_line(sock, f"REFUSED {why}")
    sock.close()


def is_banner(first: bytes) -> bool:
    """Whether the first bytes a plain RPyC client reads (a 5-byte frame header) start a banner
    line instead (no RPyC frame header can: it would announce a frame of 1.3 GB, flag 'D')."""
    return len(first) >= 5 and BANNER.startswith(first[: len(BANNER)])


def read_banner(sock: socket.socket, first: bytes = b"") -> set[str]:
    """Read the server's line (after `first`, already read); returns the steps it asks for.

    Raises:
        LimitError: the server refused the connection (over --max-connections).
        AuthFailedError: no greeting, or not one of ours.
    """
    line = bytearray(first)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        while not line.endswith(b"\n") and len(line) < MAX_BANNER:
            chunk = sock.recv(1)
            if not chunk:
                break
            line += chunk
    except OSError as exc:
        raise AuthFailedError(f"no greeting from the server ({exc}): does it require authentication? "
                              "A server that does not never gets anything from a client with credentials") from None
    finally:
        sock.settimeout(None)
    text = line.decode(errors="replace").strip()
    if text.startswith("RPYCDL-REFUSED "):
        raise LimitError(f"the server refused the connection: {text[len('RPYCDL-REFUSED '):]}")
    if text.startswith("RPYCDL-AUTH "):
        return set(text[len("RPYCDL-AUTH "):].split("+"))
    raise AuthFailedError(f"no greeting from the server (it said {text[:40]!r}): does it require authentication? "
                          "A server that does not never gets anything from a client with credentials")


# -- the connection process ----------------------------------------------------------------------


class ServerAuthenticator:
    """An RPyC server authenticator, run in the forked connection process: TLS (when the server
    has a certificate), then the shared secret (when it has one). Returns the Identity the
    client certificate proves, or None (the client declares its user later). `on_refused` is called
    for each client it refuses (a silent one, or one that hangs up, included)."""

    def __init__(self, tls_context: ssl.SSLContext | None, secret: bytes | None,
                 on_refused: Callable[[], None] | None = None) -> None:
        self._tls = tls_context
        self._secret = secret
        self._on_refused = on_refused

    @property
    def mode(self) -> str:
        """The steps it takes, as the greeting names them."""
        return "+".join(name for name, used in (("tls", self._tls), ("secret", self._secret)) if used)

    def __call__(self, sock: socket.socket) -> tuple[socket.socket, Identity | None]:
        identity = None
        try:
            if self._tls is not None:
                sock, user, admin = tls.accept(sock, self._tls)
                identity = Identity(user, verified=True, admin=admin)
            if self._secret is not None:
                _server_handshake(sock, self._secret)
        except (OSError, AuthFailedError) as exc:
            if self._on_refused is not None:
                self._on_refused()
            raise AuthenticationError(f"authentication failed: {exc}") from None
        return sock, identity


def _server_handshake(sock: socket.socket, secret: bytes) -> None:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        nonce_s = os.urandom(NONCE)
        sock.sendall(nonce_s)
        reply = _recv_exactly(sock, NONCE + hashlib.sha256().digest_size)
        nonce_c, proof = reply[:NONCE], reply[NONCE:]
        if not hmac.compare_digest(proof, _proof(secret, b"client", nonce_s, nonce_c)):
            raise AuthFailedError("wrong shared secret")
        sock.sendall(_proof(secret, b"server", nonce_c, nonce_s))
    finally:
        sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Prove the secret to the server and check its proof.

    Raises:
        AuthFailedError: the server does not know the secret, or does not ask for one.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        nonce_s = _recv_exactly(sock, NONCE)
        nonce_c = os.urandom(NONCE)
        sock.sendall(nonce_c + _proof(secret, b"client", nonce_s, nonce_c))
        try:
            proof = _recv_exactly(sock, hashlib.sha256().digest_size)
        except AuthFailedError:
            raise AuthFailedError("the server refused our proof: wrong shared secret") from None
    except ssl.SSLError:
        raise  # TLS said no (rpycdl.tls.explain says why)
    except OSError as exc:
        raise AuthFailedError(f"no shared-secret handshake from the server ({exc})") from None
    finally:
        sock.settimeout(None)
    if not hmac.compare_digest(proof, _proof(secret, b"server", nonce_c, nonce_s)):
        raise AuthFailedError("the server does not know the shared secret: not sending it anything")


def is_loopback(host: str) -> bool:
    """Whether a server listening on `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
