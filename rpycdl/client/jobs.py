"""Job handles: a job of a host's ledger (detached, or attached and seen in the ledger) as a client
holds it: its status, its logs (live while it runs), its result, its artifacts, cancel and delete."""

from __future__ import annotations

import codecs
import fnmatch
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpycdl.defaults import JOB_WAIT_MAX, UPLOAD_WAIT
from rpycdl.errors import InvalidRequestError, JobNotFinishedError, UploadTimeoutError
from rpycdl.states import JobState
from rpycdl.wire import codec

if TYPE_CHECKING:
    from rpycdl.client.connection import Connection


@dataclass(frozen=True)
class JobStatus:
    """Where a job is: its state; while it waits, how many waiting requests are ahead of it in line (`ahead`)
    and which jobs hold the GPUs it waits for (`holders`: one dict per GPU held, {"gpu": its index, "uuid",
    "job_id", "user", "share_bytes": 0 for the whole GPU, "since"}; None from a server that does not say);
    once it has ended, why (`error`) and a command's or container's exit code."""

    state: JobState
    ahead: int | None = None
    error: str = ""
    exit_code: int | None = None
    holders: tuple[dict[str, Any], ...] | None = field(default=None, compare=False)

    @property
    def finished(self) -> bool:
        return self.state.finished

    def __str__(self) -> str:
        if self.state is JobState.PENDING and self.ahead is not None:
            return f"PENDING ({waiting_behind(self.ahead, self.holders)})"
        return f"{self.state.value}: {self.error}" if self.error else self.state.value


def waiting_behind(ahead: int, holders: Iterable[Mapping[str, Any]] | None) -> str:
    """What a waiting job waits for, in words: 'behind 1 running job and 2 queued requests' (`ahead` and
    `holders` as a waiting job's row and on_state's "pending" info give them; holders None: a server from
    before they were told)."""
    if holders is None:
        return f"{ahead} queued request(s) ahead"
    jobs = len({holder["job_id"] for holder in holders})
    return (f"behind {jobs} running job{'' if jobs == 1 else 's'} and {ahead} queued "
            f"request{'' if ahead == 1 else 's'}")


