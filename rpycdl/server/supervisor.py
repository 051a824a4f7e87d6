"""A detached job's supervisor: the process that owns the job from its turn to its end, so that the job
outlives its client and the server that accepted it.

A detached job waits as a row (hand_over): the connection process that accepts it writes its files
(rpycdl.scheduler.jobfiles), takes its place in line as a queue entry that no process keeps
(GPULockManager.enqueue_row) and records it in the ledger with no owner. Nothing runs for it meanwhile. When
its turn comes, a dispatcher of whichever server of the lock directory is up claims the entry (one claim
wins) and has the server's forkserver fork its supervisor (rpycdl-superv) in a session of its own (start,
forked), handing it the claim (the descriptor of the entry's wake-up FIFO) and, down a pipe, its state
directory, job id and ticket (nothing of the job on a command line, which every user reads); it records the
supervisor as the job's owner, and only then says go (confirm). The supervisor runs the job's flow
(rpycdl.server.jobflow) as a connection process would, without a client: it takes its grant, holds the GPU
locks, forks the job process, writes its output to the job's log and its outcome to its result file, and
records its end. Nothing else of the server is needed meanwhile: a server that stops or dies, and the one that
starts in its place, leave it alone (DLServer._adopted).

If the supervisor dies before its grant, its claim lapses with it and a dispatcher starts another; after it,
its job process dies with it (it dies with its parent), its GPUs go back once nothing of the job runs, and any
server's sweep marks the job LOST (rpycdl.scheduler.sweep)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sqlite3
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from rpycdl.defaults import DISPATCH_AHEAD, SUPERVISOR_NAME
from rpycdl.errors import InvalidRequestError, LimitError, RpycdlError
from rpycdl.gpu.inventory import load_inventory
from rpycdl.scheduler import attempts, procs
from rpycdl.scheduler.holders import Grant
from rpycdl.scheduler.jobfiles import JobFiles, LogWriter
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.scheduler.lockdir import shared_dir
from rpycdl.scheduler.policies import FCFS, Scheduling
from rpycdl.scheduler.queuedir import Need, Place
from rpycdl.scheduler.shares import GPURequest, ShareRules
from rpycdl.security import results
from rpycdl.security.accounts import Account, Accounts
from rpycdl.security.auth import Identity
from rpycdl.server import child, elements, jobdirs, orphans, request, runner
from rpycdl.server.context import Limits, ServerContext
from rpycdl.server.forklink import ForkServerLink
from rpycdl.server.handover import Handover
from rpycdl.server.jobflow import JobFlow, check_queue_limits, need_of, queue_info
from rpycdl.server.keeper import PID
from rpycdl.states import JobState
from rpycdl.wire import codec

GO = b"go"
END_RETRY = 1.0
"""Seconds between tries to record a job's end while the ledger cannot be written (a full disk)."""


# -- the connection process's side ------------------------------------------------------------


