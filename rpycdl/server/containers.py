"""Per-job containers of the generic server: a client's command in a container of an image of its
choice, with exactly its GPUs, its output streamed, removed however it ends.

Job containers carry their owner server id, their job id and the lock directory whose GPU locks
they run under, so orphans (a job container whose job no longer holds a GPU lock, because the
process that ran it was killed) can be found and removed. The process that runs a container job
(run_job_container) holds its GPU locks and owns its container: the connection process of an
attached job, the supervisor of a detached one (rpycdl.server.supervisor), which outlives its client
and its server. Each container has a watcher, `python -m rpycdl.server.container_watcher OWNER_PID
CONTAINER_ID`, in a session of its own: if that owner dies, the watcher removes the container at
once. Job containers left by a server killed whole (watchers included) are removed when a generic
server starts again, and by every container job that starts.
"""

from __future__ import annotations

import codecs
import os
import posixpath
import queue
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import DeviceRequest, Mount

from rpycdl.errors import ContainerError, InvalidRequestError, JobCancelledError, JobTimeoutError, RpycdlError
from rpycdl.scheduler import dirfds
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.server import container_watcher
from rpycdl.site.docker import LABEL_JOB, LABEL_LOCK_DIR, LABEL_OWNER, LABEL_ROLE, docker_client, listed, remove

ENV_MOUNT_ROOTS = "RPYCDL_MOUNT_ROOTS"
"""Colon-separated host directories a job container may mount from (default: none)."""

LOG_TAIL_LINES = 20
ORPHAN_SWEEP_INTERVAL = 1.0

_IMAGE = re.compile(r"[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class JobSpec:
    """A checked request to run a command in its own container."""

    image: str
    command: tuple[str, ...]
    env: dict[str, str]
    workdir: str | None
    mounts: tuple[Mount, ...]


def mount_roots() -> tuple[str, ...]:
    """Host directories job containers may mount from: $RPYCDL_MOUNT_ROOTS, colon-separated."""
    return tuple(os.path.realpath(p) for p in os.environ.get(ENV_MOUNT_ROOTS, "").split(":") if p)


def check_job(image: Any, command: Any, *, env: Any = None, workdir: Any = None, mounts: Any = None,
              roots: Sequence[str] | None = None) -> JobSpec:
    """Check a job container request; raise InvalidRequestError at once if it is not acceptable.

    Args:
        image: an image reference (name[:tag][@digest]).
        command: the command as a list of strings, never a shell string.
        env: {NAME: value}.
        workdir: an absolute path in the container, or None.
        mounts: [{"source": host dir, "target": container dir, "read_only": bool}]; each host
            directory must lie under one of `roots` (default: mount_roots()).
    """
    if not isinstance(image, str) or not _IMAGE.fullmatch(image):
        raise InvalidRequestError(f"not an image reference: {image!r}")
    if isinstance(command, (str, bytes)) or not isinstance(command, (list, tuple)) or not command \
            or not all(isinstance(arg, str) and "\0" not in arg for arg in command):
        raise InvalidRequestError(f"command must be a non-empty list of strings (no shell string): {command!r}")
    env = dict(env or {})
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name) or not isinstance(value, str):
            raise InvalidRequestError(f"bad environment entry {name!r}={value!r}: NAME and value must be strings")
    if workdir is not None and (not isinstance(workdir, str) or not posixpath.isabs(workdir)):
        raise InvalidRequestError(f"workdir must be an absolute path in the container, not {workdir!r}")
    roots = mount_roots() if roots is None else tuple(os.path.realpath(r) for r in roots)
    checked = []
    for mount in mounts or ():
        if not isinstance(mount, Mapping) or set(mount) - {"source", "target", "read_only"}:
            raise InvalidRequestError(f"a mount is {{'source': ..., 'target': ..., 'read_only': ...}}, not {mount!r}")
        source, target = mount.get("source"), mount.get("target")
        read_only = mount.get("read_only", True)
        if not isinstance(source, str) or not isinstance(target, str) or not isinstance(read_only, bool):
            raise InvalidRequestError(f"bad mount {mount!r}")
        real = os.path.realpath(source)
        if not os.path.isabs(source) or not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
            raise InvalidRequestError(f"mount source {source!r} is not under an allowed directory "
                                      f"(${ENV_MOUNT_ROOTS}: {':'.join(roots) or 'none set'})")
        if not os.path.isdir(real):
            raise InvalidRequestError(f"mount source {source!r} is not a directory")
        _check_unchangeable(source, real)
        if not posixpath.isabs(target) or posixpath.normpath(target) == "/":
            raise InvalidRequestError(f"mount target must be an absolute path other than /, not {target!r}")
        checked.append(Mount(posixpath.normpath(target), real, type="bind", read_only=read_only))
    return JobSpec(image, tuple(command), env, workdir, tuple(checked))