class Job:
    """A job of a host's ledger, through a connection to a server that shares that ledger (reopened
    when it has been closed, so a handle outlives the connection it came from).

    Attributes:
        id: the job's id, unique everywhere.
        name: the name it was submitted with, or None.
        info: its row as last seen (rpycdl.scheduler.ledger.JobRecord's fields, and `ahead`).
    """

    def __init__(self, info: dict[str, Any], connection: Connection) -> None:
        self.info = info
        self.id: str = info["job_id"]
        self.name: str | None = info.get("name")
        self._connection = connection

    def _call(self, name: str, *args: Any) -> Any:
        """A call of the job's server answering outcome bytes, decoded; on a connection that has been
        closed, on a new one to the same server."""
        if self._connection.closed:
            self._connection = self._connection.reopen()
        return codec.decode_outcome(self._connection.call(name, *args))

    def refresh(self) -> dict[str, Any]:
        """The job's row now."""
        self.info = self._call("job", self.id)
        return self.info

    def status(self) -> JobStatus:
        """The job's state now (and how many requests are ahead of it while it waits)."""
        return _status(self.refresh())

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Wait until the job has ended, or `timeout` seconds have passed; returns its status then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = JOB_WAIT_MAX if deadline is None else deadline - time.monotonic()
            self.info = self._call("job_wait", self.id, min(left, JOB_WAIT_MAX)) if left > 0 else self.refresh()
            if JobState(self.info["state"]).finished or (deadline is not None and time.monotonic() >= deadline):
                return _status(self.info)

    def result(self, timeout: float | None = None, wait: bool = True) -> Any:
        """The job's value, or the exception it raised re-raised here (with the remote traceback), as
        run_code does; for a job that ended otherwise, the error that ended it (JobCancelledError,
        JobTimeoutError, JobLostError, ...). A command's value is its exit code.

        Args:
            timeout: seconds to wait at most for the job to end (None: as long as it takes).
            wait: False: do not wait at all.

        Raises:
            JobNotFinishedError: the job had not ended in time.
        """
        if wait and not self.wait(timeout).finished:
            raise JobNotFinishedError(f"job {self.id} has not ended after {timeout:g} s")
        return self._call("job_result", self.id)

    def logs(self, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """The job's output, line by line (each with its newline, as a file's lines): from its first line
        (or its last `tail` lines) to its end so far; with `follow`, then live until the job ends."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offset, pending, first = 0, "", True
        while True:
            data, offset, done = self._call("job_log", self.id, offset, JOB_WAIT_MAX if follow else None,
                                            tail if first else None)
            first = False
            pending += decoder.decode(data)
            *lines, pending = pending.split("\n")
            yield from (line + "\n" for line in lines)
            if done or (not follow and not data):
                break
        if pending + decoder.decode(b"", final=True):
            yield pending

    def artifacts(self, retry: bool = False) -> dict[str, Any]:
        """Where the job's outputs stand: {"state": "none", "uploading" (from the job's end until they are in
        the store), "uploaded" or "failed", "files": [{"name", "size"}], "error", "store"}. With `retry`, a
        failed upload is tried again first."""
        return self._call("job_artifacts", self.id, retry)

    def wait_artifacts(self, timeout: float | None = UPLOAD_WAIT) -> dict[str, Any]:
        """Where the job's outputs stand (as artifacts()) once they are no longer uploading, which they are
        from the job's end until they are in the store: waits up to `timeout` seconds (None: as long as it
        takes) on the server, which answers as soon as the upload is over.

        Raises:
            UploadTimeoutError: they were still uploading when `timeout` passed.
        """
        entry = self.artifacts()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while entry["state"] == "uploading" and (left := deadline - time.monotonic()) > 0:
            try:
                entry = self._call("job_artifacts", self.id, False, min(left, JOB_WAIT_MAX))
            except TypeError as exc:  # RPyC re-raises the server's own: one from before waiting for uploads
                if "positional argument" not in str(exc):
                    raise
                where = "{}:{}".format(*self._connection.address)
                raise InvalidRequestError(f"the server at {where} cannot wait for job {self.id}'s outputs (it "
                                          "predates that): upgrade it, or try again later") from None
        if entry["state"] == "uploading":
            raise UploadTimeoutError(f"job {self.id}'s outputs are still uploading to the artifact store after "
                                     f"{timeout:g} s: try again later (rpycdl artifacts {self.id} says where they "
                                     "stand)")
        return entry

    def download(self, dest: str | os.PathLike[str] = ".", pattern: str | None = None,
                 on_progress: Callable[[int], None] | None = None, timeout: float | None = UPLOAD_WAIT) -> list[Path]:
        """Download the job's uploaded artifacts (those whose name matches the glob `pattern`, if given)
        into `dest`, keeping their relative names, through the job's server; `on_progress` gets the bytes
        as they come. Returns the files written. Outputs still uploading (right after the job's end, as
        after wait() or result()) are waited for first, up to `timeout` seconds (None: as long as it takes).

        Raises:
            InvalidRequestError: the job has no uploaded artifacts (see artifacts()).
            UploadTimeoutError: its outputs were still uploading when `timeout` passed.
        """
        entry = self.wait_artifacts(timeout)  # those listed are in the store, whatever the state of the others
        if not entry["files"]:
            raise InvalidRequestError(f"job {self.id} has no uploaded artifacts (artifacts {entry['state']}"
                                      f"{': ' + entry['error'] if entry['error'] else ''})")
        written = []
        for artifact in entry["files"]:
            name = artifact["name"]
            if pattern is not None and not fnmatch.fnmatch(name, pattern):
                continue
            if name.startswith("/") or ".." in name.split("/"):
                raise InvalidRequestError(f"the server named an artifact {name!r}: not downloaded")
            target = Path(dest, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                while chunk := self._call("job_artifact", self.id, name, out.tell()):
                    out.write(chunk)
                    if on_progress is not None:
                        on_progress(len(chunk))
            written.append(target)
        return written

    def cancel(self) -> JobStatus:
        """Cancel the job if it has not ended (its owner or an admin may); returns its status when asked."""
        state = self._call("cancel", self.id)
        return JobStatus(JobState(state))

    def delete(self) -> None:
        """Remove the job's row, log and result; refused while it has not ended (cancel it first)."""
        self._call("delete", self.id)

    def __repr__(self) -> str:
        return f"<rpycdl.Job {self.id}{f' {self.name!r}' if self.name else ''} {self.info.get('state')}>"


def _status(info: dict[str, Any]) -> JobStatus:
    return JobStatus(JobState(info["state"]), info.get("ahead"), info.get("error") or "", info.get("exit_code"),
                     None if info.get("holders") is None else tuple(info["holders"]))
