"""A job's flow from its checked request to its outcome: it waits in line for its GPUs (its payload test-loaded
meanwhile), runs in its job process (or its container) with exactly those GPUs, is stopped when cancelled, timed out
or over its share, and ends with everything it started gone, its GPUs released and its ledger row written; an
original client's value is made after that.

The same flow serves an attached job, in the connection process serving its client, and a detached one, in its
supervisor (rpycdl.server.supervisor), which has no client: its Link keeps the outcome in the job's files instead."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any, Protocol

from rpycdl.defaults import (
    ENV_SIMULATED_GPUS,
    RELEASE_BEFORE_REPLY,
    SAVE_SOCKET_VARIABLE,
)
from rpycdl.errors import (
    ContainerError,
    JobCancelledError,
    JobTimeoutError,
    LimitError,
    QueueTimeoutError,
    RpycdlError,
)
from rpycdl.gpu import caps, watchdog
from rpycdl.gpu.inventory import FakeInventory
from rpycdl.gpu.watchdog import GPUWatch
from rpycdl.scheduler import attempts, limits, procs
from rpycdl.scheduler.holders import Grant
from rpycdl.scheduler.ledger import JobRecord, new_job_id
from rpycdl.scheduler.policies import OFF
from rpycdl.scheduler.queuedir import Need, Place
from rpycdl.security.fence import Fence
from rpycdl.server import child, draining, fencing, jobdirs, outcomes, preempting, reclaim, runner, saves, status
from rpycdl.server.context import ServerContext
from rpycdl.server.handover import Handover
from rpycdl.server.loadcheck import LoadCheck
from rpycdl.server.request import JobRequest, Output
from rpycdl.states import JobState, held_by
from rpycdl.wire import codec

LOAD_CHECK_AFTER = 0.2
"""Seconds a request waits before its payload is test-loaded (LoadCheck): a short wait is not worth a process."""

Stop = Callable[[int], tuple[runner.Ending, str] | None]
"""Given the job's pid: why it must stop now (cancelled, over its memory grant), or None."""

WATCHED = {watchdog.ELSEWHERE: runner.Ending.ELSEWHERE, watchdog.OVER_MEMORY: runner.Ending.OVER_MEMORY}
"""How a job the GPU watchdog stopped ends."""


class Link(Protocol):
    """What a job's flow needs of the connection serving its client."""

    def socket_fds(self) -> list[int]:
        """The client socket's descriptor, to watch while the job waits or runs ([] once it is gone)."""

    def serve_client(self) -> None:
        """Serve what the client sent meanwhile; EOFError if it is gone."""

    def push(self, receive: Callable[[Any], None], layout: codec.Layout, fd: int) -> int:
        """Send a result's buffers to the client's `receive` from the pipe `fd` (wire.bulk.push)."""

    def take_spare(self) -> runner.JobProcess | None:
        """The connection's spare job process, once (None after, or if there is none)."""

    def defer(self, end: Callable[[], None]) -> None:
        """Call `end` once the reply has gone out (or when the client has gone)."""

    def keep(self, outcome: bytes) -> int | None:
        """Keep the outcome of a job that ran to its end, once its GPUs are back and before its end is recorded: a
        detached job's result file (its size; LimitError if it cannot be written); None for an attached job."""


