"""Docker: service containers (`rpycdl up` / `rpycdl down`), and per-job containers for the generic server.

Everything goes through the docker SDK with argument lists: no shell string is ever built.
Every container rpycdl starts carries the label `rpycdl.role` (registry, server or job);
job containers also carry their owner server id, their job id and the lock directory whose
GPU locks they run under, so orphans (a job container whose job no longer holds a GPU lock,
because the connection process that ran it was killed) can be found and removed.

Each job container has a watcher, `python -m rpycdl.containers CONNECTION_PID CONTAINER_ID`,
in a session of its own: if the connection process running the job dies, the watcher removes
the container at once. Job containers left by a server killed whole (watchers included) are
removed when a generic server starts again, and by every container job that starts.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import posixpath
import queue
import re
import select
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import DeviceRequest, Mount, Ulimit

from rpycdl.defaults import LOCK_DIR, REGISTRY_PORT, SERVER_PORT
from rpycdl.errors import InvalidRequestError, JobCancelledError, JobTimeoutError, RpycdlError
from rpycdl.locks import GPULockManager
from rpycdl.registry import parse_address

LABEL_ROLE = "rpycdl.role"
LABEL_OWNER = "rpycdl.owner"
LABEL_JOB = "rpycdl.job"
LABEL_LOCK_DIR = "rpycdl.lock-dir"
LABEL_UP = "rpycdl.up"  # the `up` call that started a service container
DOCKER_SOCKET = "/var/run/docker.sock"
ENV_MOUNT_ROOTS = "RPYCDL_MOUNT_ROOTS"
"""Colon-separated host directories a job container may mount from (default: none)."""

LOG_TAIL_LINES = 20
ORPHAN_SWEEP_INTERVAL = 1.0
STOP_TIMEOUT = 10

_IMAGE = re.compile(r"[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
                    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPEC = re.compile(r"([a-z][a-z0-9_-]*)(?::([A-Za-z0-9._-]+))?")


class ContainerError(RpycdlError):
    """A job container exited with a non-zero code; the message ends with its last log lines."""

    def __init__(self, message: str, exit_code: int = -1, log_tail: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.log_tail = log_tail

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.exit_code, self.log_tail)


def docker_client() -> docker.DockerClient:
    """A client of the local Docker engine ($DOCKER_HOST, else the default socket).

    Raises:
        RpycdlError: the engine cannot be reached.
    """
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        raise RpycdlError(f"cannot reach the Docker engine: {exc}") from None
    return client


# -- service containers: rpycdl up / down ------------------------------------------------


@dataclass
class UpConfig:
    """What `rpycdl up` (and scripts/start_servers.sh) starts.

    Attributes:
        specs: SERVICE[:VERSION] per server, run from image rpycdl-SERVICE:VERSION (or :latest).
        registry: HOST:PORT of the registry the servers announce to.
        start_registry: also run the registry, in a container, bound to that HOST:PORT.
        host: address the servers listen on, and so the address the registry hands to
            clients (a server registers from its own address). Non-loopback needs insecure.
        insecure: let servers listen on a non-loopback address without authentication.
        port: first server port; each further server takes the next one (0: any free port).
        gpus: "all" for every GPU of the host through the NVIDIA runtime, or fake:N.
        lock_dir: host directory shared by every server, mounted at the same path.
        user: UID[:GID] the servers run as; None keeps the image's non-root user.
        secret_file, tls_cert, tls_key, tls_ca: host files the servers authenticate with
            (`rpycdl serve --secret-file`, `--tls-*`), mounted read-only under CREDENTIALS_DIR;
            they must be readable by the servers' user (uid 1000 unless `user`).
        shm_size: shared memory for data loaders.
        image_prefix: images are IMAGE_PREFIX-SERVICE:TAG.
    """

    specs: list[str]
    registry: str = f"127.0.0.1:{REGISTRY_PORT}"
    start_registry: bool = True
    host: str = "127.0.0.1"
    insecure: bool = False
    port: int = SERVER_PORT
    gpus: str = "all"
    lock_dir: str = LOCK_DIR
    user: str | None = None
    secret_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    shm_size: str = "8g"
    image_prefix: str = "rpycdl"
    ulimits: list[Ulimit] = field(default_factory=lambda: [
        Ulimit(name="memlock", soft=-1, hard=-1), Ulimit(name="stack", soft=67108864, hard=67108864)])


CREDENTIALS_DIR = "/run/rpycdl"
"""Where server containers find the credential files mounted from the host."""


def parse_spec(spec: str) -> tuple[str, str | None]:
    """'pytorch:2.5' -> ('pytorch', '2.5'); 'jax' -> ('jax', None)."""
    match = _SPEC.fullmatch(spec)
    if not match:
        raise InvalidRequestError(f"bad server spec {spec!r}: SERVICE[:VERSION], such as pytorch:2.5")
    return match.group(1), match.group(2)


def prepare_lock_dir(path: str) -> None:
    """Create the shared lock directory, writable by every container user (mode 1777); one that
    exists without being writable by all is made so if it is ours, else refused with the fix."""
    if not os.path.isabs(path):
        raise InvalidRequestError(f"the lock directory must be an absolute path, not {path!r}")
    if not os.path.isdir(path):
        os.makedirs(path)
        os.chmod(path, 0o1777)
    elif not os.stat(path).st_mode & 0o002:
        if os.stat(path).st_uid != os.geteuid():
            raise InvalidRequestError(f"the lock directory {path} is not writable by the servers' users: "
                                      f"make it so (chmod 1777 {path}) or choose another (--lock-dir)")
        os.chmod(path, 0o1777)


def engine_socket() -> str:
    """The host path of the Docker engine's socket: $DOCKER_HOST's if it is unix://PATH, else /var/run/docker.sock."""
    host = os.environ.get("DOCKER_HOST", "")
    return host.removeprefix("unix://") if host.startswith("unix://") else DOCKER_SOCKET