def hand_over(context: ServerContext, checked: request.JobRequest, container: dict[str, Any] | None = None,
              seal: results.Seal | None = None, held: bool = False) -> JobRecord:
    """Accept a detached job: write its files, take its place in line as a row (no process waits for it: when
    its turn comes, a server of the lock directory starts its supervisor, start()), record it. Returns its
    ledger row.

    Args:
        context: the accepting server's.
        checked: the request (`detached`), with its payload `body`, or its container.
        container: the container request as the client gave it (image, command, env, workdir,
            mounts), which the supervisor checks again.
        held: it waits for its dependencies (checked.after: rpycdl.server.held) first: it takes no place in line
            now; the queue entry it will have is kept in its spec ("queue"), for the sweep that releases it.
        seal: the client's seal of the job's result: its nonce and key id go to the row, its key to a file
            of the job's that this account alone reads (security.results.write_job_key).

    Raises:
        InvalidRequestError: the user has an unfinished job of that name.
        LimitError: the queue is full.
    """
    record = JobFlow.new_record(context, checked)
    record.owner_pid, record.owner_start = 0, 0  # no process owns it until its supervisor starts
    if seal is not None:
        record.result_nonce, record.result_key_id = seal.nonce, seal.key_id
    if checked.name is not None:
        existing = context.ledger.find(checked.name, checked.owner.user)
        if existing is not None and not existing.state.finished and existing.name == checked.name:
            raise _duplicate(checked.name, existing)
    waiting = check_queue_limits(context, checked)
    context.files.begin(record.job_id)
    ticket = None
    deadline = None if checked.queue_timeout is None else record.submitted + checked.queue_timeout
    entry = {"need": need_of(context, record).entry(), "info": {
        **queue_info(context, record, checked), "state_dir": context.state_dir, "deadline": deadline}}
    try:
        context.files.create(record.job_id, {**_spec(context, checked, container), "queue": entry}, checked.body)
        if seal is not None:
            results.write_job_key(context.files.path(record.job_id), seal.key)
        jobdirs.prepare(context, record.job_id, checked)  # now: the cache may let its working directory go later
        # The row's entry first: a row in the ledger without one would never run (a dispatcher skips an entry
        # until its row is there, and a sweep drops it if its maker died first: sweep.remove_unrecorded). A held
        # job's row waits without one: a sweep gives it one once its dependencies are met (rpycdl.server.held).
        if not held:
            ticket = context.locks.enqueue_row(Need.from_entry(entry["need"]), entry["info"])
        context.ledger.save(record)  # InvalidRequestError if a submission of the same name won the race
        context.files.recorded(record.job_id)
    except BaseException:
        if ticket is not None:
            context.locks.leave(ticket)
        context.files.remove(record.job_id)
        raise
    if not held and (waiting < DISPATCH_AHEAD or context.scheduling.policy != FCFS):  # else it waits behind
        context.locks.wake_listeners()  # them: the dispatchers' next pass is soon enough (they pass twice a second)
    return record


def confirm(ledger: Ledger, record: JobRecord, pid: int, go: int) -> bool:
    """Make a started supervisor the owner of its job's row and send it GO, if the row still waits as `record`
    read it (no other supervisor started meanwhile); without GO it leaves at once, and its claim with it.
    Returns whether it went on."""
    try:
        if not ledger.set_owner(record.job_id, procs.identify(pid), (record.owner_pid, record.owner_start)):
            return False
        child.write_all(go, GO)
        return True
    finally:
        os.close(go)


def cancel_queued(context: ServerContext, job_id: str) -> bool:
    """Cancel a detached job waiting as a row that no supervisor holds yet: it leaves the queue and ends
    CANCELLED here. Returns False if it is no such row (a supervisor holds it: it sees the cancel itself)."""
    if not context.locks.drop_row(job_id):
        return False
    _end_unstarted(context, job_id)
    return True


def _end_unstarted(context: ServerContext, job_id: str) -> None:
    """End a cancelled detached job that never started: its copies and payload go, its outputs (none) stay."""
    context.files.remove_working_dir(job_id)
    context.files.drop_payload(job_id)
    results.drop_job_key(context.files.path(job_id))
    context.ledger.end(job_id, JobState.CANCELLED, f"job {job_id} was cancelled while waiting", "JobCancelledError")


def _duplicate(name: str, existing: JobRecord) -> InvalidRequestError:
    return InvalidRequestError(f"you already have an unfinished job named {name!r} ({existing.job_id}, "
                               f"{existing.state.value}): choose another name=, or cancel it first")


def _spec(context: ServerContext, checked: request.JobRequest, container: dict[str, Any] | None) -> dict[str, Any]:
    """What the supervisor needs to run the job as the accepting server would."""
    return {"server": {"name": context.name, "aliases": list(context.aliases), "inventory": context.inventory.spec,
                       "lock_dir": context.lock_dir, "server_id": context.server_id, "host": context.host,
                       "port": context.port, "framework_version": context.framework_version,
                       "limits": context.limits.to_dict(), "shares": {"unit": context.shares.unit,
                                                                      "allowance": context.shares.allowance},
                       "artifact_store": context.artifact_store, "artifact_endpoint": context.artifact_endpoint,
                       "scheduling": context.scheduling.to_dict(), "accounts": context.accounts.to_dict()},
            "request": {"ngpus": checked.gpu_request.ngpus, "share_bytes": checked.gpu_request.share_bytes,
                        "user": checked.owner.user, "verified": checked.owner.verified, "client": checked.client,
                        "timeout": checked.timeout, "queue_timeout": checked.queue_timeout, "name": checked.name,
                        "command": None if checked.command is None else list(checked.command),
                        "container": container, "working_dir": checked.working_dir,
                        "account": None if checked.account is None else checked.account.to_dict(),
                        "memory": checked.memory, "cpus": checked.cpus}}