class JobFlow:
    """One job of one connection, from its checked request to its outcome."""

    def __init__(self, context: ServerContext, request: JobRequest, link: Link, on_end: Callable[[], None], *,
                 record: JobRecord | None = None, place: Place | None = None, retry: attempts.Retry | None = None,
                 grant: Grant | None = None, handover: Handover | None = None) -> None:
        """A new job's flow; or, given its `record` and its `place` in line (taken when it was submitted), or the
        `grant` an array's last element handed it, the flow of a detached job that its supervisor takes over, which
        `retry` may requeue, and whose GPUs its `handover` frees (rpycdl.server.handover)."""
        self.context, self.request, self.link, self._on_end = context, request, link, on_end
        self.record = record or self.new_record(context, request)
        self.queued_at, self._retry, self._signaled = self.record.submitted, retry, False  # queue_timeout from then
        self._unrecorded = record is None  # its files are made before its row (JobFiles.begin)
        self._place, self._handover = place, handover
        self.job: runner.JobProcess | None = None
        self.grant: Grant | None = grant
        self.result: runner.Result | None = None
        self._check: LoadCheck | None = None
        self._env: dict[str, str] = {}  # the job's directories (jobdirs.prepare), its saves' socket (saves)
        self._saver: saves.Saver | None = None
        self._waiting_since: float | None = None
        self._preempt: preempting.Watch | None = None  # its grant's preemption (--preempt), once it runs
        self._quota = jobdirs.OutputQuota(context, self.record.job_id)  # shared by its Stops: measured once a second
        self._idle: reclaim.Reclaim | None = None  # its GPUs' idle time (--idle-reclaim), over a session's calls too
        self.say = request.output.stderr  # where the server warns the job (a session's: as its client can hear)

    @staticmethod
    def new_record(context: ServerContext, request: JobRequest) -> JobRecord:
        """The ledger row of a new job, owned by this process."""
        me = procs.myself()
        return JobRecord(new_job_id(), context.server_id, request.client, request.gpu_request.ngpus,
                         request.gpu_request.share_bytes, owner_pid=me[0], owner_start=me[1],
                         user=request.owner.user, user_verified=request.owner.verified, name=request.name,
                         detached=request.detached, kind=request.kind, service=context.name,
                         server=f"{context.host}:{context.port}", request=request.summary(), priority=request.priority)

    def run(self) -> bytes:
        """Queue, lock the GPUs, run, release. Returns the outcome bytes (wire.codec); raises
        RpycdlError for a job that did not finish (timeout, cancel, crash, over its share)."""
        record = self.record
        try:
            if self._unrecorded:
                self.context.files.begin(record.job_id)
            self._env = jobdirs.prepare(self.context, record.job_id, self.request, record.array_id)  # before the GPUs
            if self.request.body is not None:
                self.job = self._job_process()
                record.pgid, record.leader_start = self.job.identity
            self.grant = self._acquire()
            self.result = self._execute()
        except BaseException as exc:
            record.state = JobState.CANCELLED if isinstance(exc, (JobCancelledError, EOFError)) else JobState.FAILED
            record.error, record.error_type = str(exc) or type(exc).__name__, type(exc).__name__
            raise
        finally:
            record.ended = time.time()
            preempted = self._preempt is not None and self._preempt.mark is not None  # its end tells its error
            if self.result is None or preempted or len(self.result.outcome) > RELEASE_BEFORE_REPLY:
                self._end()  # a large reply may take long to send: the GPUs do not wait for it
            else:  # the outcome is known: the client gets it while the job process is reaped
                self.link.defer(self._end)
        if self.result.ending is runner.Ending.FINISHED:
            return self.result.outcome
        error = preempting.error(record, outcomes.ERRORS[self.result.ending])
        raise error(f"job {record.job_id}: {self.result.reason}")

    # -- waiting ------------------------------------------------------------------------

    def _job_process(self) -> runner.JobProcess:
        """The connection's spare job process, else one started now, given the payload and its buffers."""
        body, buffers = self.request.body, self.request.buffers
        assert body is not None
        job = self.link.take_spare()
        if job is None or not job.give(body, buffers):
            if job is not None:
                job.close()
            job = runner.JobProcess(self.context.launcher)
            job.give(body, buffers)
        job.name_job(self.record.job_id)
        return job

    def _acquire(self) -> Grant:
        """Its GPUs: waited for in line, or the grant it was handed (rpycdl.server.handover); its row says them."""
        record, grant = self.record, self.grant or self._wait_in_line()
        record.state, record.gpu_uuids, record.started = JobState.RUNNING, list(grant.uuids), time.time()
        record.gpus = grant.gpus
        return grant

    def _wait_in_line(self) -> Grant:
        """Its GPUs, as its place in line comes (the client told of its place, the payload test-loaded meanwhile)."""
        ctx, record = self.context, self.record
        info = {**queue_info(ctx, record, self.request), "owner": [record.owner_pid, record.owner_start],
                "leader": [record.pgid, record.leader_start] if self.job else None,
                "server_process": list(ctx.server_process)}
        self._wake_fds = self.link.socket_fds()
        try:
            grant = ctx.locks.acquire(need_of(ctx, record), info, place=self._place,
                                      queue_timeout=self.request.queue_timeout,
                                      waited=max(0.0, time.time() - self.queued_at), wake_fds=self._wake_fds,
                                      on_wake=self._on_wake, on_position=self._on_position)
        except QueueTimeoutError as exc:  # who held them (what anyone sees), in the client's waiting line's words
            held = held_by(status.holders(ctx))
            raise QueueTimeoutError(f"{exc}{'; ' + held if held else ''}") from None
        return grant

    def _save_running(self, *_: Any) -> None:
        """Save the job's row as it starts, then tell the client it runs: whoever the client tells can find it."""
        grant = self.grant
        assert grant is not None
        self.context.ledger.save(self.record)
        self._tell("running", gpus=[self._gpu(uuid).index for uuid in grant.uuids], uuids=list(grant.uuids),
                   share_bytes=grant.share_bytes)

    def _on_position(self, ahead: int, reason: str) -> None:
        """Its place in line, or why its owner's limits hold it back, changed: the client is told (its waiting line)."""
        if self._waiting_since is None:  # it has to wait: within the limits? make it visible to `jobs` and `cancel`
            if self._place is None:  # a detached job's place was checked when it was submitted
                check_queue_limits(self.context, self.request, self.record.job_id)
            self._waiting_since = time.monotonic()
            self.context.ledger.save(self.record)
        if self.request.output.on_state is not None:  # the GPUs' holders are read only for a client listening
            self._tell("pending", ahead=ahead, holders=status.holders(self.context), ngpus=self.record.ngpus,
                       share_bytes=self.record.share_bytes, reason=reason)

    def _on_wake(self) -> None:
        """Between waits: the client still there? the payload loadable (once it has waited
        LOAD_CHECK_AFTER)? the job cancelled?"""
        self.link.serve_client()
        body, waited = self.request.body, time.monotonic() - (self._waiting_since or time.monotonic())
        if body is not None and self._check is None and waited >= LOAD_CHECK_AFTER:
            with contextlib.suppress(LimitError):  # no process to spare: the job itself will tell
                go = child.Go(self._env, self.request.account, body, codec.layout(self.request.buffers))
                self._check = LoadCheck(self.context.launcher, go, self.request.buffers)
                self._wake_fds.append(self._check.fd)
        check = self._check
        if check is not None and check.fd in self._wake_fds and select.select([check.fd], [], [], 0)[0]:
            self._wake_fds.remove(check.fd)
            error = check.error()
            if error is not None:
                raise error
        if self.context.ledger.cancel_requested(self.record.job_id):
            raise JobCancelledError(f"job {self.record.job_id} was cancelled while waiting")
        if draining.overdue():
            raise JobCancelledError(f"job {self.record.job_id} was cancelled while waiting: {draining.REASON}")

    def _tell(self, state: str, **info: Any) -> None:
        if self.request.output.on_state is not None:
            self.request.output.on_state(state, json.dumps({"job_id": self.record.job_id, **info}))

    # -- running ------------------------------------------------------------------------

    def _gpu(self, uuid: str) -> Any:
        return next(gpu for gpu in self.context.gpus if gpu.uuid == uuid)

    def _environment(self) -> dict[str, str]:
        """The job's variables: its GPUs, its ids, its share's caps, the simulated driver's state."""
        grant, inventory = self.grant, self.context.inventory
        assert grant is not None
        env = {**child.gpu_environment([self._gpu(uuid).index for uuid in grant.uuids], grant.uuids),
               **child.job_environment(self.record), "RPYCDL_TICKET": str(grant.ticket),
               "RPYCDL_GRANT_SEQUENCE": str(grant.sequence)}
        if grant.share_bytes:
            env.update(caps.cap_environment(grant.share_bytes, self._gpu(grant.uuids[0]).memory_total))
        if isinstance(inventory, FakeInventory) and inventory.state_dir is not None:
            env[ENV_SIMULATED_GPUS] = str(inventory.state_dir)
        return {**env, **self._env}

    def _stopper(self) -> Stop:
        """The job's Stop: a cancel request, its output directory past --max-output, the GPU watchdog (a GPU
        it was not granted; over its share), or its GPUs idle past --idle-reclaim (rpycdl.server.reclaim)."""
        ctx, grant, job_id = self.context, self.grant, self.record.job_id
        assert grant is not None
        idle = self._idle = self._idle or reclaim.watch(self)
        watch = GPUWatch(ctx.inventory, {gpu.uuid: gpu for gpu in ctx.gpus},
                         {uuid: grant.share_bytes for uuid in grant.uuids}, ctx.shares.allowance)
        preempt = self._preempt = self._preempt or (preempting.Watch(ctx.lock_dir, job_id, grant.ticket)
                                                    if ctx.scheduling.preempt != OFF else None)  # a session's: one

        def stop(pid: int) -> tuple[runner.Ending, str] | None:
            if ctx.ledger.cancel_requested(job_id):
                return runner.Ending.CANCELLED, "the job was cancelled"
            preempted = preempt.check(pid) if preempt is not None else None
            if preempted is not None:
                return preempted
            if draining.overdue():
                return runner.Ending.CANCELLED, f"the job was cancelled: {draining.REASON}"
            over = self._quota.over()
            if over is not None:
                return runner.Ending.OVER_OUTPUT, over
            found = watch.check(pid)
            return (WATCHED[found[0]], found[1]) if found else idle.check(self.say) if idle else None

        return stop

    def _execute(self) -> runner.Result:
        return self._run_container() if self.request.container is not None else self._run_payload()

    def _run_payload(self) -> runner.Result:
        """The payload in its job process (rpycdl.server.runner)."""
        job = self.job
        assert job is not None  # run() forks it for every payload
        self._start_saves()
        result = job.run(self._environment(), self.request.output.stdout, self.request.output.stderr,
                         account=self.request.account, fence=self.fence(), on_start=self._save_running,
                         on_sent=self._handover.started if self._handover is not None else None,
                         **self._following(self.request.output, self.request.timeout))
        result = self._memory_stopped(job, result)
        over = self._quota.over(now=True) if result.ending is runner.Ending.FINISHED else None  # what it left
        return result if over is None else runner.Result(runner.Ending.OVER_OUTPUT, reason=over)

    def _memory_stopped(self, job: runner.JobProcess, result: runner.Result) -> runner.Result:
        """`result` of a call of `job`; or, if the kernel's OOM killer ended its process at its cgroup's memory
        limit, that end, naming the limit and the peak. A command's job process says itself when the kernel killed
        the command so (commands.run_command)."""
        if result.ending is not runner.Ending.CRASHED:
            return result
        status = job.exit_status()
        self._signaled = os.WIFSIGNALED(status)  # by a signal rpycdl did not send: a retry's cause
        if not self._signaled or os.WTERMSIG(status) != signal.SIGKILL:
            return result
        why = fencing.over_memory(self.context, job.usage, self.request.memory is not None)
        return runner.Result(runner.Ending.OVER_HOST_MEMORY, reason=why) if why else result

    def fence(self) -> Fence | None:
        """How the job is fenced (fencing.job_fence), where this server fences jobs."""
        granted = {self._gpu(uuid).minor for uuid in self.grant.uuids} if self.grant is not None else set()
        return fencing.job_fence(self.context, self.record, self.request.memory, self.request.cpus, granted)

    def _start_saves(self) -> None:
        """Take the job's saves (rpycdl.save_artifact) on a socket its environment names."""
        assert self.job is not None
        self._saver = saves.Saver(self.context, self.record, self.job.pid)  # after the last fork for the job
        self._env[SAVE_SOCKET_VARIABLE] = self._saver.variable

    def _following(self, output: Output, timeout: float | None) -> dict[str, Any]:
        """How a call of the job is followed (runner.JobProcess._follow's options): the client's socket and the
        saves watched, the job's Stop, its timeout, and with the client's `receive`, a large result's buffers
        beside RPyC."""
        receive, saver = output.receive, self._saver
        assert saver is not None

        def send_result(layout: codec.Layout, fd: int) -> int:
            return self.link.push(receive, layout, fd)  # type: ignore[arg-type]

        def watched() -> None:
            self.link.serve_client()
            saver.take()

        limits = self.context.limits
        max_result = (limits.max_result, "--max-result") if self.request.detached else (limits.max_payload,
                                                                                        "--max-payload")
        return {"timeout": timeout, "watch_fds": [*self.link.socket_fds(), saver.fileno()], "on_watch": watched,
                "stop": self._stopper(), "on_buffers": send_result if receive is not None else None,
                "max_result": max_result}

    def _run_container(self) -> runner.Result:
        """The request's command in a container of its own (rpycdl.server.containers)."""
        from rpycdl.server import containers  # docker is only needed by servers that run containers

        ctx, record, output = self.context, self.record, self.request.output
        self._save_running()
        env = {key: value for key, value in self._environment().items() if key.startswith("RPYCDL_")}
        account = self.request.account
        try:
            code = containers.run_job_container(
                self.request.container, record.gpu_uuids, simulated=ctx.inventory.simulated, owner=ctx.server_id,  # type: ignore[arg-type]
                job_id=record.job_id, lock_dir=ctx.lock_dir, on_stdout=output.stdout, on_stderr=output.stderr,
                timeout=self.request.timeout, poll=self.link.serve_client,
                cancelled=lambda: ctx.ledger.cancel_requested(record.job_id), extra_env=env,
                user=None if account is None else f"{account.uid}:{account.gid}")
        except JobTimeoutError as exc:
            return runner.Result(runner.Ending.TIMED_OUT, reason=str(exc))
        except JobCancelledError as exc:
            return runner.Result(runner.Ending.CANCELLED, reason=str(exc))
        except ContainerError as exc:
            record.exit_code = exc.exit_code
            return runner.Result(runner.Ending.FINISHED, codec.encode_error(exc, tb=""))
        record.exit_code = code
        return runner.Result(runner.Ending.FINISHED, codec.encode_ok(code))

    # -- ending -------------------------------------------------------------------------

    def _end(self) -> None:
        """Leave nothing of the job running, free its GPUs (or hand them on: handover), write its row's end."""
        if self._check is not None:
            self._check.close()
        if self.job is not None:
            self.job.end()  # gone before its GPUs are released
        if self.grant is not None:
            (self._handover or self.context.locks).release(self.grant)
        self._handover.after(self._close) if self._handover is not None else self._close()

    def _close(self) -> None:
        """Keep its outcome, judge it, requeue it or write its row's end, hand its outputs over."""
        record, result = self.record, self.result
        if self.job is not None:  # its exit told by its keeper (and its usage), after its GPUs went
            self.job.close()
            fencing.record_usage(record, self.job.usage)
        self._keep()
        ran = not record.state.finished and result is not None  # else it failed before its job could end
        if record.state.finished:  # (record.error says why)
            pass
        elif result is None:
            record.state = JobState.FAILED
        elif result.ending is not runner.Ending.FINISHED:
            record.state, record.error = outcomes.STATES[result.ending], result.reason
            record.error_type = outcomes.ERRORS[result.ending].__name__
        else:
            outcomes.judge(record, result.outcome, self.request.command is not None)
        preempted = preempting.settle(self.context, record, self._preempt, result)  # its end as a preemption's
        if preempted is not None:
            self.result = preempted[0]
        if ran and self._retry is not None and self._retry(record, preempted[1] if preempted else attempts.cause(
                record, result.ending is runner.Ending.CRASHED, self._signaled)):  # type: ignore[union-attr]
            if self._saver is not None:  # its row waits again; its directories stay for the next attempt
                self._saver.close()
            self._on_end()
            return
        self.context.files.remove_working_dir(record.job_id)  # before its end: a kill after it leaves no copy
        self.context.ledger.save(record)
        if self._unrecorded:
            self.context.files.recorded(record.job_id)
        saved = self._saver.close() if self._saver is not None else {}  # an upload under way ends first
        jobdirs.finish(self.context, record, saved)  # the GPUs are back, the end recorded: then the outputs go up
        self._on_end()

    def _keep(self) -> None:
        """Keep the outcome of a job that ran to its end (a detached job's result file, flushed to disk) once its
        GPUs are back, so that the next job does not wait for the disk; one that cannot be kept (a full disk, its
        sealing key gone) fails the job."""
        record, result = self.record, self.result
        if result is None or result.ending is not runner.Ending.FINISHED or record.state.finished:
            return
        try:
            record.result_bytes = self.link.keep(result.outcome)
        except RpycdlError as exc:
            record.state, record.error, record.error_type = JobState.FAILED, str(exc), type(exc).__name__


