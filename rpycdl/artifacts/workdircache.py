"""The server's side of working directories: untrusted archives checked member by member and unpacked for
each job alone, and the cache of archives by content (SHA-256), filled as they arrive.

Nothing received is trusted: every member of an archive is checked before anything is written, and
nothing is written outside the job's directory (no absolute names, no `..`, no link out or through a
link, no devices, sizes bounded). A cached archive's files reach a job's directory copied in the kernel
(rpycdl.artifacts.files.copy_range), straight from the archive."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import re
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from rpycdl.artifacts.files import copy_range, preallocate
from rpycdl.artifacts.workdir import BAD_CHARACTERS, MAX_MEMBERS, escapes
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.lockdir import shared_dir

DIGEST = re.compile(r"[0-9a-f]{64}")

STALE = 3600.0
"""Seconds after which an archive left half received (its receiver killed) is removed."""

Sink = Callable[[memoryview], None]


def archive_limit(limit: int) -> int:
    """The largest archive of a directory whose files hold `limit` bytes at most: each entry adds its
    header, its padding and, for a long name, an extended header."""
    return limit + MAX_MEMBERS * 4 * tarfile.BLOCKSIZE + 2 * tarfile.RECORDSIZE


def unpack(data: bytes | memoryview, dest: str | os.PathLike[str], limit: int) -> None:
    """Unpack an untrusted archive into the empty directory `dest`, after checking every member.

    Raises:
        InvalidRequestError: a member that could write outside `dest` or is not a plain file, directory or
            symlink within it, named; a damaged archive; files over `limit` bytes, or over MAX_MEMBERS.
    """
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as exc:
        raise InvalidRequestError(f"the working directory's archive is damaged: {exc}") from None
    with archive:
        _unpack(archive, Path(dest), limit)


def _unpack(archive: tarfile.TarFile, dest: Path, limit: int, source: int | None = None) -> None:
    """unpack() `archive`: its files copied from it, or in the kernel from the archive file `source`."""
    if any(dest.iterdir()):
        raise InvalidRequestError(f"{dest} is not empty: a working directory is unpacked into an empty one")
    members = _checked(archive, limit)
    for member in members:  # directories and files; a link only at the end, when nothing can go through it
        target = dest / member.name
        if member.isdir():
            target.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif member.isreg():
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                if source is None:
                    with archive.extractfile(member) as content:  # type: ignore[union-attr]
                        shutil.copyfileobj(content, out, 1024**2)
                elif copy_range(source, fd, member.size, member.offset_data) != member.size:
                    raise InvalidRequestError(f"the working directory's archive is damaged: {member.name!r} is cut "
                                              "short")
            os.chmod(target, member.mode & 0o777)
    for member in members:
        if member.issym():
            (dest / member.name).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.symlink(member.linkname, dest / member.name)
    for member in reversed(members):  # the directories' modes last: writable meanwhile, and by their owner after
        if member.isdir():
            os.chmod(dest / member.name, member.mode & 0o777 | 0o700)


def _checked(archive: tarfile.TarFile, limit: int) -> list[tarfile.TarInfo]:
    """Every member, checked before anything is written (see unpack)."""
    members: list[tarfile.TarInfo] = []
    names: set[str] = set()
    total = 0
    try:
        for member in archive:
            name = member.name
            if len(members) >= MAX_MEMBERS:
                raise InvalidRequestError(f"the working directory has more than {MAX_MEMBERS} entries")
            if any(character in name for character in BAD_CHARACTERS) or posixpath.isabs(name) or \
                    name in ("", ".") or posixpath.normpath(name) != name or ".." in name.split("/"):
                raise InvalidRequestError(f"the working directory's entry {name!r} is not a plain relative name")
            if name in names:
                raise InvalidRequestError(f"the working directory's entry {name!r} appears twice")
            if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE) or \
                    member.issparse() or member.issym() and escapes(name, member.linkname):
                raise InvalidRequestError(f"the working directory's entry {name!r} is not a file, a directory or "
                                          "a symlink within it")
            total += member.size if member.isreg() else 0
            if total > limit:
                raise InvalidRequestError(f"the working directory's files pass {limit} bytes at {name!r}")
            names.add(name)
            members.append(member)
    except tarfile.TarError as exc:
        raise InvalidRequestError(f"the working directory's archive is damaged: {exc}") from None
    links = {member.name for member in members if member.issym()}
    for member in members:
        parts = member.name.split("/")
        through = next(("/".join(parts[:n]) for n in range(1, len(parts)) if "/".join(parts[:n]) in links), None)
        if through is not None:
            raise InvalidRequestError(f"the working directory's entry {member.name!r} lies through the symlink "
                                      f"{through!r}")
    return members


class WorkdirCache:
    """Archives by digest in `root` (created shared, as the state directory is), at most `max_bytes` in all:
    adding one evicts the least recently used others (a use touches its file)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        shared_dir(self.root)

    def _path(self, digest: str) -> Path:
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise InvalidRequestError(f"not a working directory's SHA-256: {digest!r}")
        return self.root / digest

    def has(self, digest: str) -> bool:
        """Whether the archive `digest` is here (then marked used); False for anything not a digest."""
        try:
            path = self._path(digest)
            os.utime(path)
        except (InvalidRequestError, FileNotFoundError):
            return False
        except PermissionError:  # another user's file: it is there all the same
            return path.exists()
        return True

    def put(self, digest: str, data: bytes | memoryview) -> None:
        """Keep `data` as the archive `digest` (checked); see receive()."""
        self.receive(lambda sink: sink(memoryview(data)), len(data), digest)

    def receive(self, fill: Callable[[Sink], None], size: int, digest: str | None = None) -> str:
        """Keep the archive of `size` bytes that `fill(sink)` hands to `sink` piece by piece, hashed and
        written as it comes (one pass, bounded memory), then evict the least recently used beyond max_bytes.
        Returns its digest.

        Raises:
            InvalidRequestError: `digest` was given and is not a SHA-256, or not that of the archive.
        """
        if digest is not None:
            self._path(digest)
        hashed = hashlib.sha256()
        temporary = self.root / f".{os.getpid()}.{secrets.token_hex(8)}.tmp"
        try:
            with open(temporary, "wb", buffering=0) as out:
                preallocate(out.fileno(), size)

                def sink(piece: memoryview) -> None:
                    hashed.update(piece)
                    out.write(piece)

                fill(sink)
            if digest is not None and hashed.hexdigest() != digest:
                raise InvalidRequestError("the working directory arrived damaged (its SHA-256 differs): send it again")
            path = self._path(hashed.hexdigest())
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)  # concurrent puts of one digest write the same bytes
        finally:
            temporary.unlink(missing_ok=True)
        self._evict(keep=path)
        return path.name

    def _evict(self, keep: Path) -> None:
        entries = []
        for entry in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                status = entry.stat()
                if DIGEST.fullmatch(entry.name):
                    entries.append((status.st_mtime, status.st_size, entry))
                elif entry.name.endswith(".tmp") and status.st_mtime < time.time() - STALE:
                    entry.unlink()  # its receiver was killed
        total = sum(size for _, size, _ in entries)
        for _, size, entry in sorted(entries):
            if total <= self.max_bytes:
                break
            if entry != keep:
                entry.unlink(missing_ok=True)
                total -= size

    def unpack(self, digest: str, dest: str | os.PathLike[str], limit: int) -> None:
        """unpack() the archive `digest` into `dest`; KeyError if it is not here (never was, or evicted)."""
        if not self.has(digest):
            raise KeyError(digest)
        try:
            file = open(self._path(digest), "rb")  # noqa: SIM115 - closed below, with the archive
        except FileNotFoundError:  # evicted meanwhile
            raise KeyError(digest) from None
        with file:
            try:
                archive = tarfile.open(fileobj=file, mode="r:")
            except tarfile.TarError as exc:
                raise InvalidRequestError(f"the working directory's archive is damaged: {exc}") from None
            with archive:
                _unpack(archive, Path(dest), limit, file.fileno())
