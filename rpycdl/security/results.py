"""Sealed results: a detached job's result file carries an HMAC under a key only its client and its supervisor
hold, so that a client unpickles a result only if the job's own supervisor wrote it.

The client holds one secret of its own, 32 random bytes in its result key file (`client_secret`: made mode
600 on first need, beside its credentials file). At each submit it sends a `Seal`: a fresh nonce, the key id
(a fingerprint of its secret, so that a client can tell whether it holds the secret a job was sealed for) and
the job's key K = HMAC-SHA256(secret, "rpycdl result key" + nonce). The server keeps the nonce and the key id
in the job's ledger row, and K in the job's directory, in a file root alone reads (`write_job_key`, mode 600,
never the ledger nor the group-readable files); the supervisor seals the job's outcome with it (`seal`) and
removes it at the job's end. The result file is then

    MAGIC (8 bytes: "RPYCDLR1", the format's version) | MAC (32 bytes) | the outcome (wire.codec)

where MAC = HMAC-SHA256(K, MAGIC + job id + NUL + outcome): bound to its job, so that a sealed result moved
to another job of the same client fails too. The client derives K again from its secret and the row's nonce
and checks the MAC before anything of the outcome is unpickled (`open_sealed`)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rpycdl.errors import InvalidRequestError, ResultIntegrityError

MAGIC = b"RPYCDLR1"
"""The first bytes of a sealed result file: the format and its version."""

MAC_SIZE = hashlib.sha256().digest_size
HEADER = len(MAGIC) + MAC_SIZE
"""Bytes before the outcome in a sealed result file."""

SECRET_SIZE = 32
NONCE_SIZE = 16
KEY_ID_SIZE = 8
"""Bytes of a client's secret, of a job's nonce, and of the fingerprint of a secret (its key id)."""

KEY_FILE = "result.key"
"""A job's key, in its directory (mode 600), from its submit to its end."""


@dataclass(frozen=True)
class Seal:
    """What a client gives a job at submit so that its result can be verified: the nonce and key id (hex,
    kept in the job's ledger row) and the job's key (kept where root alone reads it)."""

    nonce: str
    key_id: str
    key: bytes

    def sent(self) -> tuple[str, str, bytes]:
        """The seal as a submit request carries it (a tuple: RPyC passes it by value)."""
        return self.nonce, self.key_id, self.key


def key_id(secret: bytes) -> str:
    """The fingerprint of a client's secret (hex): says which secret sealed a job, and tells nothing of it."""
    return hashlib.sha256(b"rpycdl result key id\0" + secret).digest()[:KEY_ID_SIZE].hex()


def job_key(secret: bytes, nonce: str) -> bytes:
    """The key of the job whose row holds `nonce`, as the client derives it from its secret."""
    return hmac.new(secret, b"rpycdl result key\0" + bytes.fromhex(nonce), hashlib.sha256).digest()


def new_seal(secret: bytes) -> Seal:
    """A seal for a new job: a fresh nonce, and the key derived from it."""
    nonce = secrets.token_hex(NONCE_SIZE)
    return Seal(nonce, key_id(secret), job_key(secret, nonce))


def check_seal(value: Any) -> Seal | None:
    """The seal a submit request carries (Seal.sent), checked; None if it carries none.

    Raises:
        InvalidRequestError: it is not one.
    """
    if value is None:
        return None
    try:
        nonce, fingerprint, key = value
        if not (isinstance(key, bytes) and len(key) == MAC_SIZE and len(bytes.fromhex(nonce)) == NONCE_SIZE
                and len(bytes.fromhex(fingerprint)) == KEY_ID_SIZE):
            raise ValueError(value)
    except (TypeError, ValueError):
        raise InvalidRequestError("a submit's seal is (nonce, key id, key): hex strings of "
                                  f"{NONCE_SIZE} and {KEY_ID_SIZE} bytes, and {MAC_SIZE} bytes") from None
    return Seal(nonce.lower(), fingerprint.lower(), key)


def _mac(key: bytes, job_id: str, outcome: bytes | memoryview) -> bytes:
    mac = hmac.new(key, MAGIC + job_id.encode() + b"\0", hashlib.sha256)
    mac.update(outcome)
    return mac.digest()


def seal(key: bytes, job_id: str, outcome: bytes) -> bytes:
    """The result file of job `job_id` holding `outcome`, sealed with the job's `key`."""
    return MAGIC + _mac(key, job_id, outcome) + outcome


def is_sealed(data: bytes) -> bool:
    """Whether `data` has the form of a sealed result (nothing is verified)."""
    return data[:len(MAGIC)] == MAGIC and len(data) >= HEADER


