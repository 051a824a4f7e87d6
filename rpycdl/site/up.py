"""The site's service containers: `rpycdl up` starts the registry, one server container per
framework service and the host's monitor (scripts/start_servers.sh is its shell twin), `rpycdl down`
removes them all."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import DeviceRequest, Mount, Ulimit

from rpycdl.defaults import LOCK_DIR, MONITOR_PORT, REGISTRY_PORT, SERVER_PORT
from rpycdl.errors import InvalidRequestError, RpycdlError
from rpycdl.registry import parse_address
from rpycdl.security.auth import is_loopback
from rpycdl.site.docker import LABEL_ROLE, LABEL_UP, docker_client, listed, remove

DOCKER_SOCKET = "/var/run/docker.sock"
STOP_TIMEOUT = 10

_SPEC = re.compile(r"([a-z][a-z0-9_-]*)(?::([A-Za-z0-9._-]+))?")



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
        inventory: "all" for every GPU of the host through the NVIDIA runtime, or fake:N (--gpus).
        lock_dir: host directory shared by every server, mounted at the same path.
        user: UID[:GID] the servers run as; None keeps the image's non-root user.
        secret_file, tls_cert, tls_key, tls_ca: host files the servers authenticate with
            (`rpycdl serve --secret-file`, `--tls-*`), mounted read-only under CREDENTIALS_DIR;
            they must be readable by the servers' user (uid 1000 unless `user`).
        shm_size: shared memory for data loaders.
        image_prefix: images are IMAGE_PREFIX-SERVICE:TAG.
        monitor_port: host port of the monitor container (`rpycdl monitor`, from the first server's
            image), published on 127.0.0.1, or on `host` when `insecure` makes that non-loopback;
            0 starts none.
        scheduling: `rpycdl serve` options of the host's scheduling (`--policy fair`), and fair_share a host
            file of fair-share settings (`--fair-share`, mounted read-only under CREDENTIALS_DIR).
        user_map: a host file mapping identities to accounts (`rpycdl serve --user-map`, mounted read-only under
            CREDENTIALS_DIR), for servers run as root (`user` "0") that run each job as its owner's account.
    """

    specs: list[str]
    registry: str = f"127.0.0.1:{REGISTRY_PORT}"
    start_registry: bool = True
    host: str = "127.0.0.1"
    insecure: bool = False
    port: int = SERVER_PORT
    inventory: str = "all"
    lock_dir: str = LOCK_DIR
    user: str | None = None
    secret_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    shm_size: str = "8g"
    image_prefix: str = "rpycdl"
    monitor_port: int = MONITOR_PORT
    scheduling: list[str] = field(default_factory=list)
    fair_share: str | None = None
    user_map: str | None = None
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


MONITOR_UID = 65534
"""The account a monitor container runs as beside root servers (nobody), with the lock directory's group."""


def runs_as_root(user: str | None) -> bool:
    """Whether containers given `user` (UID[:GID], None: the image's) run as root."""
    return user is not None and user.partition(":")[0] in ("0", "root")


def prepare_lock_dir(path: str, private: bool = False) -> None:
    """Create the shared lock directory, writable by every container user (mode 1777); one that
    exists without being writable by all is made so if it is ours, else refused with the fix. With
    `private` (servers running as root), one made here is root's (mode 2751) and one that exists is left as it
    is: root servers keep their directories root's alone, and refuse one another account could change."""
    if not os.path.isabs(path):
        raise InvalidRequestError(f"the lock directory must be an absolute path, not {path!r}")
    if private:
        if not os.path.isdir(path):
            os.makedirs(path)
            os.chmod(path, 0o2751)
        return
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
    """Start the registry (if asked) and one server container per spec, on the host network, then the
    host's monitor (unless config.monitor_port is 0): see _monitor_options.

    Starting twice is harmless: a running container of the same name is left as it is (and said), a
    stale one (created, exited) replaced. If the engine refuses the ulimits (rootless and sandboxed
    engines may not raise memlock), the servers run with the engine's own, and `say` says so. If a
    container cannot start, every one this call created is removed again (a retry meets no name
    conflict). Servers share the host's process namespace (pid_mode host): see SERVER_PID_MODE.

    Args:
        config: what to start.
        client: the engine (default: docker_client()).
        say: where notes go, one line each (default: warnings of the rpycdl.site logger).

    Returns:
        The containers this call started (not those left running).

    Raises:
        InvalidRequestError: a bad spec, option or credential file.
        RpycdlError: an image is missing, or the engine refused to start a container (its own words).
    """
    client = client or docker_client()
    say = say or logging.getLogger("rpycdl.site").warning
    servers = _servers(config)
    reg_host, reg_port = parse_address(config.registry)
    credentials, credential_args = _credentials(config)
    prepare_lock_dir(config.lock_dir, private=runs_as_root(config.user))
    common: dict[str, Any] = {"network_mode": "host", "restart_policy": {"Name": "unless-stopped"}}
    token, ulimits = uuid.uuid4().hex[:12], list(config.ulimits)
    started: list[Container | None] = []
    first_image = f"{config.image_prefix}-{servers[0][0]}:{servers[0][1] or 'latest'}"  # every image has rpycdl[all]
    if config.monitor_port and not config.insecure and not is_loopback(config.host):
        say(f"the monitor listens on 127.0.0.1 only: it has no authentication, and its metrics name users and jobs "
            f"(--insecure publishes it on {config.host} too)")
    try:
        if config.start_registry:
            started.append(_start(client, f"{config.image_prefix}-registry", first_image, say,
                                  command=["registry", "--host", reg_host, "--port", str(reg_port)],
                                  entrypoint=["rpycdl"], labels={LABEL_ROLE: "registry", LABEL_UP: token}, **common))
        for offset, (service, version) in enumerate(servers):
            port = config.port + offset if config.port else 0  # 0: each server takes any free port
            args = ["--host", config.host, "--port", str(port), "--registry", f"{reg_host}:{reg_port}",
                    "--lock-dir", config.lock_dir, *credential_args]
            options = {**_server_options(config, service, args, credentials, token), **common}
            name = _server_name(config.image_prefix, service, version)
            container, ulimits = _start_server(client, name, f"{config.image_prefix}-{service}:{version or 'latest'}",
                                               say, ulimits=ulimits, options=options)
            started.append(container)
        if config.monitor_port:
            started.append(_start_monitor(client, f"{config.image_prefix}-monitor", first_image, say,
                                          _monitor_options(config, token)))
    except BaseException as exc:  # remove what this call created, started or not
        for container in listed(client, f"{LABEL_UP}={token}"):
            remove(container)
        if isinstance(exc, docker.errors.APIError):
            raise RpycdlError(f"cannot start the containers: {exc.explanation or exc}") from None
        raise
    return [container for container in started if container is not None]