def start(entry: dict[str, Any], place: Place, launcher: runner.Launcher) -> tuple[int, int]:
    """Start the supervisor of a queued row that a server's dispatcher claimed (locks.dispatch): forked by the
    server's forkserver (`launcher`: clean of the server's memory, and warm, so that no interpreter starts per
    job), in a session of its own, with the claim's place, which it inherits (the caller closes its own
    descriptor: the claim is the supervisor's, or lapses); confirm() lets it go on. Returns its pid and the pipe
    to send it GO on. The credentials of this process's environment, which the forkserver's lacks
    (child.clean_environment), come down a pipe that the supervisor reads only once its job process is forked,
    so that no job ever holds them; so do its state directory, job id and ticket (nothing of a job on a
    command line, which every user reads).

    Raises:
        LimitError: no process could be started (the claim lapses: the row is dispatched again).
    """
    go_r, go_w = os.pipe()
    secrets_r, secrets_w = os.pipe()
    clean = child.clean_environment(os.environ)
    told = {"state_dir": entry["state_dir"], "job_id": entry["job_id"], "ticket": place.ticket,
            "array_id": entry.get("array_id"),
            "environ": {name: value for name, value in os.environ.items() if name not in clean}}
    child.write_all(secrets_w, json.dumps(told).encode())  # a few variables: the pipe holds them
    os.close(secrets_w)
    try:
        launched = launcher.launch("supervisor", [os.dup(place.fifo_fd), go_r, secrets_r])  # they go with it
        try:
            return launched.pid, go_w
        finally:
            launched.close()
    except BaseException:
        os.close(go_w)
        raise


def forked(control: int, fds: list[int]) -> NoReturn:
    """In a child the forkserver just forked (rpycdl.server.forkserver): become the supervisor of the row whose
    claim, GO pipe and secrets pipe are `fds` (start), in a session of its own, after telling the requester on
    `control` its pid, start time and pidfd. Never returns."""
    code = 1
    try:
        child.keep_only([control, *fds])
        os.setsid()  # no signal for the server's session or group reaches it
        child.name_process(SUPERVISOR_NAME)
        pidfd = os.pidfd_open(os.getpid())
        with socket.socket(fileno=control) as requester:
            socket.send_fds(requester, [PID.pack(*procs.identify(os.getpid()))], [pidfd])
        os.close(pidfd)
        code = supervise(*fds)
    except BaseException:  # noqa: BLE001 - whatever it was, it is told, and the process ends
        traceback.print_exc()
    finally:
        os._exit(code)


# -- the supervisor's side -------------------------------------------------------------------


class Supervised:
    """A detached job's jobflow.Link: no client; its job process forked when the supervisor started; its
    outcome goes to its result file."""

    def __init__(self, context: ServerContext, record: JobRecord, spare: runner.JobProcess | None) -> None:
        self._context, self._record, self._spare = context, record, spare

    def socket_fds(self) -> list[int]:
        return []

    def serve_client(self) -> None:
        pass

    def push(self, receive: Any, layout: codec.Layout, fd: int) -> int:
        raise RuntimeError("a detached job's result has no client to go to")

    def take_spare(self) -> runner.JobProcess | None:
        spare, self._spare = self._spare, None
        return spare

    def defer(self, end: Any) -> None:
        end()

    def keep(self, outcome: bytes) -> int | None:
        """Write the job's result file: its outcome, sealed with the key its client gave it (if it gave one:
        security.results), which its result is refused without."""
        job_id, files = self._record.job_id, self._context.files
        if self._record.result_nonce is not None:  # an array's elements share its key (rpycdl.server.arrays)
            key = results.read_job_key(files.path(self._record.array_id or job_id), job_id)
            outcome = results.seal(key, job_id, outcome)
        return files.store_result(job_id, outcome)


