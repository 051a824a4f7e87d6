"""A job's files in the state directory, beside the ledger, readable by every server of the host:

    jobs/<id>/spec.json   what its supervisor needs: the accepting server's settings and the request
    jobs/<id>/payload     the callable and its argument (wire.codec), until the job ends
    jobs/<id>/log         its stdout and stderr as they were written, up to --max-log
    jobs/<id>/result      its outcome (wire.codec: the value, or the exception it raised), written once
    jobs/<id>/work        its working directory, if it brought one (an attached job's too), until it ends
    jobs/<id>/output      what it left for the artifact store, until uploaded (kept when the upload fails)
    jobs/.unrecorded/<id> the process making a job's files before its row is in the ledger

A result appears whole or not at all (written aside, then renamed), before the ledger says the job
ended; a log only grows. Writing either can fail (a full disk): the job then fails, saying why, and a
log that met a full disk gives back its last LOG_HEADROOM bytes, so that the ledger can record the end."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from rpycdl.errors import LimitError, NotAllowedError
from rpycdl.scheduler import procs
from rpycdl.scheduler.lockdir import file_mode, shared_dir
from rpycdl.units import format_size

WORKING_DIR = "work"
"""A job's working directory, in its directory."""

OUTPUT_DIR = "output"
"""A job's outputs, in its directory, until they are in the artifact store."""

TAIL_CHUNK = 64 * 1024
"""Bytes read at a time, backwards, to find a log's last lines."""

LOG_HEADROOM = 256 * 1024
"""Bytes a log cuts from its end when the disk is full: room for the ledger's end of the job."""

UNRECORDED = ".unrecorded"
"""Markers of jobs whose files are made before their ledger row, each naming the process making them."""


