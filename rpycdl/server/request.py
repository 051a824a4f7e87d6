"""A job as a client asked for it, checked once at the service's edge: what to run (a payload or a
container), on what (whole GPUs or a share of one), for how long, where its output goes, and
whose it is. Nothing unchecked goes further."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rpycdl.defaults import MIN_JOB_MEMORY
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import priorities
from rpycdl.scheduler.shares import GPURequest, parse_request
from rpycdl.security.accounts import Account
from rpycdl.security.auth import Identity
from rpycdl.server import reclaim
from rpycdl.server.context import ServerContext, max_job_memory
from rpycdl.units import format_size, parse_size

if TYPE_CHECKING:  # docker is needed only by servers that run containers
    from rpycdl.server.containers import JobSpec

MAX_TIMEOUT = 366 * 24 * 3600.0
"""The longest timeout or queue_timeout a request may give, in seconds."""

CALL_OPTIONS = ("ngpus", "stdout", "stderr", "timeout", "queue_timeout", "on_state", "gpus", "gpu_memory",
                "working_dir", "memory", "cpus", "idle_reclaim", "priority")
"""The options of `run` and `run_buffers` after their fixed arguments, in the order rpycdl clients
send them positionally (they may also come by name); `working_dir` is the content hash of a working
directory sent before (exposed_put_working_dir); `memory` and `cpus` are the host memory and CPU cores it may use;
`idle_reclaim=False` keeps its GPUs from --idle-reclaim (rpycdl.server.reclaim); `priority` its place among the
waiting (rpycdl.scheduler.priorities)."""

CONTAINER_OPTIONS = ("ngpus", "env", "workdir", "mounts", "stdout", "stderr", "timeout", "queue_timeout", "on_state")
"""The options of `run_container` after the image and the command, likewise."""

SUBMIT_OPTIONS = ("ngpus", "gpus", "gpu_memory", "timeout", "queue_timeout", "name", "working_dir", "seal", "memory",
                  "cpus", "after", "retries", "retry_on_failure", "idle_reclaim", "priority")
"""The options of `submit` and `submit_command` after the payload or the command; `seal` is the client's seal
of the job's result (rpycdl.security.results.Seal.sent), or None; `after` its dependencies
(rpycdl.scheduler.dependencies: "ok:JOB[,JOB]"); `retries` and `retry_on_failure` when it is requeued
(rpycdl.scheduler.attempts)."""

SUBMIT_CONTAINER_OPTIONS = ("ngpus", "env", "workdir", "mounts", "timeout", "queue_timeout", "name", "seal")
"""The options of `submit_container` after the image and the command."""

SESSION_OPTIONS = ("ngpus", "gpus", "gpu_memory", "timeout", "queue_timeout", "idle_timeout", "on_state", "working_dir",
                   "memory", "cpus", "idle_reclaim", "priority")
"""The options of `session_open`."""

SESSION_CALL_OPTIONS = ("stdout", "stderr", "timeout")
"""The options of `session_call` after the payload, its layout and the client's send and receive callbacks (each
of receive, stdout and stderr that is None: the session's, as its last call gave it)."""

MAX_NAME = 64
"""The longest name a detached job may have."""


def discard(_: str) -> None:
    """An output sink that drops what it is given."""


