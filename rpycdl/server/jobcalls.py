"""The service's calls about the jobs of the host's ledger: submitting detached jobs, and for any job
(detached or attached, of any server sharing the state directory) its row, its log, waiting for its
end, its result, cancelling and deleting it, and listing jobs. Everyone sees that a job exists and
its state, GPUs and times, as the queue shows; only its owner or an admin sees the rest of its row (its
command, name, working directory, client, error: security.visibility), reads its log and result, cancels or
deletes it. Every call answers outcome bytes (wire.codec), so that errors keep their types. The host's
ledger counts the requests refused (Ledger.count_refusal): a run or submit request as its error is
answered (`refused`), a call about another user's job where it is found (`_find`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rpycdl.defaults import ARTIFACT_CHUNK, JOB_WAIT_MAX, JOBS_SHOWN, LOG_CHUNK, RECENT_JOBS
from rpycdl.errors import (
    InvalidRequestError,
    JobLostError,
    JobNotFinishedError,
    LimitError,
    NotAllowedError,
    RpycdlError,
)
from rpycdl.scheduler import arrays, attempts
from rpycdl.scheduler.ledger import JobRecord
from rpycdl.security import auth, results, visibility
from rpycdl.server import held, jobdirs, request, retries, status, supervisor
from rpycdl.server.commands import run_command
from rpycdl.server.context import ServerContext
from rpycdl.states import JobState
from rpycdl.wire import codec, netrefs

POLL = 0.05
"""Seconds between looks at a job's log and row while a call waits for them."""

ENDED = {JobState.CANCELLED: "JobCancelledError", JobState.TIMED_OUT: "JobTimeoutError",
         JobState.LOST: "JobLostError"}
"""The error a job's result raises when it ended without an outcome of its own, by state."""

REFUSED = ((InvalidRequestError, "invalid"), (LimitError, "limit"))
"""The errors that refuse a run or submit request, with the reason the ledger counts them under."""


