"""The artifact store: where jobs' outputs go, at a URL the site chooses; a local directory
(`/srv/artifacts` or `file:///srv/artifacts`; the embedded default is the state directory's artifacts/) or
S3 and S3-compatible stores such as MinIO (`s3://bucket` or `s3://bucket/prefix`), both through fsspec
(s3fs for S3).

Layout: a job's files lie under `<root>/<user>/<job id>/<name>`, name being the file's path under the
job's output directory. Users, job ids and names are checked before any path is made, so that no call
reaches another user's prefix or leaves the root. A local store writes each file under
`<root>/@uploading/` first (no user's name has an @) and renames it into place when whole; S3 shows an
object only once its upload is complete: a reader never sees half a file.

S3's endpoint, region and credentials default to the usual AWS variables (AWS_ENDPOINT_URL,
AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) as boto reads them. They stay in the
server: clients read artifacts through it (read()). Every failure of the store is an ArtifactStoreError
saying why; the files uploaded are never changed."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from rpycdl.artifacts.files import COPY_CHUNK, Identity, check_name, copy_range, identity, open_beneath
from rpycdl.errors import ArtifactStoreError, InvalidRequestError

if TYPE_CHECKING:
    import fsspec

MULTIPART_THRESHOLD = 64 * 1024**2
"""Bytes of each part of an upload to S3 (s3fs's block size): a larger file goes up in parts."""

UPLOADING = "@uploading"
"""A local store's directory, under its root, of the files being written."""

_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Artifact:
    """One of a job's artifacts: its name under the job's prefix (a relative POSIX path), its size in bytes;
    for one just uploaded, the identity of the file it was read from (files.identity), to tell later
    whether that file changed since."""

    name: str
    size: int
    source: Identity | None = field(default=None, compare=False, repr=False)

    def listed(self) -> dict[str, object]:
        """As the ledger lists it: {"name", "size"}."""
        return {"name": self.name, "size": self.size}


class ArtifactStore:
    """A store of jobs' artifacts at a URL; each job's files under <root>/<user>/<job_id>/<name>.

    Attributes:
        url: the store's URL as given, for messages and `rpycdl status`.
    """

    def __init__(self, url: str, root: str, make_fs: Callable[[], fsspec.AbstractFileSystem],
                 bucket: str | None = None) -> None:
        self.url, self._root, self._make_fs, self._bucket = url, root, make_fs, bucket
        self._made: tuple[int, fsspec.AbstractFileSystem] | None = None

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None = None, region: str | None = None,
                 key: str | None = None, secret: str | None = None) -> ArtifactStore:
        """The store at `url`: an absolute directory (`/srv/artifacts`, `file:///srv/artifacts`) or
        `s3://bucket[/prefix]`. S3's `endpoint_url` (MinIO's), `region` and credentials (`key`, `secret`)
        default to what boto finds ($AWS_ENDPOINT_URL, $AWS_DEFAULT_REGION, $AWS_ACCESS_KEY_ID...).
        Nothing is contacted: check() does.

        Raises:
            InvalidRequestError: another scheme, a relative path, no bucket.
        """
        if url.startswith("s3://"):
            bucket, _, prefix = url.removeprefix("s3://").partition("/")
            root = "/".join([bucket, *(part for part in prefix.split("/") if part)])
            if not _COMPONENT.fullmatch(bucket):
                raise InvalidRequestError(f"the artifact store {url!r} names no bucket: s3://BUCKET[/PREFIX]")
            options = {"key": key, "secret": secret, "skip_instance_cache": True, "use_listings_cache": False,
                       "client_kwargs": {"endpoint_url": endpoint_url, "region_name": region}}
            return cls(url, root, lambda: _filesystem("s3", **options), bucket)
        path = url.removeprefix("file://")
        if not os.path.isabs(path):
            raise InvalidRequestError(f"the artifact store {url!r} is neither an absolute directory, a file:// URL "
                                      "nor an s3://BUCKET[/PREFIX] URL")
        return cls(url, os.path.normpath(path), lambda: _filesystem("file"))

    @property
    def _fs(self) -> fsspec.AbstractFileSystem:
        """This process's filesystem object: s3fs's cannot cross a fork (a server forks a process per
        connection), so each process makes its own on first use."""
        if self._made is None or self._made[0] != os.getpid():
            self._made = (os.getpid(), self._make_fs())
        return self._made[1]

    def check(self) -> None:
        """Contact the store once: S3's root listed, a local root made if need be and a file written in it.

        Raises:
            ArtifactStoreError: the store is unreachable, refuses the credentials, has no such bucket, or
                is a directory that cannot be written.
        """
        with self._failures("use"):
            if self._bucket is not None:
                prefix = self._root.partition("/")[2]
                self._fs.call_s3("list_objects_v2", Bucket=self._bucket, Prefix=prefix and f"{prefix}/", MaxKeys=1)
            else:
                os.makedirs(os.path.join(self._root, UPLOADING), exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=os.path.join(self._root, UPLOADING)):
                    pass

    def upload(self, user: str, job_id: str, source: str | os.PathLike[str],
               on_progress: Callable[[int], None] | None = None,
               skip: Mapping[str, Identity] | None = None, move: bool = False) -> list[Artifact]:
        """Upload every regular file under the directory `source` as the job's artifacts, named by their
        paths under it; links and other entries are skipped, never followed, and so is a file whose identity
        is `skip`'s for its name (uploaded before, unchanged since). With `move`, a local store on the same
        filesystem takes a file by renaming it (no byte copied), unless another name links to it. `on_progress`
        is told the bytes of each piece sent, as they go. Returns the artifacts uploaded, by name.

        Raises:
            InvalidRequestError: a bad user or job id; `source` is no directory, or holds a file whose path
                is no artifact's name (see upload_file).
            ArtifactStoreError: the store failed (the files stay as they were; those sent stay in the store).
        """
        self._job(user, job_id)
        try:
            top = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidRequestError(f"no directory to upload at {os.fspath(source)}: {exc.strerror}") from None
        uploaded = []
        try:
            for name, fd, parent, leaf in _regular_files(top):
                with open(fd, "rb") as reader:
                    if skip is not None and skip.get(name) == identity(os.fstat(fd)):
                        continue
                    path = self._path(user, job_id, name)
                    moved = self._moved(fd, parent, leaf, path, name, on_progress) if move else None
                    uploaded.append(moved or self._upload(reader, path, name, on_progress))
        except OSError as exc:  # from walking `source`: the store's failures are ArtifactStoreError by now
            raise InvalidRequestError(f"cannot read the directory to upload {os.fspath(source)}: {exc}") from None
        finally:
            os.close(top)
        return sorted(uploaded, key=lambda artifact: artifact.name)

    def upload_file(self, user: str, job_id: str, source: str | os.PathLike[str], name: str) -> Artifact:
        """Upload the regular file `name` under the directory `source` as the job's artifact `name`, following
        no symbolic link on the way (files.open_beneath).

        Raises:
            InvalidRequestError: no regular file `name` under `source`, or a link on the way; a bad user or
                job id (not one name of letters, digits, '.', '_' and '-'), or name (not a relative POSIX
                path, or with '.', '..' or empty components, NUL, newlines or backslashes).
            ArtifactStoreError: the store failed, or the file changed while it was read.
        """
        remote = self._path(user, job_id, name)
        try:
            fd = open_beneath(source, name)
        except OSError as exc:
            why = "a symbolic link on the way" if exc.errno == errno.ELOOP else exc.strerror
            raise InvalidRequestError(f"no regular file {name!r} to upload in {os.fspath(source)}: {why}") from None
        with open(fd, "rb") as reader:
            return self._upload(reader, remote, name, None)

    def list(self, user: str, job_id: str) -> list[Artifact]:
        """The job's artifacts, by name ([] if none).

        Raises:
            InvalidRequestError: a bad user or job id. ArtifactStoreError: the store failed.
        """
        prefix = self._job(user, job_id)
        with self._failures(f"list job {job_id} in"):
            try:
                found = self._fs.find(prefix, detail=True)
            except FileNotFoundError as exc:  # a local store's job without a directory: nothing uploaded
                if _s3_code(exc) == "NoSuchBucket":
                    raise
                found = {}
        return sorted((Artifact(path[len(prefix) + 1:], int(info["size"])) for path, info in found.items()
                       if info["type"] == "file"), key=lambda artifact: artifact.name)

    def read(self, user: str, job_id: str, name: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of the job's artifact `name` from `offset` (b"" from its end on).

        Raises:
            InvalidRequestError: a bad user, job id, name, offset or size; no such artifact.
            ArtifactStoreError: the store failed.
        """
        path = self._path(user, job_id, name)
        if not isinstance(offset, int) or not isinstance(size, int) or offset < 0 or size < 1:
            raise InvalidRequestError(f"cannot read {size!r} bytes of an artifact from offset {offset!r}")
        with self._failures(f"read {name} from"):
            try:
                return self._fs.cat_file(path, start=offset, end=offset + size)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
                if _s3_code(exc) == "NoSuchBucket":
                    raise
                raise InvalidRequestError(f"job {job_id} of {user} has no artifact {name!r}") from None
            except OSError as exc:
                if _s3_code(exc) == "InvalidRange":  # S3's answer to a range from the object's end on
                    return b""
                raise

    def _job(self, user: str, job_id: str) -> str:
        """The job's prefix, once user and job id are each checked to be one harmless path component."""
        for what, value in (("user", user), ("job id", job_id)):
            if not isinstance(value, str) or not _COMPONENT.fullmatch(value) or value in (".", ".."):
                raise InvalidRequestError(f"not a {what} the artifact store takes: {value!r} (one name of "
                                          "letters, digits, '.', '_' and '-')")
        return f"{self._root}/{user}/{job_id}"

    def _path(self, user: str, job_id: str, name: str) -> str:
        """The path of the job's artifact `name`, once all three are checked."""
        prefix = self._job(user, job_id)
        return f"{prefix}/{check_name(name)}"

    def _moved(self, fd: int, parent: int, leaf: str, path: str, name: str,
               on_progress: Callable[[int], None] | None) -> Artifact | None:
        """Rename the open file `fd` (`leaf` in the open directory `parent`) to the local store's `path`;
        None, and nothing moved, if the store is not local, is on another filesystem, or another name links
        to the file. It goes to the store's UPLOADING directory first: should the name no longer be that file
        (swapped meanwhile, for a link say), what was moved is removed from there, never seen at `path`."""
        status = os.fstat(fd)
        if self._bucket is not None or status.st_nlink != 1:
            return None
        with self._failures(f"upload {name} to"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            aside = os.path.join(self._root, UPLOADING, f"{secrets.token_hex(8)}.moving")
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            try:
                os.rename(leaf, aside, src_dir_fd=parent)
            except OSError as exc:
                if exc.errno == errno.EXDEV:
                    return None
                raise
            there = os.lstat(aside)
            if (there.st_dev, there.st_ino) != (status.st_dev, status.st_ino):
                os.unlink(aside)
                return None
            os.replace(aside, path)
        if on_progress is not None:
            on_progress(status.st_size)
        return Artifact(name, status.st_size, identity(status))

    def _upload(self, reader: BinaryIO, path: str, name: str, on_progress: Callable[[int], None] | None) -> Artifact:
        """Copy the open file `reader` to the store's `path`, all or nothing: nor is it put in place if the
        file changed meanwhile (its identity, files.identity, differs after the copy)."""
        before = identity(os.fstat(reader.fileno()))

        def unchanged() -> None:
            if identity(os.fstat(reader.fileno())) != before:
                raise ArtifactStoreError(f"{name} changed while it was uploaded: not put in place (upload it "
                                         "again once it is written)")

        with self._failures(f"upload {name} to"):
            if self._bucket is not None:
                writer = self._fs.open(path, "wb", block_size=MULTIPART_THRESHOLD)
                try:
                    size = _copy(reader, writer, before[3], on_progress)
                    unchanged()
                    writer.close()
                except BaseException:
                    with contextlib.suppress(Exception):
                        writer.discard()  # aborts a multipart upload begun: no object appears
                    writer.closed = True  # else fsspec would finish the upload when it collects the writer
                    raise
                return Artifact(name, size, before)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.makedirs(os.path.join(self._root, UPLOADING), exist_ok=True)
            fd, partial = tempfile.mkstemp(dir=os.path.join(self._root, UPLOADING))
            try:
                with open(fd, "wb") as writer:  # in the kernel: a local store copies at the disk's speed
                    size = copy_range(reader.fileno(), writer.fileno(), before[3], on_progress=on_progress)
                unchanged()
                os.replace(partial, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(partial)
                raise
            return Artifact(name, size, before)

    @contextlib.contextmanager
    def _failures(self, action: str) -> Iterator[None]:
        """Turn the store's failures into ArtifactStoreError("cannot <action> the artifact store <url>: why")."""
        try:
            yield
        except (ArtifactStoreError, InvalidRequestError):
            raise
        except Exception as exc:  # fsspec's, s3fs's, botocore's and the OS's errors alike: said in words
            raise ArtifactStoreError(f"cannot {action} the artifact store {self.url}: {self._reason(exc)}") from exc

    def _reason(self, exc: Exception) -> str:
        """Why the store failed, and what to fix, in one line."""
        if self._bucket is None:
            return f"the directory is not writable ({exc})" if isinstance(exc, PermissionError) else str(exc)
        from botocore.exceptions import ConnectionError as NoConnection  # botocore, loaded with s3fs
        from botocore.exceptions import HTTPClientError, NoCredentialsError

        if _s3_code(exc) == "NoSuchBucket":
            return f"the bucket {self._bucket!r} does not exist: create it, or correct the store's URL"
        if isinstance(exc, PermissionError):
            return (f"the store refused the credentials or the access ({exc}): check AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY and the bucket's policy")
        if isinstance(exc, NoCredentialsError):
            return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        if isinstance(exc, (NoConnection, HTTPClientError)):
            where = urllib.parse.urlsplit(exc.kwargs.get("endpoint_url") or "")
            endpoint = f"{where.scheme}://{where.netloc}" if where.netloc else "its endpoint"
            return f"no answer from {endpoint} ({exc.kwargs.get('error') or exc}): is the store up, its endpoint right?"
        return str(exc) or type(exc).__name__


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code ("NoSuchBucket") of an error s3fs translated into an OSError, if any."""
    response = getattr(exc.__cause__, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _copy(reader: BinaryIO, writer: BinaryIO, count: int, on_progress: Callable[[int], None] | None) -> int:
    """Copy up to `count` bytes of `reader` to `writer` by COPY_CHUNK, telling `on_progress`; returns the bytes
    copied (fewer at the end of `reader`)."""
    copied = 0
    while copied < count and (chunk := reader.read(min(COPY_CHUNK, count - copied))):
        writer.write(chunk)
        copied += len(chunk)
        if on_progress is not None:
            on_progress(len(chunk))
    return copied


def _regular_files(directory: int, prefix: str = "") -> Iterator[tuple[str, int, int, str]]:
    """(name, open descriptor, its open parent directory, its name in it) of each regular file under the
    open `directory`, depth first. Links and other entries are skipped: each entry is opened without
    following a link (O_NOFOLLOW, relative to its open parent) and checked once open, so one swapped for a
    link meanwhile is skipped too. The caller closes the files' descriptors; a parent's is closed after."""
    with os.scandir(directory) as listing:
        names = sorted(entry.name for entry in listing
                       if entry.is_dir(follow_symlinks=False) or entry.is_file(follow_symlinks=False))
    for name in names:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP):  # gone, or now a link
                continue
            raise
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            yield prefix + name, fd, directory, name
            continue
        try:
            if stat.S_ISDIR(mode):
                yield from _regular_files(fd, f"{prefix}{name}/")
        finally:
            os.close(fd)


def _filesystem(protocol: str, **options: object) -> fsspec.AbstractFileSystem:
    """fsspec's filesystem for `protocol`, fsspec imported on a store's first use: the server parent, and every
    connection process forked from it, would otherwise carry it and asyncio (about 7 MB) for stores that most
    connections never touch."""
    import fsspec

    return fsspec.filesystem(protocol, **options)
