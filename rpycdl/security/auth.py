"""Who may talk to a server, said before RPyC says a word: the server's greeting (or refusal),
mutual TLS (rpycdl.tls), the shared-secret handshake, and the identity a connection gets.

A server that requires authentication greets every client with one line from its parent's gate
(rpycdl.server.gate, which takes every handshake before the connection gets a process),
`RPYCDL-AUTH tls`, `RPYCDL-AUTH secret` or `RPYCDL-AUTH tls+secret`; a server over its connection limit
answers `RPYCDL-REFUSED <why>` and closes, whatever its mode; a busy one drops a connection still
authenticating with `RPYCDL-BUSY <why>` (or, during TLS, a plain close), and the client connects again
(ConnectionDroppedError). A server without authentication closes a connection that said nothing within its grace
time with `RPYCDL-UNAUTHENTICATED <why>`: a client with credentials, waiting for a greeting, then knows that none
will come. A client with credentials says `RPYCDL-HELLO` as soon as it is connected (HELLO: the gate knows it
then for a client that speaks, and never drops it to make room for another of its address, as it drops a silent
one; a server without authentication answers it with `RPYCDL-UNAUTHENTICATED` at once), reads the greeting,
then does every step it names (TLS first, then the secret), each of which also proves the server; a client
without credentials sees the line where it expected RPyC's first reply. The greeting steers nothing the client has not
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
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from rpycdl.defaults import ENV_SECRET_FILE, HANDSHAKE_TIMEOUT
from rpycdl.errors import AuthFailedError, ConnectionDroppedError, InvalidRequestError, LimitError
from rpycdl.security import tls

NONCE = 32
PROOF = hashlib.sha256().digest_size
BANNER = b"RPYCDL-"
HELLO = BANNER + b"HELLO\n"
"""What a client with credentials sends as soon as it is connected, before the server's greeting. The server takes
it and goes on; a client that does not send it (an older one) is served as well, but counts as silent until its
first handshake bytes come."""
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


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """The HMAC one side sends to prove it knows the secret (role b"client" or b"server")."""
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
    line = BANNER + text.encode()[: MAX_BANNER - len(BANNER) - 1] + b"\n"
    try:  # a TLS socket takes no flags: the gate's are non-blocking already
        sock.send(line) if isinstance(sock, ssl.SSLSocket) else sock.send(line, socket.MSG_DONTWAIT)
    except OSError:
        pass


def refuse(sock: socket.socket, why: str) -> None:
    """Tell a client why it is refused, and close its socket."""
    _send_line(sock, f"REFUSED {why}")
    sock.close()


def unasked(sock: socket.socket, why: str) -> None:
    """Close a connection that said nothing to a server without authentication, telling a client that waits for
    a greeting (one with credentials) that none will come."""
    _send_line(sock, f"UNAUTHENTICATED {why}")
    sock.close()


def drop(sock: socket.socket, why: str | None) -> None:
    """Close a connection the server drops before it authenticated, telling the client to try again (unless
    `why` is None: a TLS client would take the line for a broken handshake, and retries on the close alone)."""
    if why is not None:
        _send_line(sock, f"BUSY {why}")
    sock.close()


def is_banner(first: bytes) -> bool:
    """Whether the first bytes a plain RPyC client reads (a 5-byte frame header) start a banner
    line instead (no RPyC frame header can: it would announce a frame of 1.3 GB, flag 'D')."""
    return len(first) >= 5 and BANNER.startswith(first[: len(BANNER)])


def read_banner(sock: socket.socket, first: bytes = b"") -> set[str]:
    """Read the server's line (after `first`, already read); returns the steps it asks for.

    Raises:
        LimitError: the server refused the connection (over --max-connections).
        ConnectionDroppedError: the server dropped it while busy; try again.
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
    except ConnectionResetError as exc:
        raise ConnectionDroppedError(f"the server reset the connection before greeting it ({exc})") from None
    except OSError as exc:
        raise AuthFailedError(f"no greeting from the server ({exc}): does it require authentication? "
                              "A server that does not never gets anything from a client with credentials") from None
    finally:
        sock.settimeout(None)
    text = line.decode(errors="replace").strip()
    if not text:
        raise ConnectionDroppedError("the server closed the connection before greeting it")
    if text.startswith("RPYCDL-BUSY "):
        raise ConnectionDroppedError(f"the server dropped the connection: {text[len('RPYCDL-BUSY '):]}")
    if text.startswith("RPYCDL-REFUSED "):
        raise LimitError(f"the server refused the connection: {text[len('RPYCDL-REFUSED '):]}")
    if text.startswith("RPYCDL-AUTH "):
        return set(text[len("RPYCDL-AUTH "):].split("+"))
    if text.startswith("RPYCDL-UNAUTHENTICATED "):
        raise AuthFailedError(f"the server asks for no authentication ({text[len('RPYCDL-UNAUTHENTICATED '):]}): "
                              "does it require authentication? A server that does not never gets anything from a "
                              "client with credentials")
    raise AuthFailedError(f"no greeting from the server (it said {text[:40]!r}): does it require authentication? "
                          "A server that does not never gets anything from a client with credentials")


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Prove the secret to the server and check its proof.

    Raises:
        AuthFailedError: the server does not know the secret, or does not ask for one.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        nonce_s = _recv_exactly(sock, NONCE)
        nonce_c = os.urandom(NONCE)
        sock.sendall(nonce_c + proof(secret, b"client", nonce_s, nonce_c))
        try:
            theirs = _recv_exactly(sock, PROOF)
        except AuthFailedError:
            raise AuthFailedError("the server refused our proof: wrong shared secret") from None
        if is_banner(theirs):  # dropped while busy, before our proof was read
            read_banner(sock, theirs)
    except ssl.SSLError:
        raise  # TLS said no (rpycdl.tls.explain says why)
    except ConnectionResetError as exc:
        raise ConnectionDroppedError(f"the server reset the connection during the secret handshake ({exc})") from None
    except OSError as exc:
        raise AuthFailedError(f"no shared-secret handshake from the server ({exc})") from None
    finally:
        sock.settimeout(None)
    if not hmac.compare_digest(theirs, proof(secret, b"server", nonce_c, nonce_s)):
        raise AuthFailedError("the server does not know the shared secret: not sending it anything")


def is_loopback(host: str) -> bool:
    """Whether a server listening on `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