class JobCalls:
    """The exposed calls about jobs, mixed into the service (rpycdl.server.service.GPUService), whose
    `context`, `_identity` and `_request` they use."""

    context: ServerContext
    _identity: auth.Identity
    _request: Callable[..., request.JobRequest]

    # -- submitting --------------------------------------------------------------------

    def exposed_submit(self, payload: bytes, *args: Any, **kwargs: Any) -> bytes:
        """Submit a detached job: a payload made by codec.encode_payload (everything in band); options
        (request.SUBMIT_OPTIONS, positionally or by name): ngpus, gpus, gpu_memory, timeout, queue_timeout,
        name, working_dir, seal (its result's: security.results), memory, cpus, after, retries, retry_on_failure,
        priority.
        Answers the job's row once its supervisor owns it."""
        def submit() -> dict[str, Any]:
            request.check_size(payload, "payload", self.context.limits.max_payload)
            return self._submit(args, kwargs, body=codec.check_payload(payload))

        return _answer(submit, self.context)

    def exposed_submit_command(self, argv: Any, *args: Any, **kwargs: Any) -> bytes:
        """Submit a command (a list of strings) as a detached job; options as for submit. It fails
        unless it exits with 0; its exit code is its result."""
        def submit() -> dict[str, Any]:
            command = request.check_command(netrefs.materialize(argv, self.context.limits.max_payload))
            body = codec.check_payload(codec.encode_payload(run_command, list(command)))
            return self._submit(args, kwargs, body=body, command=command)

        return _answer(submit, self.context)

    def exposed_submit_container(self, image: str, command: Any, *args: Any, **kwargs: Any) -> bytes:
        """Submit a command in a container of its own as a detached job (the generic server; see
        run_container); options (request.SUBMIT_CONTAINER_OPTIONS): ngpus (default 1), env, workdir,
        mounts, timeout, queue_timeout, name."""
        def submit() -> dict[str, Any]:
            from rpycdl.server import containers  # docker is only needed by servers that run containers

            options = request.named(request.SUBMIT_CONTAINER_OPTIONS, args, kwargs)
            place = [options.pop(name, None) for name in ("env", "workdir", "mounts")]
            raw = netrefs.materialize((image, command, *place), self.context.limits.max_payload)
            asked = dict(zip(("image", "command", "env", "workdir", "mounts"), raw, strict=True))
            spec = containers.check_job(asked["image"], asked["command"], env=asked["env"], workdir=asked["workdir"],
                                        mounts=asked["mounts"])
            options["ngpus"] = 1 if options.get("ngpus") is None else options["ngpus"]
            name, seal = request.check_name(options.pop("name", None)), results.check_seal(options.pop("seal", None))
            checked = self._request(options, container=spec, detached=True, name=name)
            return _shown(self.context, supervisor.hand_over(self.context, checked, asked, seal), self._identity, {})

        return _answer(submit, self.context)

    def _submit(self, args: tuple[Any, ...], kwargs: dict[str, Any], **job: Any) -> dict[str, Any]:
        options = request.named(request.SUBMIT_OPTIONS, args, kwargs)
        detached, seal, after = self._detached(options)
        checked = self._request(options, **detached, **job)
        held_back = after is not None and after[1]
        record = supervisor.hand_over(self.context, checked, seal=seal, held=held_back)
        return _shown(self.context, record, self._identity,  # a new row, last in line or held: its status says
                      None if after is not None and not held_back else {})  # where (one with after=, met: its place)

    def _detached(self, options: dict[str, Any], size: int | None = None) -> tuple[
            dict[str, Any], results.Seal | None, tuple[str, bool] | None]:
        """Take a detached submit's own options out of `options` (name, seal, retries, retry_on_failure, after; an
        array's, of `size` elements, may wait element by element: held.check_after), checked: the request's keywords
        for them, the seal, and the dependency as held.check_after resolved it."""
        name, seal = request.check_name(options.pop("name", None)), results.check_seal(options.pop("seal", None))
        retries, on_failure = attempts.check(options.pop("retries", None), options.pop("retry_on_failure", None))
        after = held.check_after(options.pop("after", None), self._find, (self._identity.user, self._identity.verified),
                                 self.context, size)
        return {"detached": True, "name": name, "after": None if after is None else after[0], "retries": retries,
                "retry_on_failure": on_failure}, seal, after

    # -- any job of the ledger ---------------------------------------------------------

    def exposed_job(self, ref: Any) -> bytes:
        """A job's row by id (or by name among the caller's jobs), with `ahead` and `holders` while it waits;
        another user's job as security.visibility shows it."""
        return _answer(lambda: _shown(self.context, self._find(ref), self._identity))

    def exposed_job_attempts(self, ref: Any) -> bytes:
        """A job's attempts, first first (its owner or an admin may ask): the earlier ones of a job its `retries=`
        requeued (rpycdl.scheduler.attempts), then the one its row tells now; each {"attempt", "state", "started",
        "ended", "error", "error_type", "exit_code", "gpu_uuids"}."""
        def history() -> list[dict[str, Any]]:
            record = self._find(ref, mine=True)
            now = {key: value for key, value in record.to_dict().items() if key in attempts.HISTORY}
            return [*self.context.ledger.attempts(record.job_id), now]

        return _answer(history)

    def exposed_job_wait(self, ref: Any, timeout: Any = None) -> bytes:
        """A job's row once it has ended, or after `timeout` seconds (JOB_WAIT_MAX at most: call again)."""
        def wait() -> dict[str, Any]:
            seconds = min(request.check_seconds(timeout, "timeout") or JOB_WAIT_MAX, JOB_WAIT_MAX)
            record = self._find(ref)
            deadline = time.monotonic() + seconds
            while not record.state.finished and time.monotonic() < deadline:
                time.sleep(POLL)
                record = self.context.ledger.get(record.job_id) or record
            return _shown(self.context, record, self._identity)

        return _answer(wait)

    def exposed_job_log(self, ref: Any, offset: Any = 0, wait: Any = None, tail: Any = None) -> bytes:
        """Up to LOG_CHUNK bytes of a job's log from `offset` (or from where its last `tail` lines
        begin), waiting up to `wait` seconds for some if there are none yet and the job runs.
        Answers (data, next offset, whether the job has ended and its log is all read)."""
        def read() -> tuple[bytes, int, bool]:
            record = self._find(ref, mine=True)
            files, job_id = self.context.files, record.job_id
            start = files.tail_offset(job_id, _count(tail, "tail")) if tail is not None else _count(offset, "offset")
            seconds = min(request.check_seconds(wait, "wait") or 0.0, JOB_WAIT_MAX)
            deadline = time.monotonic() + seconds
            while True:
                ended = record.state.finished
                data = files.read_log(job_id, start, LOG_CHUNK)
                if data or ended or time.monotonic() >= deadline:
                    return data, start + len(data), ended and start + len(data) >= files.log_size(job_id)
                time.sleep(POLL)
                record = self.context.ledger.get(job_id) or record

        return _answer(read)

    def exposed_job_result(self, ref: Any, sealed: Any = False) -> bytes | tuple[str, bytes]:
        """A finished job's outcome: its value, or the exception it raised (or the error that ended it:
        cancelled, timed out, lost, failed before it ran). JobNotFinishedError while it has not ended.

        With `sealed` (clients that verify results: security.results), ("result", the result file as it is,
        its seal included) or ("error", this server's own outcome: an error); else the outcome alone, its
        seal left unverified (clients from before sealed results)."""
        try:
            record = self._find(ref, mine=True)
            if not record.state.finished:
                raise JobNotFinishedError(f"job {record.job_id} is {record.state.value}: it has not ended yet")
            stored = self.context.files.result(record.job_id)
            if stored is not None:
                return ("result", stored) if sealed else results.unverified(stored)
            outcome = codec.encode_error(_ended(record), tb="")
        except RpycdlError as exc:
            outcome = codec.encode_error(exc, tb="")
        return ("error", outcome) if sealed else outcome

    def exposed_job_artifacts(self, ref: Any, retry: Any = False, wait: Any = None) -> bytes:
        """Where a job's outputs stand (its owner or an admin may ask): {"state": "none" (it left none),
        "uploading" (from its end until they are up), "uploaded" or "failed" (kept on the server), "files":
        [{"name", "size"}], "error", "store"} (jobdirs.outputs); with `retry`, a failed upload of a finished job
        is tried again first; with `wait`, waits up to so many seconds (JOB_WAIT_MAX at most: call again) while
        they are uploading."""
        def artifacts() -> dict[str, Any]:
            record = self._find(ref, mine=True)
            entry = jobdirs.outputs(self.context, record)
            if retry:
                if not record.state.finished or entry["state"] not in ("failed", "none"):
                    raise InvalidRequestError(f"job {record.job_id} has no failed upload to retry "
                                              f"({record.state.value}, artifacts {entry['state']})")
                jobdirs.upload(self.context, record)
                entry = jobdirs.outputs(self.context, record)
            deadline = time.monotonic() + min(request.check_seconds(wait, "wait") or 0.0, JOB_WAIT_MAX)
            while entry["state"] == "uploading" and time.monotonic() < deadline:
                time.sleep(POLL)
                entry = jobdirs.outputs(self.context, record)
            return {**entry, "store": self.context.artifact_store}

        return _answer(artifacts)

    def exposed_job_artifact(self, ref: Any, name: Any, offset: Any = 0) -> bytes:
        """Up to ARTIFACT_CHUNK bytes of one of a job's uploaded artifacts from `offset` (b"" at its end),
        read from the store by this server: clients never get the store's credentials."""
        def read() -> bytes:
            record = self._find(ref, mine=True)
            entry = self.context.ledger.artifacts(record.job_id) or {"files": []}
            if not isinstance(name, str) or name not in {artifact["name"] for artifact in entry["files"]}:
                raise InvalidRequestError(f"job {record.job_id} has no uploaded artifact {name!r}: see "
                                          f"`rpycdl artifacts {record.job_id}`")
            return self.context.store.read(record.user, record.job_id, name, _count(offset, "offset"), ARTIFACT_CHUNK)

        return _answer(read)

    def exposed_cancel(self, ref: Any) -> bytes:
        """Cancel a pending or running job (its owner or an admin may); answers its state when asked.
        A finished job is left as it is."""
        def cancel() -> str:
            record = self._find(ref, mine=True)
            asked = self.context.ledger.request_cancel(record.job_id) or record
            if not (asked.detached and asked.state is JobState.PENDING and (
                    supervisor.cancel_queued(self.context, record.job_id) or held.cancel(self.context, asked)
                    or retries.cancel(self.context, asked))):
                self.context.locks.wake_all()  # its process sees the cancel
            return asked.state.value

        return _answer(cancel)

    def exposed_delete(self, ref: Any) -> bytes:
        """Remove a finished job's row, log and result (its owner or an admin may); a job that has not
        ended is refused: cancel it first."""
        def delete() -> str:
            record = self._find(ref, mine=True)
            self.context.ledger.delete(record.job_id)  # InvalidRequestError if it has not ended
            self.context.files.remove(record.job_id)
            return record.job_id

        return _answer(delete)

    def exposed_jobs(self, query: Any = None) -> bytes:
        """The host's jobs, newest first: by default the unfinished ones and those that ended in the last
        RECENT_JOBS seconds, JOBS_SHOWN at most. `query` may give: all (every job kept), users, states,
        since (submitted in the last so many seconds, finished or not: instead of the default view),
        limit (0: no limit). A waiting job's row has `ahead` and `holders`, as job() answers; other users' jobs
        as security.visibility shows them."""
        def jobs() -> list[dict[str, Any]]:
            records = _query(self.context, netrefs.materialize(query or {}, self.context.limits.max_payload))
            waiting = any(record.state is JobState.PENDING for record in records)
            places = status.lines(self.context) if waiting else {}  # one snapshot for every waiting job's place
            return [_shown(self.context, record, self._identity, places) for record in records]

        return _answer(jobs)

    def _find(self, ref: Any, mine: bool = False) -> JobRecord:
        """The job `ref` names (an id, or one of the caller's names); with `mine`, only for its owner
        or an admin."""
        if not isinstance(ref, str) or not ref or not ref.replace("-", "").replace("_", "").replace(".", "").replace(
                "[", "").replace("]", "").isalnum():
            raise InvalidRequestError(f"not a job id or name: {ref!r}")
        me = self._identity  # an array's element by its array and index, `sweep[3]`, too
        record = self.context.ledger.find(ref, me.user, me.verified) or arrays.find_element(
            self.context.ledger, ref, me.user, me.verified)
        if record is None:
            raise InvalidRequestError(f"no job {ref!r} here: see `rpycdl jobs --all` for the jobs this host keeps")
        owner = auth.Identity(record.user, record.user_verified)
        if mine and not visibility.sees_all(me, owner):
            self.context.ledger.count_refusal(self.context.name, "not_allowed")  # the one place it is refused
            raise NotAllowedError(visibility.refusal(record.job_id, owner, me))
        return record