@dataclass(frozen=True)
class Output:
    """Where a job's output and news go.

    Attributes:
        stdout, stderr: receive the job's output, as text, as it is printed.
        on_state: the client's callback, called as on_state("pending" or "running", JSON info).
        receive: the client's callback that reads a large result's buffers beside RPyC
            (wire.bulk.push); None sends every result in band.
    """

    stdout: Callable[[str], None] = discard
    stderr: Callable[[str], None] = discard
    on_state: Callable[[str, str], None] | None = None
    receive: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class JobRequest:
    """One job, checked.

    Attributes:
        gpu_request: whole GPUs, or a share of one.
        owner: who sent it.
        client: the client's address, for status.
        body: a payload's dill body (wire.codec.check_payload), run in a job process; or None,
            for a container.
        buffers: the payload's out-of-band buffers (the job process gets them by the fork).
        container: a command to run in a container of its own instead (the generic server).
        command: for a payload that runs a command (server.commands.run_command), its argv: the
            job's value is the command's exit code, and it fails unless that is 0.
        timeout: seconds the job may run; queue_timeout: seconds it may wait for its GPUs.
        output: where its output goes.
        detached: submitted to run without its client (a supervisor owns it), with `name` if given.
        working_dir: the content hash of the working directory the job runs in (in the server's
            cache: unpacked for the job alone), or None.
        account: the Unix account it runs as (a root server's: its owner's); None: the server's own.
        session: a session (rpycdl.server.sessions): it holds its GPUs and its process between calls;
            `timeout` bounds its life, `idle_timeout` the time between its calls.
        memory, cpus: the host memory (bytes) and CPU cores it asked for; None: the server's defaults
            (--job-memory, --job-cpus), where it fences jobs.
        after: a detached job's dependencies, resolved to ids ("ok:ID[,ID]": rpycdl.server.held), or None.
        retries, retry_on_failure: how many times a detached job may be requeued, and whether also after an end of
            its own (rpycdl.scheduler.attempts).
        keep_idle: it asked idle_reclaim=False: its GPUs are not reclaimed however idle (rpycdl.server.reclaim).
        priority: its priority among the waiting requests (rpycdl.scheduler.priorities), within its owner's ceiling.
    """

    gpu_request: GPURequest
    owner: Identity
    client: str
    body: bytes | None = None
    buffers: list[Any] = field(default_factory=list)
    container: JobSpec | None = None
    command: tuple[str, ...] | None = None
    timeout: float | None = None
    queue_timeout: float | None = None
    output: Output = field(default_factory=Output)
    detached: bool = False
    name: str | None = None
    working_dir: str | None = None
    account: Account | None = None
    session: bool = False
    idle_timeout: float | None = None
    memory: int | None = None
    cpus: float | None = None
    after: str | None = None
    retries: int = 0
    retry_on_failure: bool = False
    keep_idle: bool = False
    priority: int = 0

    @property
    def kind(self) -> str:
        """"container", "command", "session" or "call" (a Python callable)."""
        if self.session:
            return "session"
        return "container" if self.container is not None else "command" if self.command is not None else "call"

    def summary(self) -> dict[str, Any]:
        """What was asked, as the ledger keeps it (JSON)."""
        asked: dict[str, Any] = {"timeout": self.timeout, "queue_timeout": self.queue_timeout}
        if self.command is not None:
            asked["command"] = list(self.command)
        if self.container is not None:
            asked.update(image=self.container.image, command=list(self.container.command))
        if self.working_dir is not None:
            asked["working_dir"] = self.working_dir
        if self.session:
            asked.update(idle_timeout=self.idle_timeout, calls=0)
        if self.memory is not None:
            asked["memory"] = self.memory
        if self.cpus is not None:
            asked["cpus"] = self.cpus
        if self.after is not None:
            asked["after"] = self.after
        if self.retries:
            asked.update(retries=self.retries, retry_on_failure=self.retry_on_failure)
        if self.keep_idle:
            asked["idle_reclaim"] = False
        return asked


def output(options: dict[str, Any], receive: Callable[[Any], None] | None = None) -> Output:
    """Take a call's output callbacks (stdout, stderr, on_state) out of its `options`."""
    return Output(options.pop("stdout", None) or discard, options.pop("stderr", None) or discard,
                  options.pop("on_state", None), receive)


def check_size(data: Any, what: str, limit: int, beside: int = 0) -> None:
    """Refuse `data` and `beside` more bytes (its out-of-band buffers) over `limit` (--max-payload)."""
    if isinstance(data, (bytes, bytearray)) and len(data) + beside > limit:
        raise LimitError(f"the {what} is {len(data) + beside} bytes, over this server's limit of {limit} "
                         "(--max-payload)")


def check_seconds(value: Any, name: str) -> float | None:
    """Check an optional timeout: None, or a positive finite number of seconds (a year at most)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_TIMEOUT:
        raise InvalidRequestError(f"{name}={value!r}: must be a positive number of seconds (at most a year)")
    return float(value)


def named(names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A call's options, whether they came positionally (in the order of `names`) or by name."""
    if len(args) > len(names):
        raise InvalidRequestError(f"too many arguments: at most {len(names)} after the fixed ones")
    options = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name not in names:
            raise InvalidRequestError(f"unknown option {name}=; the options are {', '.join(names)}")
        if name in options:
            raise InvalidRequestError(f"{name} given twice")
        options[name] = value
    return options


def check_name(name: Any) -> str | None:
    """Check a detached job's optional name: letters, digits, '.', '_', '-', not all digits (ids are not)."""
    if name is None:
        return None
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or name.isdigit() \
            or not name.replace(".", "").replace("_", "").replace("-", "").isalnum() or not name.isascii():
        raise InvalidRequestError(f"name={name!r}: not a job name (1 to {MAX_NAME} letters, digits, '.', '_' or '-', "
                                  "not only digits)")
    return name


