"""An untrusted working directory's archive (POSIX tar, as rpycdl.artifacts.workdir writes it) unpacked as
its pieces arrive: each member checked when its header comes, its bytes written straight from the pieces,
symlinks made last.

Nothing received is trusted: no absolute names, no `..`, no link out of the directory or through a link,
nothing but plain files, directories and symlinks, sizes bounded and checked on the header, before any
byte is written. Nothing is written outside the directory, whose owner removes it if the archive is
refused."""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

from rpycdl.artifacts.files import plain_relative, preallocate, start_writeback, write_all
from rpycdl.artifacts.workdir import MAX_MEMBERS, escapes, through_link
from rpycdl.errors import InvalidRequestError

PAX_MAX = 64 * 1024
"""Most bytes of an extended (PAX) header: a long name and a long link target, with room to spare."""

_ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)
_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.DIRTYPE: "dir", tarfile.SYMTYPE: "link"}


@dataclass(frozen=True)
class Member:
    """One checked member: its relative name, kind ("file", "dir" or "link"), permission bits, size in
    bytes (a file's) and target (a link's)."""

    name: str
    kind: str
    mode: int
    size: int = 0
    link: str = ""


def _damaged(why: str) -> InvalidRequestError:
    return InvalidRequestError(f"the working directory's archive is damaged: {why}")


class Unpacker:
    """Unpacks the archive fed to it piece by piece (feed) into the new, empty directory `dest`, at most `limit`
    bytes of files and MAX_MEMBERS entries; finish() checks its end and makes its symlinks. Files and
    directories are made readable by all (0644 or 0755, 0700 while written): the members' own modes are
    for copies (rpycdl.artifacts.workdircache)."""

    def __init__(self, dest: Path, limit: int) -> None:
        self.dest, self.limit = dest, limit
        self.members: list[Member] = []
        self._names: set[str] = set()
        self._total = 0
        self._header = bytearray()
        self._pax: dict[str, str] = {}
        self._pax_data: bytearray | None = None  # an extended header's records, while they come
        self._file: int | None = None  # the file being written
        self._left = 0  # bytes of the current member still to come
        self._padding = 0  # after them, to the next block
        self._ended = False

    def feed(self, piece: memoryview) -> None:
        """Take the next bytes of the archive (valid only during the call)."""
        view = piece
        while view and not self._ended:
            if self._left:
                part, view = view[:self._left], view[self._left:]
                if self._pax_data is not None:
                    self._pax_data += part
                else:
                    write_all(self._file, part)  # type: ignore[arg-type]
                self._left -= len(part)
                if not self._left:
                    self._data_done()
            elif self._padding:
                skipped = min(self._padding, len(view))
                view, self._padding = view[skipped:], self._padding - skipped
            else:
                taken = min(tarfile.BLOCKSIZE - len(self._header), len(view))
                self._header += view[:taken]
                view = view[taken:]
                if len(self._header) == tarfile.BLOCKSIZE:
                    block = bytes(self._header)
                    self._header.clear()
                    self._on_header(block)

    def finish(self) -> list[Member]:
        """Check that the archive ended, make its symlinks (none may lie on another member's way) and
        return its members."""
        if not self._ended:
            raise _damaged("it is cut short")
        links = {member.name for member in self.members if member.kind == "link"}
        for member in self.members:
            parts = member.name.split("/")
            through = next(("/".join(parts[:n]) for n in range(1, len(parts)) if "/".join(parts[:n]) in links), None)
            if through is not None:
                raise InvalidRequestError(f"the working directory's entry {member.name!r} lies through the symlink "
                                          f"{through!r}")
            through = through_link(member.name, member.link, links) if member.kind == "link" else None
            if through is not None:
                raise InvalidRequestError(f"the working directory's symlink {member.name!r} -> {member.link!r} leads "
                                          f"through the symlink {through!r}, which could take it out of the directory")
        for member in self.members:
            if member.kind == "link":
                self._parent(member)
                os.symlink(member.link, self.dest / member.name)
        return self.members

    def close(self) -> None:
        """Close the file being written, if any: after a refusal, `dest` is the caller's to remove."""
        if self._file is not None:
            os.close(self._file)
            self._file = None

    def _on_header(self, block: bytes) -> None:
        if block == _ZERO_BLOCK:
            self._ended = True  # what follows is the end's padding
            return
        try:
            info = tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
        except tarfile.HeaderError as exc:
            raise _damaged(str(exc) or type(exc).__name__) from None
        if info.type == tarfile.XHDTYPE:
            if self._pax or not 0 < info.size <= PAX_MAX:
                raise _damaged("an extended header out of place or too long")
            self._pax_data = bytearray()
            self._start(info.size)
            return
        pax, self._pax = self._pax, {}
        name = pax.get("path", info.name)
        try:
            size = int(pax.get("size", info.size))
        except ValueError:
            raise _damaged(f"{name!r} has no size") from None
        kind, link = _KINDS.get(info.type), pax.get("linkpath", info.linkname)
        if kind is None or any(key.startswith("GNU.sparse") for key in pax) or \
                kind == "link" and escapes(name, link):
            raise InvalidRequestError(f"the working directory's entry {name!r} is not a file, a directory or a "
                                      "symlink within it")
        if kind == "dir":
            name = name.rstrip("/")
        self._add(Member(name, kind, info.mode & 0o777, size if kind == "file" else 0, link if kind == "link" else ""))
        if kind != "file" and size:
            raise _damaged(f"{name!r} is not a file but carries bytes")

    def _add(self, member: Member) -> None:
        name = member.name
        if len(self.members) >= MAX_MEMBERS:
            raise InvalidRequestError(f"the working directory has more than {MAX_MEMBERS} entries")
        if not plain_relative(name):
            raise InvalidRequestError(f"the working directory's entry {name!r} is not a plain relative name")
        if name in self._names:
            raise InvalidRequestError(f"the working directory's entry {name!r} appears twice")
        self._total += member.size
        if self._total > self.limit:
            raise InvalidRequestError(f"the working directory's files pass {self.limit} bytes at {name!r}")
        self._names.add(name)
        self.members.append(member)
        try:
            if member.kind == "dir":
                (self.dest / name).mkdir(mode=0o755, parents=True, exist_ok=True)
            elif member.kind == "file":
                self._parent(member)
                self._file = os.open(self.dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                preallocate(self._file, member.size)
                self._start(member.size)
        except (FileExistsError, NotADirectoryError):
            raise InvalidRequestError(f"the working directory's entry {name!r} collides with another") from None

    def _parent(self, member: Member) -> None:
        (self.dest / member.name).parent.mkdir(mode=0o755, parents=True, exist_ok=True)

    def _start(self, size: int) -> None:
        self._left, self._padding = size, -size % tarfile.BLOCKSIZE
        if not size:
            self._data_done()

    def _data_done(self) -> None:
        if self._pax_data is not None:
            self._pax, self._pax_data = _pax_records(bytes(self._pax_data)), None
        elif self._file is not None:
            os.fchmod(self._file, 0o755 if self.members[-1].mode & 0o111 else 0o644)
            start_writeback(self._file)
            self.close()


def _pax_records(data: bytes) -> dict[str, str]:
    """An extended header's records ("<length> <key>=<value>\\n" each), as text."""
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        space = data.find(b" ", position)
        try:
            length = int(data[position:space]) if space > position else 0
        except ValueError:
            length = 0
        record = data[space + 1:position + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise _damaged("an extended header's record is malformed")
        key, value = record[:-1].split(b"=", 1)
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records