def up(config: UpConfig, client: docker.DockerClient | None = None,
       say: Callable[[str], None] | None = None) -> list[Container]:
    """Start the registry (if asked) and one server container per spec, on the host network.

    Starting twice is harmless: a container of the same name that runs already is left as it is
    (and said), a stale one (created, exited) is replaced. If the engine refuses the ulimits
    (rootless and sandboxed engines may not raise memlock), the servers run with the engine's
    own, and `say` says so. If a container cannot start, every one this call created is removed
    again, so that a retry meets no name conflict. Servers share the host's process namespace
    (pid_mode host): see SERVER_PID_MODE.

    Args:
        config: what to start.
        client: the engine (default: docker_client()).
        say: where notes go, one line each (default: warnings of the rpycdl.containers logger).

    Returns:
        The containers this call started (not those left running).

    Raises:
        InvalidRequestError: a bad spec, option or credential file.
        RpycdlError: an image is missing, or the engine refused to start a container (its own words).
    """
    client = client or docker_client()
    say = say or logging.getLogger("rpycdl.containers").warning
    servers = [parse_spec(spec) for spec in config.specs]
    if not servers:
        raise InvalidRequestError("name at least one server: SERVICE[:VERSION]")
    if config.gpus != "all" and not config.gpus.startswith("fake:"):
        raise InvalidRequestError(f"--gpus must be 'all' or fake:N, not {config.gpus!r}")
    reg_host, reg_port = parse_address(config.registry)
    credentials, credential_args = _credentials(config)
    prepare_lock_dir(config.lock_dir)
    common: dict[str, Any] = {"network_mode": "host", "restart_policy": {"Name": "unless-stopped"}}
    token = uuid.uuid4().hex[:12]
    started: list[Container | None] = []
    ulimits = list(config.ulimits)
    try:
        if config.start_registry:
            image = f"{config.image_prefix}-{servers[0][0]}:{servers[0][1] or 'latest'}"
            started.append(_start(client, f"{config.image_prefix}-registry", image, say,
                                  command=["registry", "--host", reg_host, "--port", str(reg_port)],
                                  entrypoint=["rpycdl"], labels={LABEL_ROLE: "registry", LABEL_UP: token}, **common))
        for offset, (service, version) in enumerate(servers):
            port = config.port + offset if config.port else 0  # 0: each server takes any free port
            args = ["--host", config.host, "--port", str(port), "--registry", f"{reg_host}:{reg_port}",
                    "--lock-dir", config.lock_dir, *credential_args]
            options = _server_options(config, service, args, credentials, token)
            name = _server_name(config.image_prefix, service, version)
            image = f"{config.image_prefix}-{service}:{version or 'latest'}"
            try:
                started.append(_start(client, name, image, say, ulimits=ulimits, **options, **common))
            except docker.errors.APIError as exc:
                if not ulimits or not _ULIMITS_REFUSED.search(str(exc.explanation or exc)):
                    raise
                say(f"the engine refused the ulimits memlock=-1, stack=64 MiB ({_engine_words(exc)}): the servers run "
                    "with the engine's own instead (--no-ulimits skips asking)")
                ulimits = []
                started.append(_start(client, name, image, say, ulimits=ulimits, **options, **common))
    except BaseException as exc:  # remove what this call created, started or not
        for container in _listed(client, f"{LABEL_UP}={token}"):
            _remove(container)
        if isinstance(exc, docker.errors.APIError):
            raise RpycdlError(f"cannot start the containers: {exc.explanation or exc}") from None
        raise
    return [container for container in started if container is not None]