class JobFiles:
    """The jobs/ directory of one state directory."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.root = Path(state_dir) / "jobs"
        shared_dir(self.root)

    def path(self, job_id: str, name: str = "") -> Path:
        """A job's directory, or the file `name` in it."""
        if not job_id.isalnum():
            raise ValueError(f"bad job id {job_id!r}")
        return self.root / job_id / name if name else self.root / job_id

    def create(self, job_id: str, spec: dict[str, Any], payload: bytes | None) -> None:
        """Write a new job's spec and payload (before its supervisor starts)."""
        shared_dir(self.path(job_id))
        _write(self.path(job_id, "spec.json"), json.dumps(spec).encode())
        if payload is not None:
            _write(self.path(job_id, "payload"), payload)

    def begin(self, job_id: str) -> None:
        """Mark the job's files as this process's to make, before its row is in the ledger (recorded());
        if this process dies first, no row will ever name them, and the sweep removes them (unrecorded())."""
        marker, (pid, start) = self.root / UNRECORDED / self.path(job_id).name, procs.myself()
        try:
            _write(marker, f"{pid} {start}".encode())
        except FileNotFoundError:  # the first job of this state directory: made now, not before (a ledger
            shared_dir(marker.parent)  # missing from a state directory holding it would be a lost history)
            _write(marker, f"{pid} {start}".encode())

    def recorded(self, job_id: str) -> None:
        """The job's row is in the ledger: the sweep of dead owners' rows answers for its files now."""
        (self.root / UNRECORDED / self.path(job_id).name).unlink(missing_ok=True)

    def unrecorded(self) -> dict[str, procs.Pid]:
        """The jobs marked by begin() and not yet recorded(), with the process making each one's files."""
        found: dict[str, procs.Pid] = {}
        markers = self.root / UNRECORDED
        for marker in markers.iterdir() if markers.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):  # one being written is named .<id>...tmp
                pid, start = marker.read_text().split()
                found[self.path(marker.name).name] = (int(pid), int(start))
        return found

    def open(self, job_id: str, name: str) -> int:
        """A descriptor of the job's file `name`, for reading: opened without following a link, and, in a
        process running as root, only if root owns it (nobody else could have put it there or changed it).

        Raises:
            FileNotFoundError: there is none. NotAllowedError (a PermissionError): it is a link, or not root's
                (the directories were open to others once: docs/security.md, Root and paths).
        """
        path = self.path(job_id, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise NotAllowedError(f"{path} is a link where a job's file should be: not followed") from None
        status = os.fstat(fd)
        if os.geteuid() == 0 and (status.st_uid != 0 or not stat.S_ISREG(status.st_mode)):
            os.close(fd)
            raise NotAllowedError(f"{path} is a job's file that root did not write: not read")
        return fd

    def read(self, job_id: str, name: str) -> bytes | None:
        """The whole of the job's file `name` (see open), or None if there is none."""
        try:
            fd = self.open(job_id, name)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as file:
            return file.read()

    def spec(self, job_id: str) -> dict[str, Any]:
        spec = self.read(job_id, "spec.json")
        if spec is None:
            raise FileNotFoundError(errno.ENOENT, "no spec", str(self.path(job_id, "spec.json")))
        return json.loads(spec)

    def payload(self, job_id: str) -> bytes | None:
        """The job's payload, or None for a container job."""
        return self.read(job_id, "payload")

    def write(self, job_id: str, name: str, data: bytes) -> None:
        """Write the job's file `name` whole (aside, then renamed): an array's arguments (rpycdl.server.arrays)."""
        _write(self.path(job_id, name), data)

    def read_at(self, job_id: str, name: str, offset: int, size: int) -> bytes:
        """`size` bytes of the job's file `name` from `offset` (see open): an array element's argument."""
        fd = self.open(job_id, name)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def drop_payload(self, job_id: str) -> None:
        """Remove the payload of a job that has ended (its result and log stay)."""
        self.path(job_id, "payload").unlink(missing_ok=True)

    def store_result(self, job_id: str, outcome: bytes) -> int:
        """Write the job's outcome whole (aside, flushed to disk, then renamed); returns its size.

        Raises:
            LimitError: it could not be written (a full disk); nothing of it is left.
        """
        target = self.path(job_id, "result")
        try:
            _write(target, outcome, sync=True)
        except OSError as exc:
            raise LimitError(f"the job's result ({format_size(len(outcome))}) could not be stored: "
                             f"{exc.strerror or exc} ({target.parent})") from None
        return len(outcome)

    def result(self, job_id: str) -> bytes | None:
        return self.read(job_id, "result")

    def log_size(self, job_id: str) -> int:
        try:
            fd = self.open(job_id, "log")
        except FileNotFoundError:
            return 0
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read_log(self, job_id: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of the job's log from `offset` (b"" at its end, or if there is none)."""
        try:
            fd = self.open(job_id, "log")
        except FileNotFoundError:
            return b""
        with os.fdopen(fd, "rb") as log:
            log.seek(offset)
            return log.read(size)

    def tail_offset(self, job_id: str, lines: int) -> int:
        """Where the job's last `lines` lines begin in its log (a last line without its newline counts)."""
        end = self.log_size(job_id)
        if lines <= 0:
            return end
        position, found = end, -1
        with contextlib.suppress(FileNotFoundError), os.fdopen(self.open(job_id, "log"), "rb") as log:
            while position > 0:
                start = max(0, position - TAIL_CHUNK)
                log.seek(start)
                chunk = log.read(position - start)
                if position == end and chunk.endswith(b"\n"):
                    chunk = chunk[:-1]  # the last line's own newline
                for index in range(len(chunk) - 1, -1, -1):
                    if chunk[index] == 0x0A:
                        found += 1
                        if found == lines - 1:
                            return start + index + 1
                position = start
        return 0

    def remove(self, job_id: str) -> None:
        """Remove everything of the job (its directory, and its mark if it was never recorded)."""
        shutil.rmtree(self.path(job_id), ignore_errors=True)
        self.recorded(job_id)

    def working_dir(self, job_id: str) -> Path:
        """Where the job's working directory is unpacked for it (rpycdl.artifacts.workdir)."""
        return self.path(job_id, WORKING_DIR)

    def output_dir(self, job_id: str) -> Path:
        """Where the job writes what goes to the artifact store when it ends."""
        return self.path(job_id, OUTPUT_DIR)

    def remove_working_dir(self, job_id: str) -> None:
        """Remove the job's working directory, its output directory if empty, and its directory if nothing
        else is left in it (an attached job's, its outputs uploaded or none)."""
        shutil.rmtree(self.working_dir(job_id), ignore_errors=True)
        for directory in (self.output_dir(job_id), self.path(job_id)):
            with contextlib.suppress(OSError):  # not empty, or gone
                directory.rmdir()

    def listed(self) -> list[str]:
        """The ids of the jobs that have a directory."""
        return [entry.name for entry in self.root.iterdir() if entry.name.isalnum()]


class LogWriter:
    """Appends a job's output to its log as it comes, up to `limit` bytes, then one marker line. The log is made at
    the first output (a job that prints nothing has none: its readers read it as empty).

    Attributes:
        size: the bytes the log holds (the marker included).

    Raises (from write):
        LimitError: the log could not be written (a full disk): the job must stop. Later writes are
            dropped.
    """

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.size = 0
        self._full = False
        self._fd = -1

    def write(self, text: str) -> None:
        if self._full or not text:
            return
        data = text.encode(errors="replace")
        if self.size + len(data) > self.limit:
            self._full = True
            data = data[:self.limit - self.size] + (
                f"\n[rpycdl: this job's log reached its limit of {format_size(self.limit)} (--max-log): "
                "later output is dropped]\n").encode()
        written = 0
        try:
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                                   file_mode())
                with contextlib.suppress(PermissionError):
                    os.fchmod(self._fd, file_mode())
            while written < len(data):
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            self.size += written
            self._full = True
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._make_room()
            raise LimitError(f"the job's log could not be written: {exc.strerror or exc} ({self.path})") from None
        self.size += written

    def _make_room(self) -> None:
        """Cut the log's last LOG_HEADROOM bytes, and say so in what is left."""
        marker = b"\n[rpycdl: the disk is full: this job's log was cut here and the job stopped]\n"
        with contextlib.suppress(OSError):
            self.size = max(0, self.size - LOG_HEADROOM)
            os.ftruncate(self._fd, self.size)
            self.size += os.write(self._fd, marker)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)


def _write(path: Path, data: bytes, sync: bool = False) -> None:
    """Write `data` to `path` whole: aside first, then renamed over it; nothing is left if it fails."""
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    aside.unlink(missing_ok=True)  # left by a process of this pid that died writing it
    try:
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode())
        try:
            with contextlib.suppress(PermissionError):
                os.fchmod(fd, file_mode())
            with memoryview(data) as view:
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(aside, path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise
