"""A job's directories on the server: its working directory in (unpacked from the cache before it waits
for GPUs), its output directory out (uploaded to the artifact store once its GPUs are back and its end is
recorded). An upload that fails keeps the outputs on the server, the ledger saying why, until retried.
What clients see of the outputs (`outputs`) says "uploading" from the job's end until they are up. While the job
runs, its output directory is measured from outside it against --max-output (OutputQuota)."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rpycdl.artifacts.files import Identity
from rpycdl.artifacts.workdircache import unpack_kept
from rpycdl.defaults import OUTPUT_CHECK_INTERVAL, OUTPUT_DEPTH, OUTPUT_DIR_VARIABLE, WORKING_DIR_VARIABLE
from rpycdl.errors import ArtifactStoreError, InvalidRequestError, LimitError
from rpycdl.scheduler import dirfds, procs
from rpycdl.scheduler.jobfiles import OUTPUT_DIR, WORKING_DIR, JobFiles
from rpycdl.scheduler.ledger import JobRecord
from rpycdl.scheduler.lockdir import shared_dir
from rpycdl.security.accounts import Account
from rpycdl.server.context import ServerContext
from rpycdl.server.request import JobRequest
from rpycdl.units import format_size


def prepare(context: ServerContext, job_id: str, checked: JobRequest, array_id: str | None = None) -> dict[str, str]:
    """Make the job's output directory and unpack its working directory, unless there already (a detached
    job's, made when it was submitted), each handed to the job's owner once made (give); an array's element
    (`array_id`) copies its array's (keep). Returns the variables that name them to the job.

    Raises:
        InvalidRequestError: the working directory left the cache (evicted meanwhile: send it again), or its
            array's copy is gone.
    """
    if checked.container is not None:  # a container sees its image, not the server's files
        return {}
    files = context.files
    shared_dir(files.path(job_id))  # the tree's modes: its owner passes through to what is theirs
    give(files.path(job_id), OUTPUT_DIR, checked.account)
    env = {OUTPUT_DIR_VARIABLE: str(files.output_dir(job_id))}
    if checked.working_dir is None:
        return env
    digest = checked.working_dir

    def unpack(path: Path) -> None:
        try:
            if array_id is not None:
                unpack_kept(files.working_dir(array_id), path)
            else:
                context.working_dirs.unpack(digest, path, context.limits.max_working_dir)
        except (KeyError, FileNotFoundError):
            raise InvalidRequestError(f"the working directory {digest[:12]} left this server's cache before the "
                                      "job started: submit it again") from None

    give(files.path(job_id), WORKING_DIR, checked.account, unpack)
    env[WORKING_DIR_VARIABLE] = str(files.working_dir(job_id))
    return env


def keep(context: ServerContext, array_id: str, digest: str) -> None:
    """Keep the working directory `digest` for the array `array_id`, once, the server's own (WorkdirCache.keep, in
    the array's files, where its working directory would be): each element's copy is made from it as the element
    starts (prepare), whatever the cache evicts meanwhile. It goes with the array's shared files.

    Raises:
        InvalidRequestError: it left the cache (send it again), or passes --max-working-dir.
    """
    try:
        context.working_dirs.keep(digest, context.files.working_dir(array_id), context.limits.max_working_dir)
    except KeyError:
        raise InvalidRequestError(f"the working directory {digest[:12]} left this server's cache: submit it "
                                  "again") from None


def give(parent: Path, name: str, account: Account | None, fill: Callable[[Path], None] | None = None) -> None:
    """Make the directory `name` in the job's directory `parent` (root's) and hand it, with all `fill` puts in
    it, to the job's owner (mode 700) once, while only this process can reach it (dirfds.hand_over); where jobs
    run as the server's account (None), it stays the server's. One made before (at submission) is left as it
    is: its owner's, never walked again by the server."""
    dirfds.hand_over(parent, name, None if account is None else account.uid,
                     None if account is None else account.gid, fill)