def _check_unchangeable(source: str, real: str) -> None:
    """On a server running as root: refuse a mount source that another account could swap for a link between
    this check and the engine's mount (which follows it, as root): every directory of it must be root's alone
    (dirfds.check_trusted). Elsewhere the engine mounts nothing the server's account could not read itself."""
    if os.geteuid() != 0:
        return
    try:
        dirfds.check_trusted(real, "mount source")
    except RpycdlError as exc:
        raise InvalidRequestError(f"mount source {source!r}: a server running as root mounts only directories no "
                                  f"other account can change ({exc})") from None


def gpu_environment(uuids: Sequence[str]) -> dict[str, str]:
    """The GPU variables of a job container. The NVIDIA runtime shows only the granted GPUs,
    numbered from 0 inside, so CUDA_VISIBLE_DEVICES counts 0..n-1 there."""
    return {
        "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(uuids))),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "RPYCDL_GPU_UUIDS": ",".join(uuids),
    }


def run_job_container(
    spec: JobSpec,
    uuids: Sequence[str],
    *,
    simulated: bool,
    owner: str,
    job_id: str,
    lock_dir: str,
    on_stdout: Callable[[str], None],
    on_stderr: Callable[[str], None],
    timeout: float | None = None,
    poll: Callable[[], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    extra_env: Mapping[str, str] | None = None,
    user: str | None = None,
    client: docker.DockerClient | None = None,
) -> int:
    """Run a checked job in its own container with exactly the GPUs `uuids`; return its exit code.

    Output is streamed to on_stdout/on_stderr as it comes. However it ends, the container is
    stopped and removed before this returns.

    Args:
        simulated: the GPUs are simulated: no device request, NVIDIA_VISIBLE_DEVICES still set.
        owner, job_id, lock_dir: the server id, job and lock directory the container is labelled
            with; while it runs, orphaned job containers of the lock directory are removed.
        timeout: seconds the container may run.
        poll: called about every 0.1 s while it runs; may raise (client gone) to stop it.
        cancelled: polled as often; True stops it.
        extra_env: more variables (job id, ticket), set after the job's own.
        user: "uid:gid" the container's process runs as (its owner's account, on a root server); None: the
            image's user.

    Raises:
        ContainerError: a non-zero exit, with the last log lines.
        JobTimeoutError / JobCancelledError: the container was stopped for that reason.
    """
    client = client or docker_client()
    remove_orphans(lock_dir, client)  # before taking GPUs an orphan may still be using
    env = {**spec.env, **(extra_env or {}), **gpu_environment(uuids)}
    labels = {LABEL_ROLE: "job", LABEL_OWNER: owner, LABEL_JOB: job_id, LABEL_LOCK_DIR: lock_dir}
    container = _create(client, spec, uuids, simulated=simulated, env=env, labels=labels, user=user)
    # watched: this process, which holds the job's GPU locks (a detached job's supervisor, not the
    # connection process that accepted it and has left)
    watcher = subprocess.Popen([sys.executable, "-m", container_watcher.__name__, str(os.getpid()), container.id],
                               start_new_session=True, stdin=subprocess.DEVNULL)
    output = _Output({1: on_stdout, 2: on_stderr})
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        _follow(client, container, output, lock_dir, lambda: _stop(container, deadline, timeout, poll, cancelled))
        code = int(container.wait()["StatusCode"])
    finally:
        remove(container)
        watcher.kill()
        watcher.wait()
    if code != 0:
        log = "\n".join(output.tail)
        raise ContainerError(f"container of {spec.image} {list(spec.command)} exited with code {code}; "
                             f"last {len(output.tail)} log line(s):\n{log}", code, log)
    return code


def _create(client: docker.DockerClient, spec: JobSpec, uuids: Sequence[str], *, simulated: bool,
            env: dict[str, str], labels: dict[str, str], user: str | None) -> Container:
    """Create (not start) the job's container, with exactly the GPUs `uuids` unless they are simulated."""
    requests = [] if simulated else [DeviceRequest(device_ids=list(uuids), capabilities=[["gpu"]])]
    try:
        return client.containers.create(
            spec.image, list(spec.command), environment=env, working_dir=spec.workdir, mounts=list(spec.mounts),
            device_requests=requests, security_opt=["no-new-privileges"], init=True, labels=labels,
            **({"user": user} if user else {}))
    except docker.errors.ImageNotFound:
        raise InvalidRequestError(f"no image {spec.image} on this server's Docker engine") from None
    except docker.errors.APIError as exc:
        raise RpycdlError(f"cannot create a container of {spec.image}: {exc.explanation or exc}") from None


class _Output:
    """A container's output on its way to the job's sinks (by stream: 1, 2), with its last lines kept."""

    def __init__(self, sinks: dict[int, Callable[[str], None]]) -> None:
        self.sinks = sinks
        self.decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in sinks}
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._partial = ""

    def add(self, fd: int, data: bytes) -> None:
        text = self.decoders[fd].decode(data)
        self.sinks[fd](text)
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        self.tail.extend(lines)

    def end(self) -> None:
        if self._partial:
            self.tail.append(self._partial)


