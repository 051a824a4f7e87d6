"""Job handles: a job of a host's ledger (detached, or attached and seen in the ledger) as a client
holds it: its status, its logs (live while it runs), its result, its artifacts, cancel and delete."""

from __future__ import annotations

import codecs
import contextlib
import fnmatch
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpycdl.client import credentials, displays, failures, notices
from rpycdl.client.displays import client_row, job_text
from rpycdl.defaults import CANCEL_WAIT, JOB_WAIT_MAX, UPLOAD_WAIT
from rpycdl.errors import (
    InvalidRequestError,
    JobNotFinishedError,
    RpycdlError,
    UnverifiableResultError,
    UploadTimeoutError,
)
from rpycdl.security import results
from rpycdl.states import JobState, held_by, waiting_behind
from rpycdl.wire import codec

if TYPE_CHECKING:
    from rpycdl.client.connection import Connection

UNVERIFIED = ("result(verify=False) (rpycdl result --no-verify) unpickles it unverified, which runs whatever code it "
              "holds: only for a result you trust. Nothing of it was unpickled")
"""How a result this client cannot verify can be read all the same, ending its refusal."""


@dataclass(frozen=True)
class JobStatus:
    """Where a job is: its state; while it waits, how many jobs are ahead of it (`ahead`: those holding the GPUs
    it waits for and the waiting requests before it in line) and which jobs hold the GPUs it waits for
    (`holders`: one dict per GPU held, {"gpu": its index, "uuid", "job_id", "user", "share_bytes": 0 for the
    whole GPU, "since": a datetime}; None from a server that does not say, whose `ahead` counts the waiting
    requests alone), and of those the waiting requests alone (`queued`); once it has ended, why (`error`) and
    a command's or container's exit code; and when this was read from the server (`read_at`). A job held by its
    dependencies (submit's `after=`), with no place in line yet, says what it waits for (`after`: "ok:ID"). A job
    whose owner's limits hold it back (the server's --limits file) says why (`reason`: "alice holds 4 GPUs, the
    limit of users.alice.gpus = 4"); others go first meanwhile. `priority` is the one it asked (priority=: a higher one
    goes first; 0 unless asked)."""

    state: JobState
    ahead: int | None = None
    error: str = ""
    exit_code: int | None = None
    holders: tuple[dict[str, Any], ...] | None = field(default=None, compare=False)
    read_at: datetime | None = field(default=None, compare=False)
    queued: int | None = field(default=None, compare=False)
    after: str | None = field(default=None, compare=False)
    reason: str = field(default="", compare=False)
    priority: int = field(default=0, compare=False)

    @property
    def finished(self) -> bool:
        return self.state.finished

    def __str__(self) -> str:
        rank = f", priority {self.priority}" if self.priority else ""
        if self.state is JobState.PENDING and self.reason:
            return f"PENDING ({self.reason}{rank})"
        if self.state is JobState.PENDING and self.ahead is not None:
            return f"PENDING ({waiting_behind(self.ahead, self.holders)}{rank})"
        if self.state is JobState.PENDING and self.after:
            return f"PENDING (after {self.after}{rank})"
        return f"{self.state.value}: {self.error}" if self.error else self.state.value

    def __repr__(self) -> str:
        fields = [f"state={self.state.value}"]
        if self.ahead is not None:
            fields.append(f"ahead={self.ahead}")
        if self.holders:
            fields.append(f"holders=({held_by(self.holders)})")
        if self.after and self.ahead is None:
            fields.append(f"after={self.after!r}")
        if self.reason:
            fields.append(f"reason={self.reason!r}")
        if self.priority:
            fields.append(f"priority={self.priority}")
        if self.error:
            fields.append(f"error={self.error!r}")
        if self.exit_code is not None:
            fields.append(f"exit_code={self.exit_code}")
        if self.read_at is not None:
            fields.append(f"read at {self.read_at.strftime('%H:%M:%S')}")
        return f"JobStatus({', '.join(fields)})"