def _servers(config: UpConfig) -> list[tuple[str, str | None]]:
    """The (service, version) of each server `config` asks for, once its options are checked.

    Raises:
        InvalidRequestError: no server, a bad spec, --gpus or --monitor-port.
    """
    servers = [parse_spec(spec) for spec in config.specs]
    if not servers:
        raise InvalidRequestError("name at least one server: SERVICE[:VERSION]")
    if config.inventory != "all" and not config.inventory.startswith("fake:"):
        raise InvalidRequestError(f"--gpus must be 'all' or fake:N, not {config.inventory!r}")
    if not 0 <= config.monitor_port <= 65535:
        raise InvalidRequestError(f"--monitor-port must be a TCP port, or 0 for no monitor, not {config.monitor_port}")
    return servers


def _start_server(client: docker.DockerClient, name: str, image: str, say: Callable[[str], None], *,
                  ulimits: list[Ulimit], options: dict[str, Any]) -> tuple[Container | None, list[Ulimit]]:
    """Start one server container with `ulimits`; if the engine refuses them, without, saying so.
    Returns it (None if it ran already) and the ulimits the next server should ask for."""
    try:
        return _start(client, name, image, say, ulimits=ulimits, **options), ulimits
    except docker.errors.APIError as exc:
        if not ulimits or not _ULIMITS_REFUSED.search(str(exc.explanation or exc)):
            raise
        say(f"the engine refused the ulimits memlock=-1, stack=64 MiB ({_engine_words(exc)}): the servers run "
            "with the engine's own instead (--no-ulimits skips asking)")
    return _start(client, name, image, say, ulimits=[], **options), []


MONITOR_HEALTH_INTERVAL = 10.0
"""Seconds between the engine's health checks of the monitor container (`docker ps` shows healthy or unhealthy)."""


def monitor_health_command(port: int) -> str:
    """The monitor container's health check: Python's own HTTP client fetching /healthz (images need not
    have curl; every rpycdl image has python3). Any failure, a status that is not 2xx included, exits 1."""
    return f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/healthz', timeout=5)"


def monitor_host(config: UpConfig) -> str:
    """The host address the monitor is published on: 127.0.0.1, unless --insecure makes --host non-loopback
    (the monitor has no authentication, and its metrics name users and jobs)."""
    return config.host if config.insecure and not is_loopback(config.host) else "127.0.0.1"


