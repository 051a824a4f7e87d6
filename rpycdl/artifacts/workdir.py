"""A job's working directory: packed on the client into a tar archive, named by its SHA-256, kept by the
server in a cache by that name, and unpacked for each job alone.

The archive is deterministic (entries sorted, times, owners and extra mode bits left out), so the same
content always has the same name and is sent once. `.rpycdlignore` at the directory's top leaves files
out (gitignore syntax, through pathspec); `.git/` and `__pycache__/` always are. A client sends only
directories, regular files and symlinks that stay inside; the server trusts nothing it receives: every
member of an archive is checked before anything is written, and nothing is written outside the job's
directory (no absolute names, no `..`, no link out or through a link, no devices, sizes bounded)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import re
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pathspec

from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler.lockdir import shared_dir
from rpycdl.units import format_size

IGNORE_FILE = ".rpycdlignore"
"""What a working directory leaves out, at its top, in gitignore syntax."""

ALWAYS_IGNORED = (".git/", "__pycache__/")

MAX_MEMBERS = 100_000
"""Most entries a working directory may have."""

DIGEST = re.compile(r"[0-9a-f]{64}")
BAD_CHARACTERS = ("\n", "\r", "\0")


@dataclass(frozen=True)
class Packed:
    """A packed working directory: its archive, the archive's SHA-256, its files and their bytes."""

    digest: str
    data: bytes
    files: int
    size: int


def archive_limit(limit: int) -> int:
    """The largest archive of a directory whose files hold `limit` bytes at most: each entry adds its
    header, its padding and, for a long name, an extended header."""
    return limit + MAX_MEMBERS * 4 * tarfile.BLOCKSIZE + 2 * tarfile.RECORDSIZE


def pack(directory: str | os.PathLike[str], limit: int) -> Packed:
    """Pack `directory` for a job, leaving out what its IGNORE_FILE names.

    Raises:
        InvalidRequestError: not a directory, or an entry that cannot be sent (named): a symlink out of
            it, a device, FIFO or socket, a name with a newline.
        LimitError: its files hold more than `limit` bytes, or it has more than MAX_MEMBERS entries.
    """
    root = Path(directory)
    if not root.is_dir():
        raise InvalidRequestError(f"the working directory {str(directory)!r} is not a directory")
    ignored = _ignore_spec(root)
    buffer = io.BytesIO()
    files = size = members = 0
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path, name in _walk(root, ignored):
            members += 1
            info = _member(root, path, name)
            if members > MAX_MEMBERS or size + info.size > limit:
                what = f"more than {MAX_MEMBERS} entries" if members > MAX_MEMBERS else \
                    f"more than {format_size(limit)} of files"
                raise LimitError(f"the working directory {str(directory)!r} holds {what}, over the server's limit "
                                 f"(--max-working-dir {format_size(limit)}): leave files out with {IGNORE_FILE} "
                                 "(gitignore syntax)")
            if info.isreg():
                files, size = files + 1, size + info.size
                with open(path, "rb") as content:
                    archive.addfile(info, content)
            else:
                archive.addfile(info)
    data = buffer.getvalue()
    return Packed(hashlib.sha256(data).hexdigest(), data, files, size)


def _ignore_spec(root: Path) -> pathspec.GitIgnoreSpec:
    lines = list(ALWAYS_IGNORED)
    with contextlib.suppress(FileNotFoundError):
        lines += (root / IGNORE_FILE).read_text().splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _walk(root: Path, ignored: pathspec.GitIgnoreSpec, relative: str = "") -> Iterator[tuple[Path, str]]:
    """(path, name in the archive) of every entry not ignored, sorted, a directory before its content."""
    with os.scandir(root / relative) as listing:
        entries = sorted(listing, key=lambda entry: entry.name)
    for entry in entries:
        name = f"{relative}/{entry.name}" if relative else entry.name
        is_dir = entry.is_dir(follow_symlinks=False)
        if ignored.match_file(f"{name}/" if is_dir else name):
            continue
        yield Path(entry.path), name
        if is_dir:
            yield from _walk(root, ignored, name)


def _member(root: Path, path: Path, name: str) -> tarfile.TarInfo:
    """The archive's entry for `path`, owner, group and time left out; InvalidRequestError if it cannot go."""
    if any(character in name for character in BAD_CHARACTERS):
        raise InvalidRequestError(f"{name!r} in the working directory has a newline or NUL in its name: rename it, "
                                  f"or add it to {IGNORE_FILE}")
    status = path.lstat()
    info = tarfile.TarInfo(name)
    info.mode, info.mtime = stat.S_IMODE(status.st_mode) & 0o777, 0
    if stat.S_ISDIR(status.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISREG(status.st_mode):
        info.size = status.st_size
    elif stat.S_ISLNK(status.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
        if _escapes(name, info.linkname):
            raise InvalidRequestError(f"{name!r} in the working directory is a symlink to {info.linkname!r}, outside "
                                      f"it: copy what it points to into the directory, or add it to {IGNORE_FILE}")
    else:
        raise InvalidRequestError(f"{name!r} in the working directory is not a file, a directory or a symlink (a "
                                  f"device, FIFO or socket): add it to {IGNORE_FILE}")
    return info


def _escapes(name: str, target: str) -> bool:
    """Whether a symlink `name` -> `target` leads out of the directory (read without following links:
    every link is checked so)."""
    if not target or posixpath.isabs(target):
        return True
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    return resolved == ".." or resolved.startswith("../")


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


def _unpack(archive: tarfile.TarFile, dest: Path, limit: int) -> None:
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
            with os.fdopen(fd, "wb") as out, archive.extractfile(member) as content:  # type: ignore[union-attr]
                shutil.copyfileobj(content, out, 1024**2)
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
                    member.issparse() or member.issym() and _escapes(name, member.linkname):
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
        """Keep `data` as the archive `digest` (checked), then evict the least recently used beyond max_bytes.

        Raises:
            InvalidRequestError: `digest` is not a SHA-256, or not that of `data`.
        """
        path = self._path(digest)
        if hashlib.sha256(data).hexdigest() != digest:
            raise InvalidRequestError("the working directory arrived damaged (its SHA-256 differs): send it again")
        temporary = self.root / f".{digest}.{os.getpid()}.tmp"
        with open(temporary, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)  # concurrent puts of one digest write the same bytes
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        entries = []
        for entry in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if DIGEST.fullmatch(entry.name):
                    status = entry.stat()
                    entries.append((status.st_mtime, status.st_size, entry))
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
            archive = tarfile.open(self._path(digest), mode="r:")
        except FileNotFoundError:  # evicted meanwhile
            raise KeyError(digest) from None
        except tarfile.TarError as exc:
            raise InvalidRequestError(f"the working directory's archive is damaged: {exc}") from None
        with archive:
            _unpack(archive, Path(dest), limit)
