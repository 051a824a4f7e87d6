"""A connection's calls about detached jobs and the host's ledger: submit (a function, a command, a container),
a job's handle by id or name, the host's jobs, cancel. Mixed into `conn.root` (rpycdl.client.connection's
RemoteRoot), whose connection, size check and working directories they use."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rpycdl.client import credentials
from rpycdl.client.arrays import ArrayJob, ArrayStatus
from rpycdl.client.displays import JobList, client_row
from rpycdl.client.jobs import Job
from rpycdl.defaults import CANCEL_WAIT
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.security import results
from rpycdl.states import JobState
from rpycdl.wire import codec

if TYPE_CHECKING:
    from rpycdl.client.connection import Connection

EXISTS = ("error", "return", "replace")
"""What a submit does when you have a job of its name already (its `exists=`)."""

Handle = TypeVar("Handle", Job, ArrayJob)


def priority_sent(priority: Any) -> Any:
    """`priority=` as sent: None for its default, 0 (a server before priorities takes none); anything else as it is,
    for the server to check."""
    return None if priority == 0 and not isinstance(priority, bool) else priority


class DetachedCalls:
    """`conn.root`'s calls about detached jobs and the ledger."""

    _connection: Connection
    _check_size: Callable[[int], None]
    _working_dir: Callable[[str | os.PathLike[str] | None], str | None]
    _priority_sent = staticmethod(priority_sent)

    def submit(self, fn: Callable[..., Any] | bytes, args: Any = None, ngpus: int | None = None, *,
               gpus: float | None = None, gpu_memory: str | int | None = None, name: str | None = None,
               timeout: float | None = None, queue_timeout: float | None = None,
               working_dir: str | os.PathLike[str] | None = None, exists: str = "error",
               memory: str | int | None = None, cpus: float | None = None, after: str | None = None,
               retries: int = 0, retry_on_failure: bool = False, idle_reclaim: bool = True,
               priority: int = 0) -> Job:
        """Submit `fn(args)` as a detached job: it takes its place in the same first-come-first-served
        queue as run_code, and runs to its end whatever happens to this client or to the server
        process that accepted it. Returns its handle once the server has recorded it.

        Args:
            fn, args, ngpus, gpus, gpu_memory, timeout, queue_timeout, working_dir, memory, cpus: as for
                run_code (the working directory is unpacked for the job when it is submitted).
            name: a name to find it by (rpycdl.job(name)), unique among your unfinished jobs.
            exists: what to do if you have a job of that `name` already: "error" (the default: a second
                unfinished one is refused), "return" (return that job, unfinished, else the latest that
                ended, and submit nothing: a notebook cell you can run again), "replace" (cancel the
                unfinished one, wait for its end, then submit).
            after: its dependencies, "KIND:JOB[,JOB...]" (each JOB an id, or the name of one of your jobs): it
                takes its place in line only once every one of them has ended, "ok": SUCCEEDED (Slurm's afterok),
                "notok": other than SUCCEEDED, "any": however; if they end so that it never can, it ends FAILED
                with DependencyError, never having run.
            retries: how many times it is requeued (0 to 100) if its supervisor dies while it runs (LOST: a server
                or node restart) or its process is killed by a signal rpycdl did not send (the OOM killer, a kill);
                each attempt keeps its id and output directory, and sees its number in rpycdl.attempt(). Never after
                a cancel, its timeout or rpycdl's limits.
            retry_on_failure: also requeue it when it raised (a command: exited with another code than 0).
            idle_reclaim: False keeps its GPUs however long they show no utilization (run_code's idle_reclaim); a job
                whose GPUs a server reclaims is requeued if it has retries left, else ends with IdleReclaimedError.
            priority: as for run_code: from -10 to 10, higher goes first, above 0 within your ceiling.

        Raises:
            InvalidRequestError: a request it could never run, or a name you use already (exists="error"), or
                an `after` that names no job.
            DependencyError: a job of `after` has ended already so that it can never run: nothing is submitted.
            LimitError: over one of the server's limits (--max-payload, --max-queued), or the job to replace
                did not stop within CANCEL_WAIT.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show

        def submit() -> Job:
            payload = codec.encode_payload(fn, args)
            self._check_size(len(payload))
            digest = self._working_dir(working_dir)
            return self._submitted("submit", payload, ngpus, gpus, gpu_memory, timeout, queue_timeout, name, digest,
                                   fence=(memory, cpus, after, *self._retries_sent(retries, retry_on_failure),
                                          idle_sent(idle_reclaim),
                                          priority_sent(priority)))

        return self._named(name, exists, submit)

    def submit_command(self, command: list[str], ngpus: int | None = None, *, gpus: float | None = None,
                       gpu_memory: str | int | None = None, name: str | None = None, timeout: float | None = None,
                       queue_timeout: float | None = None, working_dir: str | os.PathLike[str] | None = None,
                       exists: str = "error", memory: str | int | None = None, cpus: float | None = None,
                       after: str | None = None, retries: int = 0, retry_on_failure: bool = False,
                       idle_reclaim: bool = True,
                       priority: int = 0) -> Job:
        """Submit a command (an argv, run on the server in its working directory) as a detached job; it
        fails unless it exits with 0, and its result is its exit code. Options as for submit."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return self._named(name, exists, lambda: self._submitted(
            "submit_command", list(command), ngpus, gpus, gpu_memory, timeout, queue_timeout, name,
            self._working_dir(working_dir),
            fence=(memory, cpus, after, *self._retries_sent(retries, retry_on_failure), idle_sent(idle_reclaim),
                   priority_sent(priority))))

    def submit_container(self, image: str, command: list[str], ngpus: int = 1, *, env: dict[str, str] | None = None,
                         workdir: str | None = None, mounts: list[dict[str, Any]] | None = None,
                         name: str | None = None, timeout: float | None = None,
                         queue_timeout: float | None = None, exists: str = "error") -> Job:
        """Submit a command in a container of `image` as a detached job (the generic `deeplearning`
        server only); arguments as for run_container, `name` and `exists` as for submit."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return self._named(name, exists, lambda: self._submitted(
            "submit_container", image, list(command), ngpus, env, workdir, mounts, timeout, queue_timeout, name))

    def _named(self, name: str | None, exists: str, submit: Callable[[], Handle],
               find: Callable[[str], Handle] | None = None) -> Handle:
        """`submit()`, as `exists` says for a job of `name` that you have already (submit's `exists`); `find` looks
        it up by name (an array's submit: `array`), by default `job`."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if exists not in EXISTS:
            raise InvalidRequestError(f"exists= takes {', '.join(map(repr, EXISTS))}, not {exists!r}")
        if exists == "error":
            return submit()
        if name is None:
            raise InvalidRequestError(f"exists={exists!r} needs name=: it finds your job by its name")
        found = self._mine(name, find or self.job)
        if found is not None and exists == "return":
            return found
        if found is not None and not _finished(found):
            status = found.cancel()
            if not status.finished:
                raise LimitError(f"job {found.id} ({name!r}) did not stop within {CANCEL_WAIT:g} s of its cancel: "
                                 "submit again once it has")
        try:
            return submit()
        except InvalidRequestError:
            again = self._mine(name, find or self.job) if exists == "return" else None
            if again is None or _finished(again):
                raise
            return again  # a submit of the same name won the race: that is the job

    @staticmethod
    def _retries_sent(retries: Any, on_failure: Any) -> tuple[Any, Any]:
        """`retries=` and `retry_on_failure=` as sent: None for their defaults (a server before retries takes none);
        anything else as it is, for the server to check."""
        return (None if retries == 0 and not isinstance(retries, bool) else retries,
                None if on_failure is False else on_failure)

    def _mine(self, name: str, find: Callable[[str], Handle]) -> Handle | None:
        """Your job (or array) of that name (unfinished, else the latest that ended) as `find` finds it, or None."""
        try:
            found = find(name)
        except InvalidRequestError:
            return None
        return found if found.name == name else None  # not a job whose id it happens to be

    def _submitted(self, name: str, *args: Any, fence: tuple[Any, ...] = ()) -> Job:
        """Call the submit `name` with `args` and a fresh seal of the job's result (security.results: made
        with this client's result key), then its `fence` (memory, cpus, after, retries, retry_on_failure,
        idle_reclaim, priority) up to the last given; the job's handle. A server that predates seals refuses the
        option: the job is submitted again without, and its result is then read unverified only
        (result(verify=False))."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        secret, _ = credentials.result_secret()
        fenced = given(*fence)  # servers before fencing, or before dependencies
        try:
            return Job(codec.decode_outcome(self._connection.call(name, *args, results.new_seal(secret).sent(),
                                                                  *fenced)), self._connection)
        except InvalidRequestError as exc:
            if not str(exc).startswith("too many arguments") or fenced:
                raise
        job = Job(codec.decode_outcome(self._connection.call(name, *args)), self._connection)
        where = job.info.get("server") or "this address"
        warnings.warn(f"the server at {where} predates sealed results: job {job.id}'s result cannot be verified "
                      "(result(verify=False) reads it unverified)", stacklevel=3)
        return job

    def job(self, ref: str) -> Job:
        """The handle of a job of this server's host, by id, or by name among your jobs.

        Raises:
            InvalidRequestError: no such job.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return Job(codec.decode_outcome(self._connection.call("job", ref)), self._connection)

    def jobs(self, *, all: bool = False, users: list[str] | None = None, states: list[str] | None = None,
             since: float | None = None, limit: int | None = None) -> JobList:
        """The rows of the jobs of this server's host (every server sharing its state directory), newest
        first: unfinished ones and those that ended in the last day, or with `all` every job kept. Each row is
        a dict of the job's fields (rpycdl.scheduler.ledger.JobRecord's; its times as datetimes), and the list
        shows as a table in Jupyter.

        Args:
            all: every job the ledger keeps (--keep), not only the recent ones.
            users, states: only these users' jobs, only jobs in these states (PENDING, RUNNING, ...).
            since: the jobs submitted in the last so many seconds, however long ago they ended (instead
                of the recent ones).
            limit: at most so many (default 100; 0: no limit).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        query = {key: value for key, value in
                 {"all": all, "users": users, "states": states, "since": since, "limit": limit}.items()
                 if value is not None}
        return JobList(client_row(codec.decode_outcome(self._connection.call("jobs", query))))

    def cancel(self, ref: str) -> str:
        """Request the cancel of a pending or running job by id or name; returns its state when the request
        was made (Job.cancel() waits for its end).

        Raises:
            NotAllowedError: the job is another user's, and this user is no admin.
            InvalidRequestError: the server's host has no such job.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return codec.decode_outcome(self._connection.call("cancel", ref))


def _finished(found: Job | ArrayJob) -> bool:
    """Whether a job, or every element of an array, had ended when its handle was last read."""
    if isinstance(found, ArrayJob):
        return ArrayStatus(found.info["counts"], found.size).finished
    return JobState(found.info["state"]).finished


def given(*options: Any) -> tuple[Any, ...]:
    """`options` up to the last that is not None: a server from before an option takes none of those after."""
    last = [index for index, value in enumerate(options) if value is not None]
    return options[:last[-1] + 1] if last else ()


def idle_sent(idle_reclaim: Any) -> Any:
    """`idle_reclaim=` as sent: None for its default (a server before it takes none)."""
    return None if idle_reclaim is True else idle_reclaim
