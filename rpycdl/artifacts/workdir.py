"""A job's working directory as the client packs it: a tar archive streamed to the server, each file read
once; the server names it by its content hash (BLAKE3), keeps it in a cache by that name and copies it for each job
alone (rpycdl.artifacts.workdircache).

The archive is deterministic (entries sorted, times, owners and extra mode bits left out), so the same
content always has the same name, and a server keeps it once whoever sent it. `.rpycdlignore` at the
directory's top leaves files out (gitignore syntax, through pathspec); `.git/` and `__pycache__/` always
are. A client sends only directories, regular files and symlinks that stay inside; the server trusts
nothing it receives: every member of an archive is checked before anything is written, and nothing is
written outside the job's directory (no absolute names, no `..`, no link out or through a link, no
devices, sizes bounded)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import posixpath
import stat
import tarfile
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import pathspec

from rpycdl.artifacts.files import BAD_CHARACTERS, Identity, identity
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.units import format_size

IGNORE_FILE = ".rpycdlignore"
"""What a working directory leaves out, at its top, in gitignore syntax."""

ALWAYS_IGNORED = (".git/", "__pycache__/")

MAX_MEMBERS = 100_000
"""Most entries a working directory may have."""

PIECE = 1024**2
"""Bytes read, hashed and sent at a time: one buffer, reused, small enough to stay in the CPU's caches."""

_ZEROS = memoryview(bytes(tarfile.RECORDSIZE))


def content_hash(data: bytes = b"") -> blake3.blake3:
    """A new hash of the kind that names content here, of `data` so far: BLAKE3, 256 bits, cryptographic (a
    name a cache may trust: nobody can make other content of the same name), five times SHA-256's speed on
    one core."""
    return blake3.blake3(data)


@dataclass(frozen=True)
class Entry:
    """One entry of a working directory's archive: its name and tar header; for a regular file, its path
    here, its size and its identity when it was scanned (files.Identity)."""

    name: str
    header: bytes
    path: str = ""
    size: int = 0
    identity: Identity | None = None


@dataclass(frozen=True)
class Scan:
    """A working directory as it will be packed (scan()): its entries in order, the archive's size in
    bytes, its files and their bytes, and when the scan began (time.time_ns()). Nothing of the files'
    content is read until stream()."""

    root: str
    entries: tuple[Entry, ...]
    size: int
    files: int
    content: int
    scanned_ns: int

    def key(self) -> str:
        """What stays the same while the directory does: its names, headers (types, modes, sizes, link
        targets) and files' identities, hashed."""
        digest = content_hash()
        for entry in self.entries:
            digest.update(entry.header + repr(entry.identity).encode())
        return digest.hexdigest()

    def changed_since(self, moment_ns: int) -> list[str]:
        """The files whose content or status changed at or after `moment_ns` (by their mtime and ctime)."""
        return [entry.name for entry in self.entries if entry.identity is not None
                and max(entry.identity[4], entry.identity[5]) >= moment_ns]

    def digests(self, names: Collection[str]) -> dict[str, str | None]:
        """The content hash (hex) of each file of `names`, read again; None for one that is no longer
        as scanned."""
        buffer, found = memoryview(bytearray(PIECE)), {}
        for entry in self.entries:
            if entry.name in names and entry.identity is not None:
                own = content_hash()
                intact = _read_file(entry, buffer, own.update)[1]
                found[entry.name] = own.hexdigest() if intact else None
        return found

    def stream(self, sink: Callable[[memoryview], None], apart: Collection[str] = ()) -> dict[str, str]:
        """Write the archive to `sink` piece by piece (a piece is valid only during the call), each file read
        once; returns the content hash (hex) of each file named in `apart`. Whoever keeps the
        archive hashes it (the server, as it arrives): nothing else is hashed here.

        Raises:
            InvalidRequestError: a file changed or went while it was read (named); the archive was written
                whole all the same, the rest of such a file as zeros, so that a stream stays in step.
        """
        apart_digests, changed = {}, []
        buffer = memoryview(bytearray(PIECE))

        def put(piece: memoryview, also: Any = None) -> None:
            if also is not None:
                also.update(piece)
            sink(piece)

        for entry in self.entries:
            sink(memoryview(entry.header))
            if entry.identity is None:
                continue
            own = content_hash() if entry.name in apart else None
            done, intact = _read_file(entry, buffer, functools.partial(put, also=own))
            if not intact:
                changed.append(entry.name)
            _zeros(sink, entry.size - done + -entry.size % tarfile.BLOCKSIZE)
            if own is not None:
                apart_digests[entry.name] = own.hexdigest()
        _zeros(sink, self.size - sum(len(e.header) + e.size + -e.size % tarfile.BLOCKSIZE for e in self.entries))
        if changed:
            raise InvalidRequestError(f"{changed[0]!r} in the working directory changed while it was packed"
                                      f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}: try again")
        return apart_digests