class OutputQuota:
    """A job's output directory against the server's --max-output, measured from outside the job (output_size),
    when asked but at most every OUTPUT_CHECK_INTERVAL seconds, or ten times as long as the last measure took."""

    def __init__(self, context: ServerContext, job_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._files, self._job_id, self._limit, self._clock = context.files, job_id, context.limits.max_output, clock
        self._due = 0.0

    def over(self, now: bool = False) -> str | None:
        """Why the job must stop, naming --max-output, or None (also when the measure is not due, unless `now`)."""
        began = self._clock()
        if not now and began < self._due:
            return None
        try:
            used = output_size(self._files, self._job_id)
        except LimitError as exc:
            return f"the job's output directory could not be measured for --max-output: {exc}"
        ended = self._clock()
        self._due = ended + max(OUTPUT_CHECK_INTERVAL, 10 * (ended - began))
        if used <= self._limit:
            return None
        size = format_size(self._limit)
        return f"the job wrote more than {size} into its output directory, the server's --max-output"


def output_size(files: JobFiles, job_id: str) -> int:
    """Bytes the job's output directory holds (dirfds.usage: no link followed, hard links once), reached through
    root's directories only; 0 where there is none (a container's job), or no directory any more.

    Raises:
        LimitError: its directories nest deeper than OUTPUT_DEPTH levels.
    """
    try:
        with dirfds.opened_dir(files.path(job_id)) as job_dir, dirfds.opened_dir(OUTPUT_DIR, job_dir) as output:
            return dirfds.usage(output, OUTPUT_DEPTH)
    except OSError:
        return 0


def finish(context: ServerContext, record: JobRecord, saved: Mapping[str, Identity] | None = None) -> None:
    """After the job's end: its outputs uploaded (upload()), but what it `saved` while it ran and has not
    changed since; then its working directory removed."""
    upload(context, record, saved)
    context.files.remove_working_dir(record.job_id)


def upload(context: ServerContext, record: JobRecord, saved: Mapping[str, Identity] | None = None) -> None:
    """Upload what the job left in its output directory to the store under its user (files `saved`
    before and unchanged since are not sent again), record it in the ledger, and remove the directory; if
    the store fails, keep the directory and record why. A job that left nothing has its empty directory
    removed, and nothing recorded (outputs() tells it: state "none")."""
    job_id, ledger = record.job_id, context.ledger
    output = context.files.output_dir(job_id)
    with contextlib.suppress(OSError):  # gone, or not empty
        output.rmdir()  # empty, as most jobs leave it: gone in one call
    if not output.is_dir():
        return
    ledger.set_artifacts(job_id, "uploading", [])
    try:
        uploaded = context.store.upload(record.user, job_id, output, skip=saved, move=True)
    except (ArtifactStoreError, InvalidRequestError, OSError) as exc:
        there: list[dict[str, object]] = []  # those that went up before it failed
        with contextlib.suppress(ArtifactStoreError, InvalidRequestError):
            there = [artifact.listed() for artifact in context.store.list(record.user, job_id)]
        ledger.set_artifacts(job_id, "failed", there, f"{exc}; the outputs stay on the server: rpycdl artifacts "
                                                      f"{job_id} --retry")
    else:
        ledger.set_artifacts(job_id, "uploaded", [artifact.listed() for artifact in uploaded])
        shutil.rmtree(output, ignore_errors=True)


def outputs(context: ServerContext, record: JobRecord) -> dict[str, Any]:
    """Where the job's outputs stand, as clients see them: the ledger's entry ({"state": "none", "uploading",
    "uploaded" or "failed", "files", "error"}), but "uploading" from the job's end until its owner has dealt
    with its output directory (the entry may not say so yet: the row ends first), and "failed" if the owner
    died meanwhile leaving files there (they stay on the server, for a retry)."""
    pending = record.state.finished and context.files.output_dir(record.job_id).is_dir()  # before the entry:
    entry: dict[str, Any] = {"state": "none", "files": [], "error": "",  # read once the directory is gone, final
                             **(context.ledger.artifacts(record.job_id) or {})}
    if not pending or entry["state"] == "failed":
        return entry
    if procs.alive(record.owner_pid, record.owner_start):
        return {**entry, "state": "uploading"}
    if any(context.files.output_dir(record.job_id).glob("*")):  # gone meanwhile: none
        return {**entry, "state": "failed", "error": f"the job's owner (pid {record.owner_pid}) died before its "
                f"outputs were uploaded: they stay on the server: rpycdl artifacts {record.job_id} --retry"}
    return entry
