"""The RPyC service: run, run_buffers and run_code (ours and the original servers'), run_container,
gpu_status, load, jobs, cancel, identify, limits, server_info."""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import select
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import dill
import rpyc

from rpycdl import auth, caps, procs, runner, transport, wire
from rpycdl.context import ServerContext
from rpycdl.defaults import (
    ENV_SIMULATED_GPUS,
    RELEASE_BEFORE_REPLY,
    RESULT_DECODE_TIMEOUT,
    RESULT_MEMORY_FACTOR,
    RESULT_MEMORY_MIN,
)
from rpycdl.errors import (
    GPUMemoryExceededError,
    InvalidRequestError,
    JobCancelledError,
    JobCrashedError,
    JobTimeoutError,
    LimitError,
    NotAllowedError,
    RpycdlError,
)
from rpycdl.gpus import GPU, FakeInventory
from rpycdl.jobs import JobRecord, JobState, new_job_id
from rpycdl.locks import Grant
from rpycdl.shares import GPURequest, MiB, parse_request
from rpycdl.watchdog import MemoryWatch

MAX_TIMEOUT = 366 * 24 * 3600.0
LOAD_CHECK_AFTER = 0.2
"""Seconds a request waits before its payload is test-loaded (runner.LoadCheck): short waits
are not worth a process."""

Stop = Callable[[int], tuple[runner.Ending, str] | None]
"""Given the job's pid: why it must stop now (cancelled, over its memory grant), or None."""

Executor = Callable[[JobRecord, dict[str, str], float | None, Stop, runner.JobProcess | None], runner.Result]
"""Runs a job whose GPUs are locked: (its record, the GPU environment, its timeout, its Stop, the job
process forked for a payload) -> how it ended."""