def _monitor_options(config: UpConfig, token: str) -> dict[str, Any]:
    """The docker SDK options of the monitor container, but its name.

    `rpycdl monitor` listens on every address of the container's own network and the engine publishes
    its port on monitor_host(config) only. It mounts the lock directory at the same path and shares the
    host's pids (the lock directory's holder records carry them, and NVML reports them). On real GPUs
    it gets NVML only: a device request for every GPU with the `utility` driver capability alone, and
    NVIDIA_DRIVER_CAPABILITIES=utility, so no CUDA library is even mounted: it never holds a context.
    """
    port = config.monitor_port
    options: dict[str, Any] = {
        "entrypoint": ["rpycdl"],
        "command": ["monitor", "--host", "0.0.0.0", "--insecure", "--port", str(port), "--lock-dir", config.lock_dir,
                    "--gpus", "nvml" if config.inventory == "all" else config.inventory],
        "labels": {LABEL_ROLE: "monitor", LABEL_UP: token}, "pid_mode": SERVER_PID_MODE,
        "volumes": {config.lock_dir: {"bind": config.lock_dir, "mode": "rw"}},
        "ports": {f"{port}/tcp": (monitor_host(config), port)},
        "restart_policy": {"Name": "unless-stopped"},
        "healthcheck": {"test": ["CMD", "python3", "-c", monitor_health_command(port)],
                        "interval": int(MONITOR_HEALTH_INTERVAL * 1e9), "timeout": int(5e9), "retries": 3,
                        "start_period": int(10e9)}}
    if config.inventory == "all":
        options["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu", "utility"]])]
        options["environment"] = {"NVIDIA_DRIVER_CAPABILITIES": "utility"}
    if runs_as_root(config.user):  # a reader of root servers' directories, through their group
        options["user"] = f"{MONITOR_UID}:{os.stat(config.lock_dir).st_gid}"
    elif config.user:
        options["user"] = config.user
    return options


def _start_monitor(client: docker.DockerClient, name: str, image: str, say: Callable[[str], None],
                   options: dict[str, Any]) -> Container | None:
    """Start the monitor container; an engine's refusal (its port taken, mostly) says what to do."""
    try:
        return _start(client, name, image, say, **options)
    except docker.errors.APIError as exc:
        raise RpycdlError(f"cannot start the monitor: {exc.explanation or exc} (--monitor-port picks another port, "
                          "0 starts none)") from None


def monitor_url(client: docker.DockerClient | None = None, prefix: str = "rpycdl") -> str | None:
    """http://ADDR:PORT/metrics of the monitor container that runs on this engine, as published; None if none runs."""
    client = client or docker_client()
    try:
        container = client.containers.get(f"{prefix}-monitor")
    except docker.errors.NotFound:
        return None
    if container.status != "running":
        return None
    for bindings in (container.attrs["HostConfig"].get("PortBindings") or {}).values():
        for binding in bindings or []:
            address = binding.get("HostIp") or "0.0.0.0"
            with contextlib.suppress(ValueError):
                if ipaddress.ip_address(address).version == 6:
                    address = f"[{address}]"
            return f"http://{address}:{binding['HostPort']}/metrics"
    return None


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
    if config.inventory == "all":
        options["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
    else:
        options["command"] += ["--gpus", config.inventory]
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
        remove(existing)
    try:
        container = client.containers.create(image, name=name, detach=True, **options)
    except docker.errors.ImageNotFound:
        raise RpycdlError(f"no image {image} on this engine: build it first (scripts/build_images.sh)") from None
    try:
        container.start()
    except BaseException:
        remove(container)  # never leave a Created container behind: a retry would meet its name
        raise
    return container


def _engine_words(exc: docker.errors.APIError) -> str:
    """The telling part of an engine's refusal of the ulimits, such as 'error setting rlimit type 8: operation
    not permitted': the last part that names rlimit or ulimit, and the next."""
    parts = str(exc.explanation or exc).splitlines()[0].split(": ")
    last = max((i for i, part in enumerate(parts) if _ULIMITS_REFUSED.search(part)), default=0)
    return ": ".join(parts[last:last + 2]).strip().rstrip(".")


def _credentials(config: UpConfig) -> tuple[list[Mount], list[str]]:
    """The read-only mounts and `rpycdl serve` options that give the servers their credentials (and the
    host's scheduling and user map, their files mounted as they are)."""
    files = {"secret-file": config.secret_file, "tls-cert": config.tls_cert, "tls-key": config.tls_key,
             "tls-ca": config.tls_ca}
    tls = [files[name] for name in ("tls-cert", "tls-key", "tls-ca")]
    if any(tls) and not all(tls):
        raise InvalidRequestError("TLS needs all three of --tls-cert, --tls-key and --tls-ca")
    if not any(files.values()) and not config.insecure and not is_loopback(config.host):
        raise InvalidRequestError(f"servers on {config.host} need authentication: give --tls-cert, --tls-key and "
                                  "--tls-ca, or --secret-file, or --insecure if the network is trusted")
    mounts, args = [], list(config.scheduling)
    for name, path in {**files, "fair-share": config.fair_share, "user-map": config.user_map}.items():
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
    """Stop and remove every rpycdl container of this engine: servers, the monitor, the registry, then jobs."""
    client = client or docker_client()
    removed = []
    for role in ("server", "monitor", "registry", "job"):
        for container in listed(client, f"{LABEL_ROLE}={role}"):
            if role != "job":
                with contextlib.suppress(docker.errors.NotFound):
                    container.stop(timeout=timeout)
            remove(container)
            removed.append(container.attrs["Names"][0].lstrip("/"))
    return removed