def _context(spec: dict[str, Any], state_dir: str) -> ServerContext:
    """The context of the server that accepted the job, as its spec tells it. Its launcher is that server's
    forkserver: once this process holds the credentials, every process it needs (a load check, a job process)
    comes from there, clean, never from a fork of this one."""
    server = spec["server"]
    return ServerContext(name=server["name"], aliases=tuple(server["aliases"]),
                         inventory=load_inventory(server["inventory"]), lock_dir=server["lock_dir"],
                         state_dir=state_dir, server_id=server["server_id"], host=server["host"],
                         port=server["port"], framework_version=server["framework_version"],
                         limits=Limits(**server["limits"]), shares=ShareRules(**server["shares"]),
                         artifact_store=server.get("artifact_store", ""),
                         artifact_endpoint=server.get("artifact_endpoint"),
                         scheduling=Scheduling.from_dict(server["scheduling"]),
                         accounts=Accounts.from_dict(server["accounts"]) if "accounts" in server else Accounts(),
                         ledger_checked=True, launcher=ForkServerLink(server["server_id"], reuse=True))


def _request(spec: dict[str, Any], body: bytes | None, write: Callable[[str], None]) -> request.JobRequest:
    asked = spec["request"]
    container = None
    if asked["container"] is not None:
        from rpycdl.server import containers  # docker is only needed by servers that run containers

        raw = asked["container"]
        container = containers.check_job(raw["image"], raw["command"], env=raw["env"], workdir=raw["workdir"],
                                         mounts=raw["mounts"])
    return request.JobRequest(
        GPURequest(asked["ngpus"], asked["share_bytes"]), Identity(asked["user"], asked["verified"]), asked["client"],
        body=body, container=container, command=None if asked["command"] is None else tuple(asked["command"]),
        timeout=asked["timeout"], queue_timeout=asked["queue_timeout"], name=asked["name"], detached=True,
        output=request.Output(write, write), working_dir=asked.get("working_dir"),
        account=None if asked.get("account") is None else Account.from_dict(asked["account"]),
        memory=asked.get("memory"), cpus=asked.get("cpus"))


def supervise(fifo_fd: int, go_fd: int, secrets_fd: int) -> int:
    """Run one detached job to its end (the supervisor's life); returns the process's exit code. Its job
    process is forked first, while this process holds nothing but its arguments; then come down `secrets_fd`
    its state directory, job id and ticket (its place in line, whose FIFO is `fifo_fd`) and the credentials."""
    spare = None
    with contextlib.suppress(LimitError):  # no process to spare now: the flow forks one when the job starts
        spare = runner.JobProcess(orphans.HERE)
    with os.fdopen(secrets_fd, "rb") as secrets:
        told = json.loads(secrets.read())
    os.environ.update(told["environ"])
    state_dir, job_id, place = told["state_dir"], told["job_id"], Place(told["ticket"], fifo_fd)
    array_id = told.get("array_id")  # an array's element: its array's spec and payload (rpycdl.server.arrays)
    with os.fdopen(go_fd, "rb") as go:
        told = go.read(len(GO))
    if told != GO:  # its row was cancelled, or its dispatcher died: the row waits on, for another
        return 1
    try:
        spec = JobFiles(state_dir).spec(array_id or job_id)
        context = _context(spec, state_dir)
        context.locks.claim_scheduling()  # a server started with another policy is refused while this one waits
        record = context.ledger.get(job_id)
        assert record is not None, "the ledger lost a row it had when GO was sent"
    except (OSError, ValueError, KeyError, TypeError, AssertionError, RpycdlError) as exc:
        Ledger(state_dir).end(job_id, JobState.FAILED, f"its supervisor could not start: {exc}", type(exc).__name__)
        return 1
    if record.cancel_requested:  # asked as its supervisor started: it never runs
        context.locks.leave(place.ticket)
        _end_unstarted(context, job_id)
        return 0
    if array_id is None:
        _run(context, record, spec, place, spare)
    else:
        _run_elements(context, record, spec, place, spare, array_id)
    return 0