def _answer(make: Callable[[], Any], submitted: ServerContext | None = None) -> bytes:
    """What `make` returns (rows and ids: plain data), or its error; for a submit request, its server's
    context (`submitted`): the refusal is counted."""
    try:
        return codec.encode_data(make())
    except RpycdlError as exc:
        return codec.encode_error(exc if submitted is None else refused(submitted, exc), tb="")


def refused(context: ServerContext, exc: RpycdlError) -> RpycdlError:
    """`exc`, the error a run or submit request is answered with, counted in the host's ledger if it
    refuses the request (REFUSED); a job's own end (a timeout, a cancel) is not a refusal."""
    reason = next((reason for kind, reason in REFUSED if isinstance(exc, kind)), None)
    if reason is not None:
        context.ledger.count_refusal(context.name, reason)
    return exc


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"{name} must be a whole number, 0 or more, not {value!r}")
    return value


def _shown(context: ServerContext, record: JobRecord, viewer: auth.Identity,
           places: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """A row as `viewer` sees it (security.visibility): while it waits, with `ahead` (requests before it in
    line) and `holders` (the jobs holding the GPUs it waits for: status.lines, `places` if given, else read now
    for it alone), and its log's size while it runs."""
    shown = record.to_dict()
    if record.state is JobState.PENDING:
        shown.update(status.in_line(context, record.job_id) if places is None
                     else places.get(record.job_id, status.NOT_IN_LINE))
    if record.detached and not record.state.finished:
        shown["log_bytes"] = context.files.log_size(record.job_id)
    return visibility.shown(shown, viewer, auth.Identity(record.user, record.user_verified))


def _ended(record: JobRecord) -> RpycdlError:
    """The error a job's result raises when it left no outcome of its own."""
    from rpycdl import errors

    preempted = record.error_type == errors.PreemptedError.__name__  # a cancel of its own kind
    kind = getattr(errors, record.error_type if preempted else ENDED.get(record.state, record.error_type), None)
    if not (isinstance(kind, type) and issubclass(kind, RpycdlError)):
        kind = JobLostError if record.state is JobState.LOST else RpycdlError
    return kind(f"job {record.job_id} {record.state.value}: {record.error}")


def _query(context: ServerContext, query: Any) -> list[JobRecord]:
    """The rows a `jobs` query asks for (checked)."""
    if not isinstance(query, dict) or set(query) - {"all", "users", "states", "since", "limit"}:
        raise InvalidRequestError(f"a jobs query has all, users, states, since and limit, not {query!r}")
    users, states = query.get("users"), query.get("states")
    if users is not None and not (isinstance(users, list) and all(isinstance(user, str) for user in users)):
        raise InvalidRequestError(f"users must be a list of names, not {users!r}")
    try:
        states = None if states is None else [JobState(str(state).upper()) for state in states]
    except ValueError:
        raise InvalidRequestError(f"states are {', '.join(s.value for s in JobState)}, not {states!r}") from None
    limit = _count(query.get("limit", JOBS_SHOWN), "limit")
    return context.ledger.query(users=users, states=states, **window(query.get("all"),
                                request.check_seconds(query.get("since"), "since"), time.time()), limit=limit or None)


def window(every: Any, since: float | None, now: float) -> dict[str, float | None]:
    """The times a jobs query reads between, as Ledger.query's `since` and `active_or_ended_since`: those
    submitted in the last `since` seconds, if given; else with `every` all jobs, else the default view (the
    unfinished ones and those ended in the last RECENT_JOBS seconds)."""
    if since is not None:
        return {"since": now - since, "active_or_ended_since": None}
    return {"since": None, "active_or_ended_since": None if every else now - RECENT_JOBS}