def check_command(command: Any) -> tuple[str, ...]:
    """Check a command: a non-empty list of strings (an argv, never a shell string)."""
    if not isinstance(command, (list, tuple)) or not command or not all(isinstance(arg, str) for arg in command) \
            or not command[0]:
        raise InvalidRequestError(f"a command is a non-empty list of strings, not {command!r}")
    return tuple(command)


def check_memory(value: Any, context: ServerContext) -> int | None:
    """Check a job's host memory: None, or a size ("16GiB", or bytes) within the server's --max-job-memory."""
    if value is None:
        return None
    try:
        size = parse_size(value) if isinstance(value, str) else value
    except InvalidRequestError:
        size = None
    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidRequestError(f"memory={value!r}: a size of host memory, such as '16GiB' or a number of bytes")
    most = max_job_memory(context.limits)
    if not MIN_JOB_MEMORY <= size <= most:
        raise InvalidRequestError(f"memory={value!r}: between {format_size(MIN_JOB_MEMORY)} and this server's "
                                  f"--max-job-memory ({format_size(most)})")
    return size


def check_cpus(value: Any) -> float | None:
    """Check a job's CPU cores: None, or a positive number up to this machine's cores."""
    if value is None:
        return None
    cores = os.cpu_count() or 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.01 <= value <= cores:
        raise InvalidRequestError(f"cpus={value!r}: a number of CPU cores between 0.01 and this machine's {cores}")
    return float(value)


def build(context: ServerContext, owner: Identity, client: str, *, ngpus: Any = None, gpus: Any = None,
          gpu_memory: Any = None, timeout: Any = None, queue_timeout: Any = None, working_dir: Any = None,
          memory: Any = None, cpus: Any = None, idle_reclaim: Any = None, priority: Any = None,
          **job: Any) -> JobRequest:
    """Check what a request asks for against this server, and make it a JobRequest.

    Args:
        context: the server's GPUs and rules.
        owner, client: who sent it, from where.
        ngpus, gpus, gpu_memory: the GPUs, as the client gave them (scheduler.shares.parse_request).
        timeout, queue_timeout: seconds, as the client gave them.
        working_dir: the content hash of a working directory in the server's cache that `owner` sent, or None.
        memory, cpus: the host memory and CPU cores it asks for, as the client gave them (check_memory, check_cpus).
        idle_reclaim: False to keep its GPUs however idle, within its owner's allowance (reclaim.check_keep).
        priority: its priority, as the client gave it (rpycdl.scheduler.priorities: checked, and against `owner`'s
            ceiling).
        job: what to run and where its output goes: `body` and `buffers` (and `command`), or
            `container`; `output`; `detached` and `name`.

    Raises:
        InvalidRequestError: anything it could never run.
        NotAllowedError: its owner may not run jobs here, or has no account (security.accounts).
        LimitError: idle_reclaim=False over its owner's allowance, or a priority above its owner's ceiling.
    """
    rank = priorities.check(priority)
    priorities.allow(context.lock_dir, owner.user, rank, admin=owner.admin, label=owner.label)
    sizes = [gpu.memory_total for gpu in context.gpus]
    if working_dir is not None and (not isinstance(working_dir, str)
                                    or not context.working_dirs.has(working_dir, owner.label)):
        raise InvalidRequestError(f"working_dir {working_dir!r} is not a working directory you sent this server: "
                                  "rpycdl clients send it first (put_working_dir) and name it by its hash")
    return JobRequest(parse_request(ngpus, gpus, gpu_memory, sizes, context.shares), owner, client,
                      timeout=check_seconds(timeout, "timeout"),
                      queue_timeout=check_seconds(queue_timeout, "queue_timeout"), working_dir=working_dir,
                      account=context.accounts.account(owner), memory=check_memory(memory, context),
                      cpus=check_cpus(cpus), keep_idle=reclaim.check_keep(context, owner, idle_reclaim),
                      priority=rank, **job)


def writer(stream: Any) -> Callable[[str], None]:
    """A sink writing to a client's file-like object (an RPyC netref), flushing each time."""
    if stream is None:
        return discard

    def write(text: str) -> None:
        stream.write(text)
        flush = getattr(stream, "flush", None)
        if flush is not None:
            flush()

    return write
