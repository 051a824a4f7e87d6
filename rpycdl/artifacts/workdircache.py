"""The server's cache of working directories by content (workdir.content_hash): each unpacked once as it arrives
(rpycdl.artifacts.untar, which trusts nothing it receives), then cloned for each job alone.

An entry is a directory named by the digest of the archive it came from: `tree/` (the files, readable
by all) and `members.json` (the checked members, with their own modes). A job's
copy is made from them file by file with rpycdl.artifacts.files.clone: on a filesystem with reflinks
(XFS, btrfs) it shares the cache's blocks until the job writes, and costs milliseconds whatever the size;
elsewhere (ext4) it is a copy in the kernel. A copy holds its entry with a shared flock, which an
eviction must take exclusively, so an entry is never removed under a copy; a receiver holds its
temporary entry exclusively, so that the next eviction removes what a killed receiver left.

An entry serves only the users who sent its content: each receiver's user leaves a marker beside the cache,
in `<root>.senders/` (`<digest>.<hash of the user>`), and `has` answers for one user. A digest alone (anyone
can guess at one, or see one go by) opens nobody else's files; another user with the same content sends it
once too (it is unpacked again, and the entry kept as it was). A marker whose entry is gone is removed after
SENDER_KEEP."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rpycdl.artifacts.files import clone
from rpycdl.artifacts.untar import Member, Unpacker
from rpycdl.artifacts.workdir import MAX_MEMBERS, content_hash
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.lockdir import shared_dir

DIGEST = re.compile(r"[0-9a-f]{64}")

MEMBERS = "members.json"

SENDERS = ".senders"
"""The suffix of the folder beside the cache where a marker says who sent an entry's content."""

SENDER_KEEP = 24 * 3600.0
"""Seconds a marker outlives its entry (an entry evicted and sent again soon finds its senders still there)."""

Sink = Callable[[memoryview], None]


def archive_limit(limit: int) -> int:
    """The largest archive of a directory whose files hold `limit` bytes at most: each entry adds its
    header, its padding and, for a long name, an extended header."""
    return limit + MAX_MEMBERS * 4 * tarfile.BLOCKSIZE + 2 * tarfile.RECORDSIZE


