"""The artifact store: where jobs' outputs go, at a URL the site chooses; a local directory
(`/var/lib/rpycdl/artifacts`, `file:///...`, the embedded default under the state directory) or S3 and
S3-compatible stores such as MinIO (`s3://bucket/prefix`), all through fsspec (s3fs for S3).

Each job's files lie under `<root>/<user>/<job id>/<name>`. Users, job ids and names are checked before
any path is made, so that no call reaches another user's prefix or leaves the root. S3's endpoint,
region and credentials come from the usual AWS variables (AWS_ENDPOINT_URL, AWS_DEFAULT_REGION,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) as boto reads them, or from `endpoint_url`; they stay in the
server: clients read artifacts through it (read()). Every failure of the store is an ArtifactStoreError
with its reason; the files to upload are never changed."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from rpycdl.errors import ArtifactStoreError, InvalidRequestError

MULTIPART_CHUNK = 8 * 1024**2
"""Bytes of each part of a multipart upload to S3: s3fs sends a file of twice this or more in parts."""

COMPONENT = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Artifact:
    """One file of a job's artifacts: its name under the job's prefix, and its size in bytes."""

    name: str
    size: int


class ArtifactStore:
    """A store of jobs' artifacts at `url` (see from_url)."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.url, self._fs, self._root = url, fs, root.rstrip("/")

    @classmethod
    def from_url(cls, url: str, endpoint_url: str | None = None) -> ArtifactStore:
        """The store at `url`: an absolute directory (or file:// URL), or s3://bucket[/prefix]. Nothing
        is contacted yet (check() does).

        Raises:
            InvalidRequestError: another kind of URL, a relative path, no bucket.
        """
        if url.startswith("s3://"):
            root = url.removeprefix("s3://").strip("/")
            if not root or not COMPONENT.fullmatch(root.split("/")[0]):
                raise InvalidRequestError(f"the artifact store {url!r} names no bucket: s3://BUCKET[/PREFIX]")
            import s3fs  # only a site with an S3 store needs it

            endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
            fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint} if endpoint
                                   else {})
            return cls(url, fs, root)
        path = url.removeprefix("file://")
        if not os.path.isabs(path):
            raise InvalidRequestError(f"the artifact store {url!r} is neither an absolute directory, a file:// URL "
                                      "nor an s3://BUCKET[/PREFIX] URL")
        return cls(url, fsspec.filesystem("file"), path)

    def _prefix(self, user: str, job_id: str) -> str:
        for what, value in (("user", user), ("job id", job_id)):
            if not isinstance(value, str) or not COMPONENT.fullmatch(value) or value in (".", ".."):
                raise InvalidRequestError(f"not a {what} the artifact store takes: {value!r}")
        return f"{self._root}/{user}/{job_id}"

    def _path(self, user: str, job_id: str, name: str) -> str:
        parts = name.split("/") if isinstance(name, str) else [""]
        if any(part in ("", ".", "..") or any(c in part for c in "\0\n\r\\") for part in parts):
            raise InvalidRequestError(f"not an artifact's name: {name!r}")
        return f"{self._prefix(user, job_id)}/{name}"

    def _failed(self, what: str, exc: BaseException) -> ArtifactStoreError:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, FileNotFoundError) and self.url.startswith("s3://"):
            reason = f"no such bucket or key ({reason})"
        elif isinstance(exc, PermissionError):
            reason = f"the store refused the credentials or the access ({reason})"
        return ArtifactStoreError(f"cannot {what} the artifact store {self.url}: {reason}")

    def check(self) -> None:
        """Reach the store once (its root listed, or made for a local directory).

        Raises:
            ArtifactStoreError: unreachable, refused credentials, no such bucket, not writable.
        """
        try:
            if self.url.startswith("s3://"):
                self._fs.ls(self._root.split("/")[0], refresh=True)
            else:
                self._fs.makedirs(self._root, exist_ok=True)
                if not os.access(self._root, os.W_OK):
                    raise PermissionError(f"{self._root} is not writable")
        except Exception as exc:  # the library's errors, whatever the backend: said in words
            raise self._failed("reach", exc) from None

    def upload(self, user: str, job_id: str, source: str | os.PathLike[str],
               on_progress: Callable[[int], None] | None = None) -> list[Artifact]:
        """Upload every regular file under `source` (symlinks and other entries skipped, never followed)
        as the job's artifacts; on S3 a large file goes up in parts (MULTIPART_CHUNK). Returns them, by name.

        Raises:
            ArtifactStoreError: the store failed (the files stay as they were).
        """
        uploaded = []
        for path, name in _files(Path(source)):
            uploaded.append(self.upload_file(user, job_id, path, name))
            if on_progress is not None:
                on_progress(uploaded[-1].size)
        return sorted(uploaded, key=lambda artifact: artifact.name)

    def upload_file(self, user: str, job_id: str, path: str | os.PathLike[str], name: str) -> Artifact:
        """Upload the file `path` as the job's artifact `name`. ArtifactStoreError if the store fails."""
        remote = self._path(user, job_id, name)
        size = os.path.getsize(path)
        try:
            options: dict[str, Any] = {"chunksize": MULTIPART_CHUNK} if self.url.startswith("s3://") else {}
            if not self.url.startswith("s3://"):
                self._fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
            self._fs.put_file(os.fspath(path), remote, **options)
        except Exception as exc:  # the library's errors, whatever the backend: said in words
            raise self._failed(f"upload {name} to", exc) from None
        return Artifact(name, size)

    def list(self, user: str, job_id: str) -> list[Artifact]:
        """The job's artifacts, by name ([] if none). ArtifactStoreError if the store fails."""
        prefix = self._prefix(user, job_id)
        try:
            found = self._fs.find(prefix, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:  # the library's errors, whatever the backend: said in words
            raise self._failed("list", exc) from None
        return sorted((Artifact(path.removeprefix(prefix).lstrip("/"), int(info["size"]))
                       for path, info in found.items() if info.get("type") == "file"), key=lambda a: a.name)

    def read(self, user: str, job_id: str, name: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of the artifact `name` from `offset` (b"" past its end).

        Raises:
            InvalidRequestError: no such artifact. ArtifactStoreError: the store failed.
        """
        remote = self._path(user, job_id, name)
        try:
            try:
                return self._fs.cat_file(remote, start=offset, end=offset + size)
            except OSError:  # S3 refuses a range past the end (416): the end, if that was it
                if offset >= self._fs.size(remote):
                    return b""
                raise
        except FileNotFoundError:
            raise InvalidRequestError(f"job {job_id} has no artifact {name!r}") from None
        except Exception as exc:  # the library's errors, whatever the backend: said in words
            raise self._failed(f"read {name} from", exc) from None


def _files(root: Path, relative: str = "") -> Iterator[tuple[Path, str]]:
    """(path, name) of every regular file under `root`, sorted; links and other entries left out."""
    with os.scandir(root / relative) as listing:
        entries = sorted(listing, key=lambda entry: entry.name)
    for entry in entries:
        name = f"{relative}/{entry.name}" if relative else entry.name
        if entry.is_dir(follow_symlinks=False):
            yield from _files(root, name)
        elif entry.is_file(follow_symlinks=False):
            yield Path(entry.path), name