def _stop(container: Container, deadline: float | None, timeout: float | None, poll: Callable[[], None] | None,
          cancelled: Callable[[], bool] | None) -> None:
    """Raise if the job must stop now: the client went (poll raises), a cancel, its timeout."""
    if poll is not None:
        poll()
    if cancelled is not None and cancelled():
        raise JobCancelledError(f"container {container.short_id} was cancelled and removed")
    if deadline is not None and time.monotonic() >= deadline:
        raise JobTimeoutError(f"container {container.short_id} ran past its timeout of {timeout:g} s and was removed")


def _follow(client: docker.DockerClient, container: Container, output: _Output, lock_dir: str,
            check: Callable[[], None]) -> None:
    """Start the container and hand its output on until it ends; `check` (about every 0.1 s) may
    raise to stop it; orphans of the lock directory are removed every ORPHAN_SWEEP_INTERVAL."""
    chunks: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
    container.start()
    for fd in (1, 2):  # the engine's log of each stream, read from its start: nothing lost, nothing twice
        stream = client.api.logs(container.id, stdout=fd == 1, stderr=fd == 2, stream=True, follow=True)
        threading.Thread(target=_pump, args=(fd, stream, chunks), daemon=True).start()
    next_sweep, open_streams = time.monotonic() + ORPHAN_SWEEP_INTERVAL, 2
    while open_streams:
        try:
            item = chunks.get(timeout=0.1)
        except queue.Empty:
            item = (0, b"")
        if item is None:
            open_streams -= 1
            continue
        if item[1]:
            output.add(*item)
        check()
        if time.monotonic() >= next_sweep:
            remove_orphans(lock_dir, client)
            next_sweep = time.monotonic() + ORPHAN_SWEEP_INTERVAL
    output.end()


def _pump(fd: int, stream: Iterable[bytes], chunks: queue.Queue[tuple[int, bytes] | None]) -> None:
    """Move one of a container's streams (`fd`: 1, 2) into `chunks`; None when it ends."""
    try:
        for data in stream:
            if data:
                chunks.put((fd, data))
    except (docker.errors.DockerException, OSError, ValueError):  # removed under us
        pass
    finally:
        chunks.put(None)


def remove_orphans(lock_dir: str, client: docker.DockerClient | None = None) -> list[str]:
    """Remove the job containers of `lock_dir` whose job holds no GPU lock any more.

    A job container is created after its GPUs are locked and removed before they are
    released, so one whose job holds no lock (or only the record of a grant whose holder died,
    which stays while the container runs) lost the process that ran it."""
    client = client or docker_client()
    containers = listed(client, f"{LABEL_ROLE}=job", f"{LABEL_LOCK_DIR}={lock_dir}")
    if not containers:
        return []
    holding = {info.get("job_id") for holders in GPULockManager(lock_dir).snapshot()["held"].values()
               for info in holders if not info.get("leftover")}
    removed = []
    for container in containers:
        if container.attrs["Labels"].get(LABEL_JOB) not in holding:
            remove(container)
            removed.append(container.attrs["Names"][0].lstrip("/"))
    return removed
