"""Shared-secret authentication: client and server prove to each other that they know the team's
secret before RPyC says a word.

The handshake (HMAC-SHA256, fresh nonces both ways, so nothing can be replayed):

    server -> client   nonce_s (32 bytes)
    client -> server   nonce_c (32 bytes) + HMAC(secret, "client" + nonce_s + nonce_c)
    server -> client   HMAC(secret, "server" + nonce_c + nonce_s)

The client checks the server's proof too, so a rogue server announced to the registry gets no
job. The secret authenticates; it does not encrypt: payloads still cross the network in clear.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from pathlib import Path

from rpyc.utils.authenticators import AuthenticationError

from rpycdl.defaults import ENV_SECRET_FILE
from rpycdl.errors import AuthFailedError, InvalidRequestError

NONCE = 32
HANDSHAKE_TIMEOUT = 5.0


def load_secret(path: str | None = None) -> bytes | None:
    """The secret in `path`, else in $RPYCDL_SECRET_FILE, else None (no authentication).

    Raises:
        InvalidRequestError: the file is missing, empty, or readable by other users.
    """
    path = path or os.environ.get(ENV_SECRET_FILE)
    if not path:
        return None
    try:
        info = os.stat(path)
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the secret file {path}: {exc.strerror}") from None
    if info.st_mode & 0o077:
        raise InvalidRequestError(f"the secret file {path} is readable by others: chmod 600 {path}")
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


class SecretAuthenticator:
    """An RPyC server authenticator (runs in the forked connection process)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def __call__(self, sock: socket.socket) -> tuple[socket.socket, str]:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            nonce_s = os.urandom(NONCE)
            sock.sendall(nonce_s)
            reply = _recv_exactly(sock, NONCE + hashlib.sha256().digest_size)
            nonce_c, proof = reply[:NONCE], reply[NONCE:]
            if not hmac.compare_digest(proof, _proof(self._secret, b"client", nonce_s, nonce_c)):
                raise AuthenticationError("wrong shared secret")
            sock.sendall(_proof(self._secret, b"server", nonce_c, nonce_s))
        except (OSError, AuthFailedError) as exc:
            raise AuthenticationError(f"handshake failed: {exc}") from None
        finally:
            sock.settimeout(None)
        return sock, "shared-secret"


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
    except OSError as exc:
        raise AuthFailedError(f"no authentication handshake from the server ({exc}): does it use a secret?") from None
    finally:
        sock.settimeout(None)
    if not hmac.compare_digest(proof, _proof(secret, b"server", nonce_c, nonce_s)):
        raise AuthFailedError("the server does not know the shared secret: not sending it anything")