def open_sealed(key: bytes, job_id: str, data: bytes) -> memoryview:
    """The outcome in the sealed result file `data` of job `job_id`, once its MAC under `key` is verified.

    Raises:
        ResultIntegrityError: the file has no seal, or another one: the job did not write it.
    """
    view = memoryview(data)
    if not is_sealed(data) or not hmac.compare_digest(view[len(MAGIC):HEADER], _mac(key, job_id, view[HEADER:])):
        raise ResultIntegrityError(
            f"job {job_id}'s result was not written by the job: the result file on the server "
            f"{'has a seal that does not match' if is_sealed(data) else 'has no seal of'} the key this client gave "
            "the job at submit, so it was replaced or changed there. Nothing of it was unpickled. Tell the server's "
            "operator; result(verify=False) would unpickle it all the same, which runs whatever code it holds")
    return view[HEADER:]


def unverified(data: bytes) -> bytes:
    """The outcome in a result file, its seal (if it has one) left unverified: for clients that do not verify."""
    return data[HEADER:] if is_sealed(data) else data


# -- the client's secret -----------------------------------------------------------------------------


def client_secret(path: Path) -> bytes:
    """The client's secret in its result key file `path` (64 hex digits), made on first need: random, mode 600,
    written aside and linked into place, so that of two clients making it at once both read the one that won.

    Raises:
        InvalidRequestError: the file cannot be made or read, or is not the user's own (other users may read
            or write it, or it is a link).
    """
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    try:
        _make_secret(path)
    except OSError as exc:
        raise InvalidRequestError(f"cannot make this client's result key {path}: {exc.strerror or exc}: set result_key "
                                  "in the credentials file (or RPYCDL_RESULT_KEY) to a path of yours") from None
    return _read_secret(path)


def _make_secret(path: Path) -> None:
    """Make the result key file `path`, unless another process makes it first: a new secret written aside (mode
    600) and linked into place, which fails if the name is taken (whole, so that nobody reads a part of it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, aside = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 600
    try:
        with open(fd, "w") as out:
            out.write(secrets.token_hex(SECRET_SIZE) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another client made it first: its secret is the one
            os.link(aside, path)
    finally:
        os.unlink(aside)


def _read_secret(path: Path) -> bytes:
    """The secret in the result key file `path`, checked: a regular file of this user's, for this user alone.

    Raises:
        FileNotFoundError: there is none.
        InvalidRequestError: it cannot be read, or is not one.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InvalidRequestError(f"cannot read this client's result key {path}: {exc.strerror or exc} (a link is "
                                  "not followed)") from None
    with open(fd, "rb") as key_file:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o077:
            raise InvalidRequestError(f"this client's result key {path} must be a file of yours that only you can "
                                      f"read and write (chmod 600 {path})")
        text = key_file.read(4 * SECRET_SIZE).strip()
    try:
        secret = bytes.fromhex(text.decode())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != SECRET_SIZE:
        raise InvalidRequestError(f"this client's result key {path} does not hold {2 * SECRET_SIZE} hex digits: "
                                  "remove it to make a new one (results of jobs sealed with it can then only be "
                                  "read unverified)")
    return secret


# -- the job's key, on the server ----------------------------------------------------------------------


def write_job_key(directory: Path, key: bytes) -> None:
    """Keep a job's key in its `directory` (a new one, which only this process's account writes), in a file
    this account alone reads: opened from the directory's descriptor, following no link, made new (O_EXCL)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, key)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def read_job_key(directory: Path, job_id: str) -> bytes:
    """The key kept in a job's `directory` by write_job_key, read following no link.

    Raises:
        ResultIntegrityError: there is none, or it is not the one this account wrote (another owner, a mode
            that lets others in, not a key's size).
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with open(fd, "rb") as key_file:
            found = os.fstat(fd)
            key = key_file.read(MAC_SIZE + 1)
    except OSError as exc:
        raise ResultIntegrityError(f"job {job_id}'s result cannot be sealed: its key is not there "
                                   f"({exc.strerror or exc}): its result is not kept") from None
    if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid() or found.st_mode & 0o077 or len(key) != MAC_SIZE:
        raise ResultIntegrityError(f"job {job_id}'s result cannot be sealed: its key file is not the one its submit "
                                   "wrote (changed on the server): its result is not kept")
    return key


def drop_job_key(directory: Path) -> None:
    """Remove a job's key from its `directory` (its result is sealed, or it will have none), following no link."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.unlink(KEY_FILE, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