def _run_elements(context: ServerContext, record: JobRecord, spec: dict[str, Any], place: Place,
                  spare: runner.JobProcess | None, array_id: str) -> None:
    """Run the array's element `record`, then each element its GPUs are handed to in turn (rpycdl.server.handover)."""
    handover, grant, waited = Handover(context, array_id), None, place  # the first element's place, the others' grant
    try:
        while True:
            shared_dir(context.files.path(record.job_id))  # an element has no directory until it starts
            _run(context, record, spec, waited, spare, handover, grant)
            handed = handover.take()
            if handed is None:
                return
            (grant, record, spare), waited = handed, None
            if record.cancel_requested:  # asked as its row was handed over: it never runs
                spare.close()
                context.locks.release(grant)
                _end_unstarted(context, record.job_id)
                elements.ended(context, record)
                return
    finally:
        handover.close()


def _run(context: ServerContext, record: JobRecord, spec: dict[str, Any], place: Place | None,
         spare: runner.JobProcess | None, handover: Handover | None = None, grant: Grant | None = None) -> None:
    """Run the job's flow, its output to its log; then its end: its payload and result key go, and its row's end is
    made sure of, unless the flow requeued it (its `retries=`: rpycdl.scheduler.attempts). An array's element runs
    its array's payload, on the `grant` the last element handed it, if any, and its GPUs go to the next through its
    `handover`, which then holds its end back until the next one's job has started."""
    job_id, array_id, requeued, flow = record.job_id, record.array_id, [], None
    log = LogWriter(context.files.path(job_id, "log"), context.limits.max_log)

    def write(text: str) -> None:
        try:
            log.write(text)
        finally:
            record.log_bytes = log.size

    def retry(ended: JobRecord, cause: str | None) -> bool:
        preempted = len(context.ledger.preemptions(ended.job_id))  # those requeued spend none of its retries=
        if attempts.retryable(ended, cause, preempted) and context.ledger.requeue(ended):
            requeued.append(cause)
        return bool(requeued)

    try:
        body = context.files.payload(job_id) if array_id is None else elements.payload(context, record)
        checked = _request(spec, body, write)
        flow = JobFlow(context, checked, Supervised(context, record, spare), lambda: None, record=record, place=place,
                       retry=retry, grant=grant, handover=handover)
        if record.attempt > 1:  # its queue_timeout counts from its requeue; its log says where it begins
            for last in context.ledger.attempts(job_id)[-1:]:
                flow.queued_at = last["ended"]
                write(f"[rpycdl] {attempts.said(record)} (attempt {last['attempt']} ended {last['state']}: "
                      f"{last['error']})\n")
        flow.run()
        spare = None
    except (RpycdlError, EOFError) as exc:  # the ledger says how it ended, unless it never got to run
        if flow is None:
            record.state, record.error, record.error_type = JobState.FAILED, str(exc), type(exc).__name__
            record.ended = time.time()
    except Exception:  # the ledger refused the end (a full disk), or a bug: the end is recorded below
        traceback.print_exc()
    finally:
        if flow is None and grant is not None:  # its payload could not be had: its GPUs go on
            assert handover is not None
            handover.release(grant)
        (handover.after if handover is not None else _now)(functools.partial(_ended, context, record, spare, log,
                                                                             requeued))


def _ended(context: ServerContext, record: JobRecord, spare: runner.JobProcess | None, log: LogWriter,
           requeued: list[str | None]) -> None:
    """What is left of a job's end once its flow ended: its spare (a container job's, or one the flow never took),
    its log; then, unless it was requeued, its payload and result key, its row's end made sure of, and its array's
    next elements given their places (elements.ended)."""
    if spare is not None:
        spare.close()
    log.close()
    if not requeued:
        context.files.drop_payload(record.job_id)
        results.drop_job_key(context.files.path(record.job_id))  # its result is sealed, or it will have none
        _record_end(context, record)
        elements.ended(context, record)


def _now(end: Callable[[], None]) -> None:
    end()


def _record_end(context: ServerContext, record: JobRecord) -> None:
    """Make sure the ledger tells how the job ended, however long a full disk refuses it: the job is over
    and its GPUs are free; only its row waits (a finished row is never written twice)."""
    if not record.state.finished:  # the flow broke off unexpectedly (a bug): say so rather than LOST
        record.state, record.error = JobState.FAILED, record.error or "its supervisor failed (see the server's log)"
        record.ended = record.ended or time.time()
    while True:
        try:
            context.ledger.save(record)
            return
        except sqlite3.Error:
            time.sleep(END_RETRY)