class Job:
    """A job of a host's ledger, through a connection to a server that shares that ledger (opened again when it
    has died or been closed, so a handle outlives the connection it came from, and an interrupted wait,
    result or log follow leaves it ready at once: its connection is replaced). Jupyter shows it as a table
    of its state now.

    Attributes:
        id: the job's id, unique everywhere.
        name: the name it was submitted with, or None.
        info: its row as last seen (rpycdl.scheduler.ledger.JobRecord's fields, times as datetimes; `ahead`
            and `holders` while it waits, as JobStatus has them).
        read_at: when `info` was read from the server.
    """

    def __init__(self, info: dict[str, Any], connection: Connection) -> None:
        self._seen(info)
        self.id: str = self.info["job_id"]
        self.name: str | None = self.info.get("name")
        self._connection = connection

    def _seen(self, info: dict[str, Any]) -> dict[str, Any]:
        self.info, self.read_at = client_row(info), datetime.now().astimezone()
        return self.info

    def _call(self, name: str, *args: Any, doing: str = "") -> Any:
        """A call of the job's server answering outcome bytes, decoded (as _ask)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return codec.decode_outcome(self._ask(name, *args, doing=doing))

    def _ask(self, name: str, *args: Any, doing: str = "") -> Any:
        """A call of the job's server, its answer as it came; on a connection that has been closed, on a new one
        to the same server. Ctrl-C of a call that waits (`doing` says for what) replaces the handle's
        connection, whose server would answer nothing else until that wait is over."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if self._connection.closed_by_user:
            self._connection = self._connection.reopen()
        try:
            return self._connection.call(name, *args)
        except KeyboardInterrupt:
            if not doing:
                raise
            if self._connection.session is not None:  # a session lives on that connection: leave it be
                self._connection = self._connection.reopen()
            else:
                self._connection.interrupt()
            raise failures.stopped(f"{doing} (job {self.id} goes on: job.cancel() stops it)") from None

    def refresh(self) -> dict[str, Any]:
        """The job's row now (its `info`)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return self._seen(self._call("job", self.id))

    def attempts(self) -> list[dict[str, Any]]:
        """The job's attempts, first first: those its `retries=` requeued, then the one it is at (a job never
        requeued has one). Each a dict: attempt (1, 2, ...), state (how it ended, or PENDING or RUNNING for the
        last), started, ended (datetimes, or None), error, error_type, exit_code, gpu_uuids."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return client_row(self._call("job_attempts", self.id))

    def status(self) -> JobStatus:
        """The job's state now (while it waits: how many jobs are ahead of it, which hold its GPUs)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return _status(self.refresh(), self.read_at)

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Wait until the job has ended (succeeded, failed, was cancelled, timed out or was lost), or `timeout`
        seconds have passed; returns its status then. Each call to the server waits up to JOB_WAIT_MAX seconds
        there; its outputs may still be uploading when the job has ended (download() waits for them).
        Ctrl-C stops the wait, not the job."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = JOB_WAIT_MAX if deadline is None else deadline - time.monotonic()
            if left > 0:
                self._seen(self._call("job_wait", self.id, min(left, JOB_WAIT_MAX), doing=f"waiting for job {self.id}"))
            else:
                self.refresh()
            if JobState(self.info["state"]).finished or (deadline is not None and time.monotonic() >= deadline):
                return _status(self.info, self.read_at)

    def result(self, timeout: float | None = None, wait: bool = True, verify: bool = True) -> Any:
        """The job's value, or the exception it raised re-raised here (from the job's frames, with the remote
        traceback), as run_code does; for a job that ended otherwise, the error that ended it
        (JobCancelledError, JobTimeoutError, JobLostError, ...). A command's value is its exit code. It waits
        for the job's end as wait() does (not for its outputs' upload: download() waits for that), then
        fetches the value; Ctrl-C stops the wait, not the job.

        The result is unpickled only once its seal says that the job wrote it: the key this client gave the
        job at submit (security.results, from this client's result key file) must have sealed it.

        Args:
            timeout: seconds to wait at most for the job to end (None: as long as it takes).
            wait: False: do not wait at all.
            verify: False: unpickle the result without checking its seal (a job submitted from another
                machine or account, an admin reading another user's job, a job from before sealed results).
                Unpickling runs whatever code the result holds: only for a result you trust.

        Raises:
            JobNotFinishedError: the job had not ended in time.
            ResultIntegrityError: the result file was not written by the job (replaced or changed on the
                server); nothing of it was unpickled.
            UnverifiableResultError: this client cannot verify the result (not its key, no seal, a server from
                before seals); nothing of it was unpickled.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if wait and not self.wait(timeout).finished:
            raise JobNotFinishedError(f"job {self.id} has not ended after {timeout:g} s")
        doing = f"reading job {self.id}'s result"
        try:
            kind, data = self._ask("job_result", self.id, True, doing=doing)
        except TypeError as exc:  # RPyC re-raises the server's own: one from before sealed results
            if "positional argument" not in str(exc):
                raise
            if verify:
                where = "{}:{}".format(*self._connection.address)
                raise UnverifiableResultError(f"the server at {where} predates sealed results: it cannot send job "
                                              f"{self.id}'s result for this client to verify. Ask a newer server of "
                                              f"its host, or {UNVERIFIED}") from None
            return codec.decode_outcome(results.unverified(self._ask("job_result", self.id, doing=doing)))
        if kind != "result":  # the server's own answer: why there is no result
            return codec.decode_outcome(data)
        return codec.decode_outcome(self._verified(data) if verify else results.unverified(data))

    def _verified(self, data: bytes) -> memoryview:
        """The outcome in the job's result file `data`, once its seal is checked with the key this client gave
        the job (derived from its secret and the nonce of the job's row)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if "result_nonce" not in self.info:
            self.refresh()  # the handle's row came from elsewhere: the job's own says how it was sealed
        nonce, sealed_for = self.info.get("result_nonce"), self.info.get("result_key_id")
        if nonce is None or sealed_for is None:
            raise UnverifiableResultError(f"job {self.id} has no seal of its result (it was submitted by an rpycdl "
                                          "client, or to a server, from before sealed results, or its server does "
                                          f"not say): this client cannot tell that the job wrote it. {UNVERIFIED}")
        secret, path = credentials.result_secret()
        if results.key_id(secret) != sealed_for:
            raise UnverifiableResultError(
                f"job {self.id}'s result was sealed with the result key {sealed_for}, and this client's ({path}) is "
                f"{results.key_id(secret)}: it was submitted from another machine or account. Read it where it was "
                "submitted, or with a copy of that client's result key file (RPYCDL_RESULT_KEY, or result_key in the "
                f"credentials file, names it); or {UNVERIFIED}")
        return results.open_sealed(results.job_key(secret, nonce), self.id, data)

    def logs(self, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """The job's output, line by line (each with its newline, as a file's lines): from its first line
        (or its last `tail` lines) to its end so far; with `follow`, then live until the job ends (Ctrl-C
        stops following, not the job)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        offset, pending, first = 0, "", True
        while True:
            data, offset, done = self._call("job_log", self.id, offset, JOB_WAIT_MAX if follow else None,
                                            tail if first else None, doing=f"reading job {self.id}'s log")
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
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return self._call("job_artifacts", self.id, retry)

    def wait_artifacts(self, timeout: float | None = UPLOAD_WAIT) -> dict[str, Any]:
        """Where the job's outputs stand (as artifacts()) once they are no longer uploading, which they are
        from the job's end until they are in the store: waits up to `timeout` seconds (None: as long as it
        takes) on the server, which answers as soon as the upload is over.

        Raises:
            UploadTimeoutError: they were still uploading when `timeout` passed.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        entry = self.artifacts()
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while entry["state"] == "uploading" and (left := deadline - time.monotonic()) > 0:
            try:
                entry = self._call("job_artifacts", self.id, False, min(left, JOB_WAIT_MAX),
                                   doing=f"waiting for job {self.id}'s outputs")
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
                 on_progress: Callable[[int], None] | None = None, timeout: float | None = UPLOAD_WAIT,
                 quiet: bool | None = None) -> list[Path]:
        """Download the job's uploaded artifacts (those whose name matches the glob `pattern`, if given)
        into `dest`, keeping their relative names, through the job's server, with a progress bar where a person
        looks (rpycdl.client.notices: a widget in Jupyter, text in a terminal; `quiet` as rpycdl.connect's,
        default the connection's);
        `on_progress` gets the bytes as they come. Returns the files written. Outputs still uploading (right
        after the job's end, as after wait() or result()) are waited for first, up to `timeout` seconds (None:
        as long as it takes).

        Raises:
            InvalidRequestError: the job has no uploaded artifacts (see artifacts()).
            UploadTimeoutError: its outputs were still uploading when `timeout` passed.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        entry = self.wait_artifacts(timeout)  # those listed are in the store, whatever the state of the others
        if not entry["files"]:
            raise InvalidRequestError(f"job {self.id} has no uploaded artifacts (artifacts {entry['state']}"
                                      f"{': ' + entry['error'] if entry['error'] else ''})")
        chosen = [artifact for artifact in entry["files"]
                  if pattern is None or fnmatch.fnmatch(artifact["name"], pattern)]
        written = []
        quiet = self._connection.quiet if quiet is None else quiet
        with notices.progress(sum(artifact["size"] for artifact in chosen), f"job {self.id}", quiet) as bar:
            for artifact in chosen:
                written.append(self._download(artifact["name"], Path(dest), bar, on_progress))
        return written

    def _download(self, name: str, dest: Path, bar: Callable[[int], Any],
                  on_progress: Callable[[int], None] | None) -> Path:
        """One artifact into `dest`."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if name.startswith("/") or ".." in name.split("/"):
            raise InvalidRequestError(f"the server named an artifact {name!r}: not downloaded")
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            while chunk := self._call("job_artifact", self.id, name, out.tell(), doing=f"downloading {name}"):
                out.write(chunk)
                bar(len(chunk))
                if on_progress is not None:
                    on_progress(len(chunk))
        return target

    def cancel(self, timeout: float | None = CANCEL_WAIT) -> JobStatus:
        """Cancel the job if it has not ended (its owner or an admin may), and wait up to `timeout` seconds for
        its end; returns its status then: CANCELLED (or how it ended, if it ended first), or still RUNNING or
        PENDING if it had not stopped within `timeout` (0: do not wait)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        self._call("cancel", self.id)
        return self.wait(timeout) if timeout != 0 else self.status()

    def delete(self) -> None:
        """Remove the job's row, log and result; refused while it has not ended (cancel it first)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        self._call("delete", self.id)

    def __repr__(self) -> str:
        named = f" {self.name!r}" if self.name else ""
        return f"<rpycdl.Job {self.id}{named} {job_text(self.info, self.read_at)}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """What Jupyter shows of the job: its state now (read again unless it has ended), as text and as a
        table."""
        if not JobState(self.info["state"]).finished:
            with contextlib.suppress(RpycdlError, OSError, EOFError):  # then as last read, saying when
                self.refresh()
        table = displays.table(displays.JOB_HEADER, [displays.job_cells(self.info)],
                               f"job {self.id}, read at {self.read_at.strftime('%H:%M:%S')}")
        return {"text/plain": repr(self), "text/html": table}


def _status(info: dict[str, Any], read_at: datetime | None = None) -> JobStatus:
    return JobStatus(JobState(info["state"]), info.get("ahead"), info.get("error") or "", info.get("exit_code"),
                     None if info.get("holders") is None else tuple(info["holders"]), read_at,
                     info.get("queued", info.get("ahead")),
                     (info.get("request") or {}).get("after") if info["state"] == JobState.PENDING.value else None,
                     info.get("reason") or "", info.get("priority") or 0)