SERVER_PID_MODE = "host"
"""Server containers see every process of the host, as `--pid host`: every server sharing a lock directory
must see the processes of every job on the host, of whichever server or container, to check that nothing
of a crashed job still runs before its GPUs are granted again, and for the memory watchdog, which reads
the host pids NVML reports."""

_ULIMITS_REFUSED = re.compile(r"rlimit|ulimit", re.IGNORECASE)
"""How an engine words its refusal of --ulimit: "error setting rlimit type 8: operation not permitted"."""


def _server_options(config: UpConfig, service: str, args: list[str], credentials: list[Mount],
                    token: str) -> dict[str, Any]:
    """The docker SDK options of one server container, but its name and ulimits."""
    options: dict[str, Any] = {
        "command": list(args), "mounts": list(credentials), "pid_mode": SERVER_PID_MODE,
        "labels": {LABEL_ROLE: "server", LABEL_UP: token, "rpycdl.service": service},
        "volumes": {config.lock_dir: {"bind": config.lock_dir, "mode": "rw"}}, "shm_size": config.shm_size}
    if config.gpus == "all":
        options["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    else:
        options["command"] += ["--gpus", config.gpus]
    if config.insecure:
        options["command"].append("--insecure")
    if service == "deeplearning":  # runs jobs in their own containers, through the host's engine
        socket_path = engine_socket()
        options["mounts"].append(Mount(DOCKER_SOCKET, socket_path, type="bind"))
        if os.path.exists(socket_path):
            options["group_add"] = [str(os.stat(socket_path).st_gid)]
    if config.user:
        options["user"] = config.user
    return options


def _start(client: docker.DockerClient, name: str, image: str, say: Callable[[str], None],
           **options: Any) -> Container | None:
    """Create and start the container `name`; None if one of that name runs already (left as it is).
    A stale one of that name (created, exited) is replaced; one whose start fails is removed."""
    with contextlib.suppress(docker.errors.NotFound):
        existing = client.containers.get(name)
        if existing.status == "running":
            say(f"{name} runs already ({existing.short_id}): left as it is (to change its options, remove it "
                f"first: docker rm -f {name})")
            return None
        say(f"replacing the stale {name} ({existing.status})")
        _remove(existing)
    try:
        container = client.containers.create(image, name=name, detach=True, **options)
    except docker.errors.ImageNotFound:
        raise RpycdlError(f"no image {image} on this engine: build it first (scripts/build_images.sh)") from None
    try:
        container.start()
    except BaseException:
        _remove(container)  # never leave a Created container behind: a retry would meet its name
        raise
    return container


def _engine_words(exc: docker.errors.APIError) -> str:
    """The telling part of an engine's refusal of the ulimits, such as 'error setting rlimit type 8: operation
    not permitted': the last part that names rlimit or ulimit, and the next."""
    parts = str(exc.explanation or exc).splitlines()[0].split(": ")
    last = max((i for i, part in enumerate(parts) if _ULIMITS_REFUSED.search(part)), default=0)
    return ": ".join(parts[last:last + 2]).strip().rstrip(".")


def _credentials(config: UpConfig) -> tuple[list[Mount], list[str]]:
    """The read-only mounts and `rpycdl serve` options that give the servers their credentials."""
    files = {"secret-file": config.secret_file, "tls-cert": config.tls_cert, "tls-key": config.tls_key,
             "tls-ca": config.tls_ca}
    tls = [files[name] for name in ("tls-cert", "tls-key", "tls-ca")]
    if any(tls) and not all(tls):
        raise InvalidRequestError("TLS needs all three of --tls-cert, --tls-key and --tls-ca")
    from rpycdl.server import is_loopback  # the server's own rule

    if not any(files.values()) and not config.insecure and not is_loopback(config.host):
        raise InvalidRequestError(f"servers on {config.host} need authentication: give --tls-cert, --tls-key and "
                                  "--tls-ca, or --secret-file, or --insecure if the network is trusted")
    mounts, args = [], []
    for name, path in files.items():
        if path is None:
            continue
        if not os.path.isabs(path) or not os.path.isfile(path):
            raise InvalidRequestError(f"--{name} {path}: not an absolute path to a file")
        target = f"{CREDENTIALS_DIR}/{name}"
        mounts.append(Mount(target, path, type="bind", read_only=True))
        args += [f"--{name}", target]
    return mounts, args


def _server_name(prefix: str, service: str, version: str | None) -> str:
    return f"{prefix}-{service}" + (f"-{version}" if version else "")


def down(client: docker.DockerClient | None = None, timeout: int = STOP_TIMEOUT) -> list[str]:
    """Stop and remove every rpycdl container of this engine: servers, registry, then jobs."""
    client = client or docker_client()
    removed = []
    for role in ("server", "registry", "job"):
        for container in _listed(client, f"{LABEL_ROLE}={role}"):
            if role != "job":
                with contextlib.suppress(docker.errors.NotFound):
                    container.stop(timeout=timeout)
            _remove(container)
            removed.append(container.attrs["Names"][0].lstrip("/"))
    return removed


def _listed(client: docker.DockerClient, *labels: str) -> list[Container]:
    """Containers with all these labels, from the list alone (one may vanish before an inspect)."""
    return client.containers.list(all=True, sparse=True, filters={"label": list(labels)})


# -- job containers of the generic server -------------------------------------------------


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


def check_job(image: Any, command: Any, env: Any = None, workdir: Any = None, mounts: Any = None,
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
        if not posixpath.isabs(target) or posixpath.normpath(target) == "/":
            raise InvalidRequestError(f"mount target must be an absolute path other than /, not {target!r}")
        checked.append(Mount(posixpath.normpath(target), real, type="bind", read_only=read_only))
    return JobSpec(image, tuple(command), env, workdir, tuple(checked))


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

    Raises:
        ContainerError: a non-zero exit, with the last log lines.
        JobTimeoutError / JobCancelledError: the container was stopped for that reason.
    """
    client = client or docker_client()
    env = {**spec.env, **(extra_env or {}), **gpu_environment(uuids)}
    remove_orphans(lock_dir, client)  # before taking GPUs an orphan may still be using
    requests = [] if simulated else [DeviceRequest(device_ids=list(uuids), capabilities=[["gpu"]])]
    try:
        container = client.containers.create(
            spec.image, list(spec.command), environment=env, working_dir=spec.workdir, mounts=list(spec.mounts),
            device_requests=requests, security_opt=["no-new-privileges"], init=True,
            labels={LABEL_ROLE: "job", LABEL_OWNER: owner, LABEL_JOB: job_id, LABEL_LOCK_DIR: lock_dir})
    except docker.errors.ImageNotFound:
        raise InvalidRequestError(f"no image {spec.image} on this server's Docker engine") from None
    except docker.errors.APIError as exc:
        raise RpycdlError(f"cannot create a container of {spec.image}: {exc.explanation or exc}") from None
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    watcher = subprocess.Popen([sys.executable, "-m", "rpycdl.containers", str(os.getpid()), container.id],
                               start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        chunks: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        stream = client.api.attach(container.id, stdout=True, stderr=True, stream=True, logs=True, demux=True)
        threading.Thread(target=_pump, args=(stream, chunks), daemon=True).start()
        container.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        sinks = {1: on_stdout, 2: on_stderr}
        decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in sinks}
        partial = ""
        next_sweep = time.monotonic() + ORPHAN_SWEEP_INTERVAL
        while True:
            try:
                item = chunks.get(timeout=0.1)
            except queue.Empty:
                item = (0, b"")
            if item is None:
                break
            if item[1]:
                text = decoders[item[0]].decode(item[1])
                sinks[item[0]](text)
                lines = (partial + text).split("\n")
                partial = lines.pop()
                tail.extend(lines)
            if poll is not None:
                poll()
            if time.monotonic() >= next_sweep:
                remove_orphans(lock_dir, client)
                next_sweep = time.monotonic() + ORPHAN_SWEEP_INTERVAL
            if cancelled is not None and cancelled():
                raise JobCancelledError(f"container {container.short_id} was cancelled and removed")
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeoutError(f"container {container.short_id} ran past its timeout of {timeout:g} s "
                                      "and was removed")
        code = int(container.wait()["StatusCode"])
        if partial:
            tail.append(partial)
    finally:
        _remove(container)
        watcher.kill()
        watcher.wait()
    if code != 0:
        log = "\n".join(tail)
        raise ContainerError(f"container of {spec.image} {list(spec.command)} exited with code {code}; "
                             f"last {len(tail)} log line(s):\n{log}", code, log)
    return code


def _pump(stream: Iterable[tuple[bytes | None, bytes | None]], chunks: queue.Queue[tuple[int, bytes] | None]) -> None:
    """Move a container's demultiplexed output into `chunks`; None when it ends."""
    try:
        for out, err in stream:
            if out:
                chunks.put((1, out))
            if err:
                chunks.put((2, err))
    except (docker.errors.DockerException, OSError, ValueError):  # removed under us
        pass
    finally:
        chunks.put(None)


def _remove(container: Container) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        container.remove(force=True)


def remove_orphans(lock_dir: str, client: docker.DockerClient | None = None) -> list[str]:
    """Remove the job containers of `lock_dir` whose job holds no GPU lock any more.

    A job container is created after its GPUs are locked and removed before they are
    released, so one whose job holds no lock (or only the record of a grant whose holder died,
    which stays while the container runs) lost the process that ran it."""
    client = client or docker_client()
    containers = _listed(client, f"{LABEL_ROLE}=job", f"{LABEL_LOCK_DIR}={lock_dir}")
    if not containers:
        return []
    holding = {info.get("job_id") for holders in GPULockManager(lock_dir).snapshot()["held"].values()
               for info in holders if not info.get("leftover")}
    removed = []
    for container in containers:
        if container.attrs["Labels"].get(LABEL_JOB) not in holding:
            _remove(container)
            removed.append(container.attrs["Names"][0].lstrip("/"))
    return removed



def watch(connection_pid: int, container_id: str) -> None:
    """Remove the job container `container_id` once the process `connection_pid` has died.

    The connection process kills this watcher when it removes the container itself."""
    with contextlib.suppress(ProcessLookupError):
        pidfd = os.pidfd_open(connection_pid)
        select.select([pidfd], [], [])
    client = docker_client()
    with contextlib.suppress(docker.errors.NotFound):
        _remove(client.containers.get(container_id))


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