def need_of(context: ServerContext, record: JobRecord) -> Need:
    """What a job waits for: its GPUs or its share, among its server's GPUs, and for how long at most."""
    return Need(record.ngpus, tuple(gpu.uuid for gpu in context.gpus), record.share_bytes,
                {gpu.uuid: gpu.memory_total for gpu in context.gpus}, record.request.get("timeout"))


def queue_info(context: ServerContext, record: JobRecord, request: JobRequest) -> dict[str, Any]:
    """What the queue and the GPUs' holders show of a job; `account`, the user its GPU time counts against; its
    `priority` (rpycdl.scheduler.priorities)."""
    return {"job_id": record.job_id, "client": record.client, "server": context.name,
            "server_id": context.server_id, "user": request.owner.label, "account": request.owner.user,
            "priority": record.priority}


def check_queue_limits(context: ServerContext, request: JobRequest, job_id: str = "") -> int:
    """Raise LimitError if this server's queue, or this user's share of it, is full: its PENDING rows in the
    ledger (an attached request's, saved once it has to wait, after this check; a detached job's, a row, saved
    after it too); or if the host's --limits file refuses it (`pending`, or more GPUs than `gpus`; the queue's
    entries but `job_id`'s). Returns how many of this server's wait."""
    label, asked = request.owner.label, request.gpu_request
    limits.check_request(context.lock_dir, request.owner.user, 0 if asked.share_bytes else asked.ngpus,
                         context.locks.queue, job_id)
    waiting, mine = context.ledger.waiting(context.server_id, request.owner.user, request.owner.verified)
    if waiting >= context.limits.max_queued:
        raise LimitError(f"this server's queue is full: {waiting} requests wait, the limit is "
                         f"{context.limits.max_queued} (--max-queued); try again later or another server")
    if mine >= context.limits.max_queued_per_user:
        raise LimitError(f"{label} has {mine} requests waiting on this server, the limit per user is "
                         f"{context.limits.max_queued_per_user} (--max-queued-per-user); wait for some to start")
    return waiting
