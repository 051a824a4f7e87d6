"""Mutual TLS: the server's and the client's SSL contexts, the user a client certificate names,
and TLS failures turned into errors that say what is wrong.

Both sides require a certificate signed by the team's CA (`rpycdl certs`). The client also
checks that the server's certificate names the address it dialled (a host name or an IP
address given to `rpycdl certs server`), so a server certificate is good for its own host only.
"""

from __future__ import annotations

import os
import socket
import ssl
from typing import Any

from rpycdl.defaults import HANDSHAKE_TIMEOUT
from rpycdl.errors import AuthFailedError, ConnectionDroppedError, InvalidRequestError

ADMIN_UNIT = "rpycdl-admins"
"""Organisational unit of an admin's certificate (may cancel anyone's job)."""


def _check_files(cert: str | None, key: str | None, ca: str | None, what: str,
                 need_ca: bool = True) -> tuple[str, str, str]:
    given = {"certificate": cert, "key": key, **({"CA certificate": ca} if need_ca or ca else {})}
    missing = [name for name, path in given.items() if not path]
    if missing:
        needs = "a certificate, its key and the CA certificate" if need_ca else "a certificate and its key"
        raise InvalidRequestError(f"TLS for {what} needs {needs}; missing: {', '.join(missing)}")
    for name, path in given.items():
        if not os.path.isfile(path):  # type: ignore[arg-type]
            raise InvalidRequestError(f"the {name} file {path} does not exist: give the path of the file "
                                      "`rpycdl certs` made")
    check_private(key, "key file")  # type: ignore[arg-type]
    return cert, key, ca  # type: ignore[return-value]


def check_private(path: str, what: str) -> None:
    """Refuse a key or secret file that other users can read.

    Raises:
        InvalidRequestError: its mode gives group or others any access.
    """
    if os.stat(path).st_mode & 0o077:
        raise InvalidRequestError(f"the {what} {path} is readable by others: chmod 600 {path}")


def _context(purpose: ssl.Purpose, cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """A context presenting `cert`; with `ca`, requiring a peer certificate it signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH
                             else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise InvalidRequestError(f"cannot use the certificate {cert} with the key {key}: {exc}") from None
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise InvalidRequestError(f"cannot read the CA certificate {ca}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_context(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext:
    """The server's context: presents `cert`, requires a client certificate signed by `ca`.

    Raises:
        InvalidRequestError: a file is missing or unusable, or the key is readable by others.
    """
    return _context(ssl.Purpose.CLIENT_AUTH, *_check_files(cert, key, ca, "a server"))


def web_server_context(cert: str | None, key: str | None, ca: str | None = None) -> ssl.SSLContext:
    """The monitor's context (HTTPS): presents `cert`; with `ca`, requires a client certificate signed
    by it (a scraper's, `rpycdl certs user`); without, any client may connect, as a browser does.

    Raises:
        InvalidRequestError: a file is missing or unusable, or the key is readable by others.
    """
    return _context(ssl.Purpose.CLIENT_AUTH, *_check_files(cert, key, ca, "the monitor", need_ca=False))


def client_context(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext:
    """The client's context: presents `cert`, requires a server certificate signed by `ca` that
    names the address dialled.

    Raises:
        InvalidRequestError: a file is missing or unusable, or the key is readable by others.
    """
    context = _context(ssl.Purpose.SERVER_AUTH, *_check_files(cert, key, ca, "a client"))
    context.check_hostname = True
    return context


def peer_user(cert: dict[str, Any] | None) -> tuple[str, bool]:
    """The user a verified client certificate (SSLSocket.getpeercert()) names, its common name ("" if none),
    and whether it is an admin's (ADMIN_UNIT)."""
    subject = dict(item for rdn in (cert or {}).get("subject", ()) for item in rdn)
    return subject.get("commonName", ""), subject.get("organizationalUnitName") == ADMIN_UNIT


def connect(sock: socket.socket, context: ssl.SSLContext, host: str) -> ssl.SSLSocket:
    """Client side: the TLS handshake, checking the server's certificate against the CA and `host`.

    Raises:
        AuthFailedError: the server's certificate is not trusted or not for `host`, or the
            server refused ours.
        ConnectionDroppedError: the server closed the connection during the handshake (a busy one does).
    """
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        wrapped = context.wrap_socket(sock, server_hostname=host)
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError) as exc:  # dropped by a busy server
        raise ConnectionDroppedError(f"the server at {host} closed the connection during the TLS handshake "
                                     f"({exc})") from None
    except (ssl.SSLError, OSError) as exc:
        raise explain(exc, host) from None
    wrapped.settimeout(None)
    return wrapped


def explain(exc: BaseException, host: str) -> AuthFailedError:
    """An AuthFailedError saying in words why a TLS connection to `host` failed."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return AuthFailedError(f"the server at {host} failed the certificate check ({exc.verify_message}): "
                               "it gets nothing from us. Is it a team server, with a certificate for this address?")
    reason = getattr(exc, "reason", None) or str(exc)
    if isinstance(exc, ssl.SSLError) and "ALERT" in reason.upper():
        reason = reason.lower().replace("_", " ")
        return AuthFailedError(f"the server at {host} refused our client certificate ({reason}): "
                               "is it signed by the team's CA, and still valid?")
    return AuthFailedError(f"TLS with the server at {host} failed ({reason}): does it use TLS?")