@dataclass(frozen=True)
class Packed:
    """A packed working directory: its archive, the archive's content hash, its files and their bytes."""

    digest: str
    data: bytes
    files: int
    size: int


def scan(directory: str | os.PathLike[str], limit: int) -> Scan:
    """What packing `directory` for a job will send, leaving out what its IGNORE_FILE names: every entry
    checked and its header made, no file read.

    Raises:
        InvalidRequestError: not a directory, or an entry that cannot be sent (named): a symlink out of
            it, a device, FIFO or socket, a name with a newline.
        LimitError: its files hold more than `limit` bytes, or it has more than MAX_MEMBERS entries.
    """
    started = time.time_ns()
    root = Path(directory)
    if not root.is_dir():
        raise InvalidRequestError(f"the working directory {str(directory)!r} is not a directory")
    ignored = _ignore_spec(root)
    entries: list[Entry] = []
    files = content = 0
    for path, name in _walk(root, ignored):
        info, status = _member(path, name)
        if len(entries) >= MAX_MEMBERS or content + info.size > limit:
            what = f"more than {MAX_MEMBERS} entries" if len(entries) >= MAX_MEMBERS else \
                f"more than {format_size(limit)} of files"
            raise LimitError(f"the working directory {str(directory)!r} holds {what}, over the server's limit "
                             f"(--max-working-dir {format_size(limit)}): leave files out with {IGNORE_FILE} "
                             "(gitignore syntax)")
        header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")  # as tarfile writes it
        if info.isreg():
            files, content = files + 1, content + info.size
            entries.append(Entry(name, header, str(path), info.size, identity(status)))
        else:
            entries.append(Entry(name, header))
    size = sum(len(entry.header) + entry.size + -entry.size % tarfile.BLOCKSIZE for entry in entries)
    size += 2 * tarfile.BLOCKSIZE  # the end of the archive, then padding to a whole record
    return Scan(str(root), tuple(entries), size + -size % tarfile.RECORDSIZE, files, content, started)


def pack(directory: str | os.PathLike[str], limit: int) -> Packed:
    """Pack `directory` for a job into memory (scan(), then Scan.stream()); raises as they do."""
    scanned = scan(directory, limit)
    buffer = io.BytesIO()
    scanned.stream(buffer.write)
    data = buffer.getvalue()
    return Packed(content_hash(data).hexdigest(), data, scanned.files, scanned.content)


def _read_file(entry: Entry, buffer: memoryview, put: Callable[[memoryview], None]) -> tuple[int, bool]:
    """Hand the content of the file `entry` to `put` through `buffer`, up to its scanned size; returns the
    bytes read, and whether the file is still the one scanned (not changed, gone, or now a link)."""
    done = 0
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return 0, False
    try:
        if identity(os.fstat(fd)) != entry.identity:
            return 0, False
        while done < entry.size:
            got = os.readv(fd, [buffer[:min(len(buffer), entry.size - done)]])
            if not got:
                break
            put(buffer[:got])
            done += got
        return done, done == entry.size and identity(os.fstat(fd)) == entry.identity
    finally:
        os.close(fd)


def _zeros(put: Callable[[memoryview], None], count: int) -> None:
    while count > 0:
        put(_ZEROS[:min(count, len(_ZEROS))])
        count -= len(_ZEROS)


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


def _member(path: Path, name: str) -> tuple[tarfile.TarInfo, os.stat_result]:
    """The archive's entry for `path` (owner, group and time left out) and its status; InvalidRequestError if
    it cannot go."""
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
        if escapes(name, info.linkname):
            raise InvalidRequestError(f"{name!r} in the working directory is a symlink to {info.linkname!r}, outside "
                                      f"it: copy what it points to into the directory, or add it to {IGNORE_FILE}")
    else:
        raise InvalidRequestError(f"{name!r} in the working directory is not a file, a directory or a symlink (a "
                                  f"device, FIFO or socket): add it to {IGNORE_FILE}")
    return info, status


def escapes(name: str, target: str) -> bool:
    """Whether a symlink `name` -> `target` leads out of the directory (read without following links:
    every link is checked so)."""
    if not target or posixpath.isabs(target):
        return True
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    return resolved == ".." or resolved.startswith("../")


def through_link(name: str, target: str, links: Collection[str]) -> str | None:
    """The symlink among `links` (their names in the directory) that the target of the symlink `name` passes
    through before its last component, if any (`up -> c/..` with `c -> .`): escapes() reads a target as
    written, so a target may go through no other link, whose own target would move it."""
    parts = [part for part in posixpath.dirname(name).split("/") if part]
    for component in [part for part in target.split("/") if part not in ("", ".")][:-1]:
        if component == "..":
            parts = parts[:-1]
            continue
        parts.append(component)
        if "/".join(parts) in links:
            return "/".join(parts)
    return None
