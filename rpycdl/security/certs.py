"""A small team's certificate authority (`rpycdl certs`): the CA, server certificates and user
certificates, made with the `cryptography` package.

Files in the CA directory (keys mode 600):

    ca.crt, ca.key                      the authority; ca.key never leaves the admin's machine
    server-HOST.crt, server-HOST.key    one per server host (names and addresses clients dial)
    user-NAME.crt, user-NAME.key        one per user; the common name is the user's identity

A user certificate whose subject carries the organisational unit ADMIN_UNIT makes its holder
an admin (may cancel anyone's job). Keys are ECDSA P-256.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rpycdl.defaults import CA_DAYS, SERVER_CERT_DAYS, USER_CERT_DAYS
from rpycdl.errors import InvalidRequestError
from rpycdl.security.auth import is_user_name
from rpycdl.security.tls import ADMIN_UNIT


@dataclass(frozen=True)
class Issued:
    """Where a certificate and its key were written."""

    cert: Path
    key: Path


def _check_name(name: str, what: str) -> str:
    """A user or host name (it becomes part of file names): what auth.is_user_name allows."""
    if not is_user_name(name):
        raise InvalidRequestError(f"bad {what} {name!r}: 1 to 64 letters, digits, '.', '_' or '-'")
    return name


def _check_days(days: int) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or not 0 < days <= 100 * 365:
        raise InvalidRequestError(f"--days must be a whole number of days between 1 and 36500, not {days!r}")
    return days


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write a new file (never overwrite one), mode 600 for keys, 644 for certificates."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    except FileExistsError:
        raise InvalidRequestError(f"{path} exists already: remove it first to issue a new one") from None
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _save(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, directory: Path, stem: str) -> Issued:
    issued = Issued(directory / f"{stem}.crt", directory / f"{stem}.key")
    for path in (issued.cert, issued.key):
        if path.exists():
            raise InvalidRequestError(f"{path} exists already: remove it first to issue a new one")
    _write(issued.key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()), private=True)
    _write(issued.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return issued


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"no usable CA in {directory} ({exc}): create one with `rpycdl certs ca "
                                  f"{directory}`") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidRequestError(f"{directory / 'ca.key'} is not a key made by `rpycdl certs ca`")
    return cert, key


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int,
             not_before: datetime.datetime | None) -> x509.CertificateBuilder:
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=_check_days(days))))


def create_ca(directory: str | os.PathLike[str], name: str = "rpycdl team CA", days: int = CA_DAYS) -> Issued:
    """Create a certificate authority in `directory` (created mode 700 if missing).

    Raises:
        InvalidRequestError: the directory already holds a CA, or `days` is out of range.
    """
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, subject, key.public_key(), days, None)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _save(cert, key, path, "ca")


def _issue(directory: Path, stem: str, subject: x509.Name, usage: x509.ObjectIdentifier, *, days: int,
           names: list[x509.GeneralName], not_before: datetime.datetime | None) -> Issued:
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(subject, ca_cert.subject, key.public_key(), days, not_before)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _save(builder.sign(ca_key, hashes.SHA256()), key, directory, stem)


def issue_server(directory: str | os.PathLike[str], names: list[str], ips: list[str] | None = None,
                 days: int = SERVER_CERT_DAYS) -> Issued:
    """Issue a server certificate for the host `names[0]` (also valid for the other names and
    the IP addresses `ips`): clients check that the address they dial is one of them.

    Raises:
        InvalidRequestError: no name, a bad name or address, no CA in `directory`.
    """
    if not names:
        raise InvalidRequestError("a server certificate needs at least one host name (--name)")
    alt: list[x509.GeneralName] = [x509.DNSName(_check_name(name, "host name")) for name in names]
    for ip in ips or []:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError:
            raise InvalidRequestError(f"bad IP address {ip!r}") from None
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])])
    return _issue(Path(directory), f"server-{names[0]}", subject, ExtendedKeyUsageOID.SERVER_AUTH, days=days, names=alt,
                  not_before=None)


def issue_user(directory: str | os.PathLike[str], name: str, admin: bool = False, days: int = USER_CERT_DAYS,
               not_before: datetime.datetime | None = None) -> Issued:
    """Issue a client certificate for user `name` (its common name); `admin` adds ADMIN_UNIT.

    Args:
        not_before: start of validity (default: now); tests use it to make expired certificates.

    Raises:
        InvalidRequestError: a bad name, no CA in `directory`.
    """
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, _check_name(name, "user name"))]
    if admin:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ADMIN_UNIT))
    return _issue(Path(directory), f"user-{name}", x509.Name(attributes), ExtendedKeyUsageOID.CLIENT_AUTH, days=days,
                  names=[], not_before=not_before)