class WorkdirCache:
    """Working directories by digest in `root` (created shared, as the state directory is), at most
    `max_bytes` of files in all: adding one evicts the least recently used others not being copied (a use
    touches its members.json)."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.senders = self.root.with_name(self.root.name + SENDERS)
        shared_dir(self.root)
        shared_dir(self.senders)

    def _path(self, digest: str) -> Path:
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise InvalidRequestError(f"not a working directory's content hash: {digest!r}")
        return self.root / digest

    def has(self, digest: str, sender: str) -> bool:
        """Whether the working directory `digest` is here and `sender` (a user, as the server names them) sent
        its content (then both are marked used); False for anything not a digest."""
        try:
            self._path(digest)
        except InvalidRequestError:
            return False
        return _touch(self._marker(digest, sender)) and _touch(self.root / digest / MEMBERS)

    def _marker(self, digest: str, sender: str) -> Path:
        return self.senders / f"{digest}.{hashlib.sha256(sender.encode()).hexdigest()[:32]}"

    def put(self, digest: str, data: bytes | memoryview, limit: int, sender: str | None = None) -> None:
        """Keep the archive `data`, checked against `digest`, as sent by `sender`; see receive()."""
        self.receive(lambda sink: sink(memoryview(data)), limit, digest, sender)

    def receive(self, fill: Callable[[Sink], None], limit: int, digest: str | None = None,
                sender: str | None = None) -> str:
        """Keep the archive that `fill(sink)` hands to `sink` piece by piece, hashed and unpacked as it
        comes (one pass, bounded memory; at most `limit` bytes of files), as sent by `sender` (None: by
        nobody `has` answers for), then evict the least recently used beyond max_bytes. Returns its digest.

        Raises:
            InvalidRequestError: `digest` was given and is not a content hash, or not that of the archive; the
                archive is refused (rpycdl.artifacts.untar: nothing of it is kept).
        """
        if digest is not None:
            self._path(digest)
        hashed = content_hash()
        temporary, held = self._new_entry()
        (temporary / "tree").mkdir(mode=0o755)
        unpacker = Unpacker(temporary / "tree", limit)
        try:
            def sink(piece: memoryview) -> None:
                hashed.update(piece)
                unpacker.feed(piece)

            fill(sink)
            members = unpacker.finish()
            if digest is not None and hashed.hexdigest() != digest:
                raise InvalidRequestError("the working directory arrived damaged (its content hash differs): send it "
                                          "again")
            path = self._path(hashed.hexdigest())
            (temporary / MEMBERS).write_text(json.dumps([vars(member) for member in members]))
            self._place(temporary, path, sender)
        finally:
            unpacker.close()
            shutil.rmtree(temporary, ignore_errors=True)
            os.close(held)
        self._evict(keep=path)
        return path.name

    def _place(self, temporary: Path, path: Path, sender: str | None) -> None:
        """Put the filled entry `temporary` in place as `path`, unless an entry of the same content is there
        already (the same files), and mark `sender` as one who sent it while the entry is there."""
        while True:
            try:
                os.rename(temporary, path)
            except OSError as exc:  # another receiver of the same digest was first
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                try:
                    with self._held(path.name):  # not evicted while it is marked
                        if sender is not None:
                            _mark(self._marker(path.name, sender))
                    return
                except KeyError:
                    continue  # evicted in the meantime: ours takes its place
            if sender is not None:
                _mark(self._marker(path.name, sender))
            return

    def _new_entry(self) -> tuple[Path, int]:
        """A new temporary entry and a descriptor holding it exclusively while it is filled: an eviction
        removes a temporary entry that nobody holds (its receiver died) at once."""
        while True:  # again if an eviction took it for a dead receiver's in the moment before it was held
            temporary = self.root / f".{secrets.token_hex(8)}.tmp"
            temporary.mkdir(mode=0o755)
            try:
                held = _open_dir(temporary)
            except FileNotFoundError:
                continue
            fcntl.flock(held, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(temporary).st_ino == os.fstat(held).st_ino:
                    return temporary, held
            os.close(held)

    @contextlib.contextmanager
    def _held(self, digest: str) -> Iterator[tuple[Path, list[Member]]]:
        """The entry `digest` and its members, held by a shared flock; KeyError if it is not here (never was,
        or evicted)."""
        path = self._path(digest)
        try:
            fd = _open_dir(path)
        except FileNotFoundError:
            raise KeyError(digest) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:  # still the entry, not one an eviction renamed away while we waited
                if os.stat(path).st_ino != os.fstat(fd).st_ino:
                    raise KeyError(digest)
                members = _members(path)
                with contextlib.suppress(PermissionError):
                    os.utime(path / MEMBERS)
            except FileNotFoundError:
                raise KeyError(digest) from None
            yield path, members
        finally:
            os.close(fd)

    def unpack(self, digest: str, dest: str | os.PathLike[str], limit: int) -> None:
        """Copy the working directory `digest` into the empty directory `dest`, with its members' modes
        (cloned where the filesystem can); KeyError if it is not here (never was, or evicted).

        Raises:
            InvalidRequestError: its files hold more than `limit` bytes (another server's cache limit).
        """
        dest = Path(dest)
        if any(dest.iterdir()):
            raise InvalidRequestError(f"{dest} is not empty: a working directory is unpacked into an empty one")
        with self._held(digest) as (path, members):
            _check_limit(members, limit)
            _copy_tree(path / "tree", members, dest)

    def keep(self, digest: str, dest: str | os.PathLike[str], limit: int) -> None:
        """Copy the entry `digest` as it is (its tree and members) into the new directory `dest`, the server's own,
        from which unpack_kept makes copies however long after, whatever the cache evicts meanwhile (an array's
        working directory: stored once for all its elements); KeyError if it is not here.

        Raises:
            InvalidRequestError: its files hold more than `limit` bytes.
        """
        dest = Path(dest)
        with self._held(digest) as (path, members):
            _check_limit(members, limit)
            dest.mkdir(mode=0o700)
            shutil.copytree(path / "tree", dest / "tree", symlinks=True)  # as the cache keeps it: readable
            shutil.copyfile(path / MEMBERS, dest / MEMBERS)

    def _evict(self, keep: Path) -> None:
        entries = []
        for entry in self.root.iterdir():
            with contextlib.suppress(OSError, ValueError, TypeError):
                if DIGEST.fullmatch(entry.name) and not entry.is_dir():
                    entry.unlink()  # an archive an older rpycdl kept
                elif DIGEST.fullmatch(entry.name):
                    size = sum(member.size for member in _members(entry))
                    entries.append(((entry / MEMBERS).stat().st_mtime, size, entry))
                elif entry.name.endswith(".gone"):
                    shutil.rmtree(entry)  # its remover was killed
                elif entry.name.endswith(".tmp"):
                    self._remove(entry)  # unless its receiver lives (and holds it)
        total = sum(size for _, size, _ in entries)
        for _, size, entry in sorted(entries):
            if total <= self.max_bytes:
                break
            if entry != keep and self._remove(entry):
                total -= size
        self._forget_senders()

    def _forget_senders(self) -> None:
        """Remove the markers of entries gone for SENDER_KEEP."""
        old = time.time() - SENDER_KEEP
        for marker in self.senders.iterdir():
            with contextlib.suppress(OSError):
                if marker.stat().st_mtime < old and not (self.root / marker.name.partition(".")[0]).exists():
                    marker.unlink()

    def _remove(self, entry: Path) -> bool:
        """Remove `entry` unless a copy or its receiver holds it; whether it went."""
        try:
            fd = _open_dir(entry)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            gone = self.root / f".{secrets.token_hex(8)}.gone"
            os.rename(entry, gone)
        except OSError:  # being copied, or another user's
            return False
        finally:
            os.close(fd)
        shutil.rmtree(gone, ignore_errors=True)
        return True


def unpack_kept(kept: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Copy a working directory that WorkdirCache.keep kept in `kept` into the empty directory `dest`, as unpack
    does; FileNotFoundError if it is gone."""
    _copy_tree(Path(kept) / "tree", _members(Path(kept)), Path(dest))


def _check_limit(members: list[Member], limit: int) -> None:
    if sum(member.size for member in members) > limit:
        raise InvalidRequestError(f"the working directory's files pass this server's limit of {limit} "
                                  "bytes (--max-working-dir)")


def _touch(path: Path) -> bool:
    """Mark the file `path` used now; whether it is there."""
    try:
        os.utime(path)
    except (FileNotFoundError, NotADirectoryError):  # not there, or an older rpycdl's entry
        return False
    except PermissionError:  # another server account's: there all the same
        return path.exists()
    return True


def _mark(path: Path) -> None:
    """Create the marker `path`, or mark it used now (read-only: one another server account made is opened too)."""
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    _touch(path)


def _open_dir(path: Path) -> int:
    """A descriptor of the directory `path` (not a link to one), to flock it by."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _members(entry: Path) -> list[Member]:
    """The members an entry holds, as its receiver checked them."""
    return [Member(**fields) for fields in json.loads((entry / MEMBERS).read_text())]


def _copy_tree(source: Path, members: list[Member], dest: Path) -> None:
    """Make `dest` hold `members` of the cache's tree `source`, each with its own mode: directories and
    files first, symlinks at the end, directories' modes last (writable meanwhile, by their owner after)."""
    for member in members:
        target = dest / member.name
        if member.kind == "dir":
            target.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif member.kind == "file":
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            reader = os.open(source / member.name, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                writer = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    clone(reader, writer, member.size)
                    os.fchmod(writer, member.mode)
                finally:
                    os.close(writer)
            finally:
                os.close(reader)
    for member in members:
        if member.kind == "link":
            (dest / member.name).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.symlink(member.link, dest / member.name)
    for member in reversed(members):
        if member.kind == "dir":
            os.chmod(dest / member.name, member.mode | 0o700)
