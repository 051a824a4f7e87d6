"""The RPyC service of one client connection: it checks who calls and what they ask (request),
hands each job to its flow (jobflow), and answers status: run, run_buffers, run_code (ours and
the original servers'), run_container, gpu_status, load, identify, limits, server_info; the calls
about the ledger's jobs (jobcalls: submit, job, job_log, job_wait, job_result, cancel, delete, jobs) and
working directories (workdircalls: has_working_dir, put_working_dir)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import dill
import rpyc

from rpycdl.errors import InvalidRequestError, RpycdlError, require_extra
from rpycdl.security import auth
from rpycdl.server import draining, request, resultpipe, runner, status
from rpycdl.server.arraycalls import ArrayCalls
from rpycdl.server.context import ServerContext
from rpycdl.server.jobcalls import JobCalls, refused
from rpycdl.server.jobflow import JobFlow
from rpycdl.server.link import ConnectionLink
from rpycdl.server.sessions import SessionCalls
from rpycdl.server.workdircalls import WorkdirCalls
from rpycdl.wire import bulk, codec, netrefs


class GPUService(ConnectionLink, SessionCalls, JobCalls, ArrayCalls, WorkdirCalls, rpyc.Service):
    """One client connection of a server. `context` is set on the subclass the server builds.

    Its user is the one its client certificate names, else the one the client declares
    (`identify`, unverified), else auth.ANONYMOUS. Its first payload runs in `spare`, a job
    process started with the connection process (runner.JobProcess); what a job's flow needs of the
    connection is its ConnectionLink."""

    context: ServerContext

    def __init__(self, spare: runner.JobProcess | None = None) -> None:
        self._spare = spare
        self._taken = 0

    def on_connect(self, conn: rpyc.Connection) -> None:
        self._conn = conn
        identity: auth.Identity = conn._config.get("credentials") or auth.ANONYMOUS
        self._identity = dataclasses.replace(identity, admin=self.context.accounts.admin(identity))  # --user-map's
        peer = (conn._config.get("endpoints") or (None, ("?", 0)))[1]
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._busy = False  # one job at a time per connection: a second would be served inside the first
        self._after_reply: list[Callable[[], None]] = []
        self._sinks: list[tuple[Any, ...]] = []  # the client's callbacks kept between calls (keep_sinks)

    # -- running a job ----------------------------------------------------------------

    def _request(self, options: dict[str, Any], **job: Any) -> request.JobRequest:
        draining.refuse_new_jobs()  # every job, attached or detached, and every session asks here first
        return request.build(self.context, self._identity, self._client, **options, **job)

    def _run(self, checked: request.JobRequest) -> bytes:
        """Run a checked request's job to its outcome (bytes; raises RpycdlError)."""
        if self._busy:
            raise InvalidRequestError("this connection is already running a job: use one connection per "
                                      "concurrent job (rpycdl.connect() again)")
        self._busy = True
        return JobFlow(self.context, checked, self, on_end=self._ended).run()

    # -- exposed API ---------------------------------------------------------------------

    def exposed_run(self, payload: bytes, *args: Any, **kwargs: Any) -> bytes:
        """Run a payload made by codec.encode_payload; options (request.CALL_OPTIONS, positionally or
        by name): ngpus, stdout, stderr, timeout, queue_timeout, on_state, gpus, gpu_memory, working_dir, memory,
        cpus, priority.
        Returns outcome bytes (see rpycdl.client)."""
        try:
            options = self.keep_sinks(request.named(request.CALL_OPTIONS, args, kwargs))
            request.check_size(payload, "payload", self.context.limits.max_payload)
            body = codec.check_payload(payload)
            return self._run(self._request(options, body=body, output=request.output(options)))
        except RpycdlError as exc:
            return codec.encode_error(refused(self.context, exc), tb="")

    def exposed_run_buffers(self, payload: bytes, layout: Any, send: Callable[[], None] | None,
                            receive: Callable[[Any], None], *args: Any, **kwargs: Any) -> bytes:
        """`run` for a payload made by codec.encode_call, with large buffers beside it: `layout` (codec.Layout)
        says their sizes; once the request is checked, the client's `send()` writes them raw on the
        connection (bulk.pull); a result's go back raw to its `receive(layout)` (bulk.push)."""
        try:
            options = self.keep_sinks(request.named(request.CALL_OPTIONS, args, kwargs), receive)
            layout = codec.check_layout(layout)
            request.check_size(payload, "payload", self.context.limits.max_payload, codec.layout_bytes(layout))
            checked = self._request(options, body=codec.check_payload(payload, len(layout)),
                                    output=request.output(options, receive))
            if layout and send is None:
                raise InvalidRequestError("a payload with out-of-band buffers needs the client's send callback")
            buffers = bulk.pull(self._conn, send, layout, self.context.state_dir) if layout else []  # type: ignore[arg-type]
            return self._run(dataclasses.replace(checked, buffers=buffers))
        except RpycdlError as exc:
            return codec.encode_error(refused(self.context, exc), tb="")

    def exposed_run_code(self, fn: Any, args: Any = None, ngpus: Any = None, stdout: Any = None,
                         stderr: Any = None, **options: Any) -> Any:
        """The original servers' call: `fn` is dill bytes, `stdout`/`stderr` file-like objects;
        options by name: timeout, queue_timeout, gpus, gpu_memory, priority.

        Returns the job's value and raises its exception, as the original servers did."""
        try:
            options = request.named(("timeout", "queue_timeout", "gpus", "gpu_memory", "priority"), (), options)
            self.keep_sinks({"stdout": stdout, "stderr": stderr})
            request.check_size(fn, "fn", self.context.limits.max_payload)
            codec.check_pickle(fn, "fn")
            args = netrefs.materialize(args, self.context.limits.max_payload)  # lists and dicts come by reference
            body = dill.dumps((bytes(fn), args, True), recurse=True)
            outcome = self._run(self._request({**options, "ngpus": ngpus}, body=body, output=request.Output(
                request.writer(stdout), request.writer(stderr))))
        except RpycdlError as exc:
            refused(self.context, exc)
            raise
        self.after_reply()  # the job is over: its GPUs go back before its value is made here
        return resultpipe.decode_bounded(outcome, plain=self.context.accounts.isolated)  # its code never runs as root

    def exposed_run_container(self, image: str, command: Any, *args: Any, **kwargs: Any) -> bytes:
        """Run `command` (a list of strings) in a container of `image` with GPUs of its own (the
        generic server's job; see rpycdl.server.containers.check_job for env, workdir and mounts);
        options (request.CONTAINER_OPTIONS, positionally or by name): ngpus (default 1), env,
        workdir, mounts, stdout, stderr, timeout, queue_timeout, on_state.

        Returns outcome bytes (see rpycdl.client): the exit code, 0, or ContainerError with the
        last log lines on any other."""
        try:
            require_extra("site", "docker")  # only servers that run containers need docker
            from rpycdl.server import containers

            options = self.keep_sinks(request.named(request.CONTAINER_OPTIONS, args, kwargs))
            place = [options.pop(name, None) for name in ("env", "workdir", "mounts")]
            command, env, workdir, mounts = netrefs.materialize((command, *place), self.context.limits.max_payload)
            spec = containers.check_job(image, command, env=env, workdir=workdir, mounts=mounts)
            options["ngpus"] = 1 if options.get("ngpus") is None else options["ngpus"]
            return self._run(self._request(options, container=spec, output=request.output(options)))
        except RpycdlError as exc:
            return codec.encode_error(refused(self.context, exc), tb="")

    def exposed_gpu_status(self) -> str:
        """JSON: this server, each GPU with its holders and memory use, and the queue (status.gpu_status)."""
        return json.dumps(status.gpu_status(self.context, self._identity))

    def exposed_load(self) -> tuple[int, int, int]:
        """(free GPUs, waiting requests, GPUs): how soon a new job would run here."""
        return status.load(self.context)

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