def check_seconds(value: Any, name: str) -> float | None:
    """Check an optional timeout: None, or a positive finite number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_TIMEOUT:
        raise InvalidRequestError(f"{name} must be a positive number of seconds (at most a year), not {value!r}")
    return float(value)


class GPUService(rpyc.Service):
    """One client connection of a server. `context` is set on the subclass the server builds.

    Its user is the one its client certificate names, else the one the client declares
    (`identify`, unverified), else auth.ANONYMOUS. Its first payload runs in `spare`, a job
    process forked with the connection process (runner.JobProcess), unless that payload
    brought out-of-band buffers. The spare belongs to the connection process, which closes it."""

    context: ServerContext

    def __init__(self, spare: runner.JobProcess | None = None) -> None:
        self._spare = spare

    def on_connect(self, conn: rpyc.Connection) -> None:
        self._conn = conn
        self._identity: auth.Identity = conn._config.get("credentials") or auth.ANONYMOUS
        endpoints = conn._config.get("endpoints") or (None, ("?", 0))
        peer = endpoints[1]
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._me = procs.identify(os.getpid())
        self._locks = self.context.locks
        self._store = self.context.store
        self._busy = False  # one job at a time per connection: a second would be served inside the first
        self._after_reply: list[Callable[[], None]] = []

    def after_reply(self) -> None:
        """Finish what the last call left for after its reply (the end of its job: see _submit).
        The server calls this once each request is answered, and when the client has gone."""
        while self._after_reply:
            self._after_reply.pop(0)()

    # -- the client connection while a job waits or runs ---------------------------

    def _socket_fd(self) -> list[int]:
        try:
            return [self._conn.fileno()]
        except Exception:
            return []

    def _serve_client(self) -> None:
        """Serve what the client sent while its job waits or runs; EOFError if it is gone."""
        fds = self._socket_fd()
        if not fds:
            raise EOFError("client connection closed")
        while select.select(fds, [], [], 0)[0]:
            self._conn.serve(0)

    def _check_size(self, data: Any, what: str, beside: int = 0) -> None:
        """Refuse `data` and `beside` more bytes (its out-of-band buffers) over --max-payload."""
        limit = self.context.limits.max_payload
        if isinstance(data, (bytes, bytearray)) and len(data) + beside > limit:
            raise LimitError(f"the {what} is {len(data) + beside} bytes, over this server's limit of {limit} "
                             "(--max-payload)")

    # -- running a job ----------------------------------------------------------------

    def _request(self, ngpus: Any, gpus: Any, gpu_memory: Any) -> GPURequest:
        return parse_request(ngpus, gpus, gpu_memory, self.context.gpus, self.context.shares)

    def _submit(self, execute: Executor, request: GPURequest, timeout: Any, queue_timeout: Any,
                on_state: Callable[[str, str], None] | None, body: bytes | None = None,
                buffers: list[Any] | None = None) -> bytes:
        """Queue, lock GPUs, run `execute(record, env, timeout, stop, job)`, release. Returns outcome
        bytes; raises RpycdlError. The executor saves the record once the job runs. For a payload
        `body` (with its out-of-band `buffers`), the job process is ready before the request
        queues (_job_process), and the payload is test-loaded while the request waits
        (runner.LoadCheck)."""
        ctx = self.context
        count = request.count
        timeout = check_seconds(timeout, "timeout")
        queue_timeout = check_seconds(queue_timeout, "queue_timeout")
        if self._busy:
            raise InvalidRequestError("this connection is already running a job: use one connection per "
                                      "concurrent job (rpycdl.connect() again)")
        user = self._identity
        record = JobRecord(new_job_id(), ctx.server_id, self._client, count, request.memory, owner_pid=self._me[0],
                           owner_start=self._me[1], user=user.user, user_verified=user.verified)

        waiting_since: float | None = None
        wake_fds = self._socket_fd()
        check: runner.LoadCheck | None = None
        check_tried = False

        def on_position(ahead: int) -> None:
            nonlocal waiting_since
            if waiting_since is None:  # it has to wait: within the limits? make it visible to `jobs` and `cancel`
                self._check_queue_limits(record.job_id)
                waiting_since = time.monotonic()
                self._store.save(record)
            if on_state is not None:
                on_state("pending", json.dumps({"job_id": record.job_id, "ahead": ahead, "ngpus": count,
                                                "gpu_memory": request.memory}))

        def on_wake() -> None:
            nonlocal check, check_tried
            self._serve_client()
            if body is not None and not check_tried and time.monotonic() - waiting_since >= LOAD_CHECK_AFTER:
                check_tried = True  # one that waits longer learns early if it cannot load
                with contextlib.suppress(LimitError):  # no process to spare: the job itself will tell
                    check = runner.LoadCheck(body, buffers or ())
                    wake_fds.append(check.fd)
            if check is not None and check.fd in wake_fds and select.select([check.fd], [], [], 0)[0]:
                wake_fds.remove(check.fd)
                error = check.error()
                if error is not None:
                    raise error
            if self._store.cancel_requested(record.job_id):
                raise JobCancelledError(f"job {record.job_id} was cancelled while waiting")

        grant = result = job = None
        self._busy = True
        try:
            if body is not None:
                job = self._job_process(body, buffers)
                record.pgid, record.leader_start = job.identity
            grant = self._locks.acquire(
                count, [gpu.uuid for gpu in ctx.gpus],
                {"job_id": record.job_id, "client": self._client, "server": ctx.name, "server_id": ctx.server_id,
                 "user": user.label, "leader": [record.pgid, record.leader_start] if job else None,
                 "owner": list(self._me), "server_process": list(ctx.server_process)},
                queue_timeout=queue_timeout, wake_fds=wake_fds, on_wake=on_wake, on_position=on_position,
                memory=request.memory, sizes={gpu.uuid: gpu.memory_total // MiB for gpu in ctx.gpus})
            by_uuid = {gpu.uuid: gpu for gpu in ctx.gpus}
            granted = [by_uuid[uuid] for uuid in grant.uuids]
            indices = [gpu.index for gpu in granted]
            record.state, record.gpus, record.started = JobState.RUNNING, list(grant.uuids), time.time()
            if on_state is not None:
                on_state("running", json.dumps({"job_id": record.job_id, "gpus": indices, "uuids": list(grant.uuids),
                                                "gpu_memory": grant.memory}))
            result = execute(record, self._environment(record, grant, granted), timeout,
                             self._stopper(record, grant, granted),
                             job)
        except BaseException as exc:
            record.state = JobState.CANCELLED if isinstance(exc, (JobCancelledError, EOFError)) else JobState.FAILED
            record.error = str(exc) or type(exc).__name__
            raise
        finally:
            record.ended = time.time()

            def end() -> None:
                if check is not None:
                    check.close()
                if job is not None:
                    job.close()  # gone before its GPUs are released
                if grant is not None:
                    self._locks.release(grant)
                self._finish(record, result)
                self._busy = False

            if result is None or len(result.outcome) > RELEASE_BEFORE_REPLY:
                end()  # a large reply may take long to send: the GPUs do not wait for it
            else:  # the outcome is known: the client gets it while the job process is reaped
                self._after_reply.append(end)
        return self._outcome(record, result)

    def _job_process(self, body: bytes, buffers: list[Any] | None) -> runner.JobProcess:
        """The connection's spare job process, given `body`; else (the spare is used or gone, or
        out-of-band `buffers` must come by fork) one forked now with the payload."""
        spare, self._spare = self._spare, None
        if spare is not None:
            if not buffers and spare.give(body):
                return spare
            spare.close()
        return runner.JobProcess(body, buffers)

    def _environment(self, record: JobRecord, grant: Grant, granted: list[GPU]) -> dict[str, str]:
        """The job's variables: its GPUs, its ids, its share's caps, the simulated driver's state."""
        ctx = self.context
        env = {**runner.gpu_environment([gpu.index for gpu in granted], grant.uuids), "RPYCDL_JOB_ID": record.job_id,
               "RPYCDL_TICKET": str(grant.ticket), "RPYCDL_GRANT_SEQUENCE": str(grant.sequence)}
        if grant.memory:
            env.update(caps.cap_environment(grant.memory * MiB, granted[0].memory_total))
        if isinstance(ctx.inventory, FakeInventory) and ctx.inventory.state_dir is not None:
            env[ENV_SIMULATED_GPUS] = str(ctx.inventory.state_dir)
        return env

    def _stopper(self, record: JobRecord, grant: Grant, granted: list[GPU]) -> Stop:
        """The job's Stop: a cancel request, or (for a share of a GPU) the memory watchdog."""
        ctx = self.context
        watch = None
        if grant.memory:
            watch = MemoryWatch(ctx.inventory, granted[0], grant.memory * MiB, ctx.shares.allowance)

        def stop(pid: int) -> tuple[runner.Ending, str] | None:
            if self._store.cancel_requested(record.job_id):
                return runner.Ending.CANCELLED, "the job was cancelled"
            reason = watch.check(pid) if watch is not None else None
            return (runner.Ending.OVER_MEMORY, reason) if reason else None

        return stop

    def _check_queue_limits(self, job_id: str) -> None:
        """Raise LimitError if this server's queue, or this user's share of it, is full."""
        limits, label = self.context.limits, self._identity.label
        others = [w for w in self._locks.queue() if w["server_id"] == self.context.server_id and w["job_id"] != job_id]
        if len(others) >= limits.max_queued:
            raise LimitError(f"this server's queue is full: {len(others)} requests wait, the limit is "
                             f"{limits.max_queued} (--max-queued); try again later or another server")
        mine = sum(1 for w in others if w.get("user") == label)
        if mine >= limits.max_queued_per_user:
            raise LimitError(f"{label} has {mine} requests waiting on this server, the limit per user is "
                             f"{limits.max_queued_per_user} (--max-queued-per-user); wait for some to start")

    def _run_payload(self, on_stdout: Callable[[str], None], on_stderr: Callable[[str], None],
                     receive: Callable[[Any], None] | None = None) -> Executor:
        """The executor of run, run_buffers and run_code: the payload in its job process
        (rpycdl.runner). With the client's `receive`, a large result's buffers go to it out of
        band (transport.push)."""

        def send_result(layout: wire.Layout, fd: int) -> int:
            return transport.push(self._conn, receive, layout, fd)  # type: ignore[arg-type]

        def execute(record: JobRecord, env: dict[str, str], timeout: float | None, stop: Stop,
                    job: runner.JobProcess | None) -> runner.Result:
            def on_start(_: int) -> None:
                self._store.save(record)

            assert job is not None  # _submit forks it for every payload
            return job.run(env, on_stdout, on_stderr, on_start=on_start, timeout=timeout,
                           watch_fds=self._socket_fd(), on_watch=self._serve_client, stop=stop,
                           on_buffers=send_result if receive is not None else None,
                           max_result=self.context.limits.max_payload)

        return execute

    def _finish(self, record: JobRecord, result: runner.Result | None) -> None:
        if result is None:
            if not record.state.finished:
                record.state = JobState.FAILED
        else:
            record.state = {
                runner.Ending.FINISHED: JobState.SUCCEEDED if wire.succeeded(result.outcome) else JobState.FAILED,
                runner.Ending.TIMED_OUT: JobState.TIMED_OUT,
                runner.Ending.CANCELLED: JobState.CANCELLED,
                runner.Ending.CRASHED: JobState.FAILED,
                runner.Ending.OVER_MEMORY: JobState.FAILED,
            }[result.ending]
            record.error = result.reason
        self._store.save(record)

    @staticmethod
    def _outcome(record: JobRecord, result: runner.Result) -> bytes:
        if result.ending is runner.Ending.FINISHED:
            return result.outcome
        error = {runner.Ending.TIMED_OUT: JobTimeoutError, runner.Ending.CANCELLED: JobCancelledError,
                 runner.Ending.CRASHED: JobCrashedError,
                 runner.Ending.OVER_MEMORY: GPUMemoryExceededError}[result.ending]
        raise error(f"job {record.job_id}: {result.reason}")

    # -- exposed API ---------------------------------------------------------------------

    def exposed_run(self, payload: bytes, ngpus: Any = None, stdout: Callable[[str], None] | None = None,
                    stderr: Callable[[str], None] | None = None, timeout: Any = None, queue_timeout: Any = None,
                    on_state: Callable[[str, str], None] | None = None, gpus: Any = None,
                    gpu_memory: Any = None) -> bytes:
        """Run a payload made by wire.encode_payload on `ngpus` whole GPUs, or on a share of one
        GPU (`gpus` below 1, or `gpu_memory`); return outcome bytes (see rpycdl.client)."""
        try:
            self._check_size(payload, "payload")
            request = self._request(ngpus, gpus, gpu_memory)
            body = wire.check_payload(payload)
            return self._submit(self._run_payload(stdout or _discard, stderr or _discard), request, timeout,
                                queue_timeout, on_state, body)
        except RpycdlError as exc:
            return wire.encode_error(exc, tb="")

    def exposed_run_buffers(self, payload: bytes, layout: Any, send: Callable[[], None] | None,
                            receive: Callable[[Any], None], ngpus: Any = None,
                            stdout: Callable[[str], None] | None = None, stderr: Callable[[str], None] | None = None,
                            timeout: Any = None, queue_timeout: Any = None,
                            on_state: Callable[[str, str], None] | None = None, gpus: Any = None,
                            gpu_memory: Any = None) -> bytes:
        """`run` for a payload made by wire.encode_call, with large buffers beside it.

        `layout` (wire.Layout) says the size of each of the payload's out-of-band buffers; once the
        request is checked (limit, version, pickle), the client's `send()` is called to write them
        raw on the connection (transport.pull). A result's out-of-band buffers go back raw after a
        call of the client's `receive(layout)` (transport.push). Returns outcome bytes."""
        try:
            layout = wire.check_layout(layout)
            self._check_size(payload, "payload", wire.layout_bytes(layout))
            request = self._request(ngpus, gpus, gpu_memory)
            body = wire.check_payload(payload, len(layout))
            if layout and send is None:
                raise InvalidRequestError("a payload with out-of-band buffers needs the client's send callback")
            buffers = transport.pull(self._conn, send, layout) if layout else []  # type: ignore[arg-type]
            return self._submit(self._run_payload(stdout or _discard, stderr or _discard, receive),
                                request, timeout, queue_timeout, on_state, body, buffers)
        except RpycdlError as exc:
            return wire.encode_error(exc, tb="")

    def exposed_run_code(self, fn: Any, args: Any = None, ngpus: Any = None, stdout: Any = None, stderr: Any = None,
                         timeout: Any = None, queue_timeout: Any = None, gpus: Any = None,
                         gpu_memory: Any = None) -> Any:
        """The original servers' call: `fn` is dill bytes, `stdout`/`stderr` file-like objects.

        Returns the job's value and raises its exception, as the original servers did."""
        self._check_size(fn, "fn")
        request = self._request(ngpus, gpus, gpu_memory)
        wire.check_pickle(fn, "fn")
        args = transport.materialize(args, self.context.limits.max_payload)  # lists and dicts come by reference
        body = dill.dumps((bytes(fn), args, True), recurse=True)
        outcome = self._submit(self._run_payload(_writer(stdout), _writer(stderr)), request, timeout,
                               queue_timeout, None, body)
        self.after_reply()  # the job is over: its GPUs go back before its value is made here
        return _decode_bounded(outcome)

    def exposed_run_container(self, image: str, command: Any, ngpus: Any = 1, env: Any = None, workdir: Any = None,
                              mounts: Any = None, stdout: Callable[[str], None] | None = None,
                              stderr: Callable[[str], None] | None = None, timeout: Any = None,
                              queue_timeout: Any = None, on_state: Callable[[str, str], None] | None = None) -> bytes:
        """Run `command` (a list of strings) in a container of `image` with `ngpus` GPUs of its own
        (the generic server's job; see rpycdl.containers.check_job for env, workdir and mounts).
        `stdout` and `stderr` are callables receiving the container's output as it comes.

        Returns outcome bytes (see rpycdl.client): the exit code, 0, or ContainerError with the
        last log lines on any other."""
        from rpycdl import containers  # docker is only needed by servers that run containers

        try:
            command, env, workdir, mounts = transport.materialize((command, env, workdir, mounts),
                                                                  self.context.limits.max_payload)
            spec = containers.check_job(image, command, env, workdir, mounts)
            request = self._request(ngpus, None, None)
        except RpycdlError as exc:
            return wire.encode_error(exc, tb="")
        ctx = self.context

        def execute(record: JobRecord, gpu_env: dict[str, str], timeout: float | None, _: Stop,
                    __: runner.JobProcess | None) -> runner.Result:
            self._store.save(record)
            try:
                code = containers.run_job_container(
                    spec, record.gpus, simulated=ctx.inventory.simulated, owner=ctx.server_id, job_id=record.job_id,
                    lock_dir=ctx.lock_dir, on_stdout=stdout or _discard, on_stderr=stderr or _discard, timeout=timeout,
                    poll=self._serve_client, cancelled=lambda: self._store.cancel_requested(record.job_id),
                    extra_env={k: v for k, v in gpu_env.items() if k.startswith("RPYCDL_")})
            except JobTimeoutError as exc:
                return runner.Result(runner.Ending.TIMED_OUT, reason=str(exc))
            except JobCancelledError as exc:
                return runner.Result(runner.Ending.CANCELLED, reason=str(exc))
            except containers.ContainerError as exc:
                return runner.Result(runner.Ending.FINISHED, wire.encode_error(exc, tb=""))
            return runner.Result(runner.Ending.FINISHED, wire.encode_ok(code))

        try:
            return self._submit(execute, request, timeout, queue_timeout, on_state)
        except RpycdlError as exc:
            return wire.encode_error(exc, tb="")

    def _snapshot(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Holders by GPU UUID, and the waiting requests that compete for this server's GPUs."""
        snapshot = self._locks.snapshot()
        mine = {gpu.uuid for gpu in self.context.gpus}
        return snapshot["held"], [waiter for waiter in snapshot["queue"] if mine & set(waiter["candidates"])]

    def exposed_gpu_status(self) -> str:
        """JSON: this server, each GPU with its holders (one whole-GPU job, or the jobs sharing it, each
        with its `memory` in MiB, 0 for the whole GPU) and memory use, and the waiting queue in order."""
        ctx = self.context
        held, queue = self._snapshot()
        used = ctx.inventory.memory_used()
        gpus = [{**gpu.to_dict(), "memory_used": used.get(gpu.uuid), "holders": held.get(gpu.uuid, [])}
                for gpu in ctx.gpus]
        return json.dumps({"server": ctx.info(), "gpus": gpus, "queue": queue, "time": time.time()})

    def exposed_load(self) -> tuple[int, int, int]:
        """(free GPUs, waiting requests, GPUs): how soon a new job would run here."""
        held, queue = self._snapshot()
        gpus = self.context.gpus
        return sum(1 for gpu in gpus if gpu.uuid not in held), len(queue), len(gpus)

    def exposed_jobs(self) -> str:
        """JSON list of this server's job records, oldest first (a record whose connection process died
        is ended first: it never shows as pending or running)."""
        self._store.sweep()
        return json.dumps([r.to_dict() for r in self._store.all() if r.server_id == self.context.server_id])

    def exposed_cancel(self, job_id: Any) -> bytes:
        """Cancel a pending or running job of this server: its owner or an admin may.

        Returns outcome bytes (see rpycdl.client): the job's state when the cancel was asked;
        InvalidRequestError for an unknown job, NotAllowedError for someone else's."""
        try:
            if not isinstance(job_id, str) or not job_id.isalnum():
                raise InvalidRequestError(f"not a job id: {job_id!r}")
            record = self._store.load(job_id)
            if record is None or record.server_id != self.context.server_id:
                raise InvalidRequestError(f"no job {job_id} on this server")
            me = self._identity
            if not me.admin and (record.user, record.user_verified) != (me.user, me.verified):
                owner = auth.Identity(record.user, record.user_verified).label
                raise NotAllowedError(f"job {job_id} belongs to {owner} and you are {me.label}: only its owner "
                                      "or an admin can cancel it")
            self._store.request_cancel(record)
            self._locks.wake_all()
            return wire.encode_ok(record.state.value)
        except RpycdlError as exc:
            return wire.encode_error(exc, tb="")

    def exposed_identify(self, user: Any) -> str:
        """Declare the client's OS user, kept unless a client certificate names the user already.

        Returns JSON: the connection's identity (user, verified, admin, label)."""
        if not self._identity.verified:
            self._identity = auth.declared(user)
        return json.dumps({**asdict(self._identity), "label": self._identity.label})

    def exposed_limits(self) -> str:
        """JSON: this server's limits (see Limits)."""
        return json.dumps(self.context.limits.to_dict())

    def exposed_server_info(self) -> str:
        """JSON description of this server."""
        return json.dumps(self.context.info())


def _decode_bounded(outcome: bytes) -> Any:
    """The job's value (or its exception, raised) for an original client, which gets it by reference
    from this process: made here within RESULT_DECODE_TIMEOUT seconds and RESULT_MEMORY_FACTOR times
    the outcome's size (RESULT_MEMORY_MIN at least) of new memory, whatever its pickle asks for.

    Raises:
        LimitError: it took longer, or needed more memory.
    """
    def too_slow(*_: Any) -> None:
        raise LimitError(f"the job's result took longer than {RESULT_DECODE_TIMEOUT:g} s to load on the server")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    budget = mapped + max(RESULT_MEMORY_FACTOR * len(outcome), RESULT_MEMORY_MIN)
    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, RESULT_DECODE_TIMEOUT)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (budget if hard == resource.RLIM_INFINITY else min(budget, hard), hard))
        return wire.decode_outcome(outcome)
    except MemoryError:
        raise LimitError(f"the job's result needs more than {budget - mapped} bytes of memory to load on the server "
                         "(it returned something that grows when unpickled)") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _discard(_: str) -> None:
    pass


def _writer(stream: Any) -> Callable[[str], None]:
    """A sink writing to a client's file-like object (an RPyC netref), flushing each time."""
    if stream is None:
        return _discard

    def write(text: str) -> None:
        stream.write(text)
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()

    return write
