"""Framework containers against a real Docker engine: images, versions, shared locks, starting and stopping
them and the host's monitor (rpycdl up/down, scripts/start_servers.sh), job containers.

The images come from .ci/docker.sh (a debootstrapped base without any framework, so the
versions are announced from the build argument). Without an engine or the images these
tests skip, except in CI (CI set), where they fail. The start script's dry runs need no engine.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest
from helpers import running, unavailable, wait_until

import rpycdl
from rpycdl import JobState, registry
from rpycdl.errors import ContainerError
from rpycdl.site.up import UpConfig, _monitor_options, down, monitor_url, up

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parent.parent
BASE = "rpycdl-base:bookworm"
SERVICE_IMAGES = ["rpycdl-pytorch:2.4", "rpycdl-pytorch:2.5", "rpycdl-tensorflow:latest", "rpycdl-jax:latest",
                  "rpycdl-deeplearning:latest"]
READY = 30.0


CI_NEEDS = "run the container tests (see .ci/docker.sh)"

@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A docker SDK client; the images must exist."""
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no usable engine
        unavailable(f"no Docker engine ({exc})", CI_NEEDS)
    missing = [image for image in [BASE, *SERVICE_IMAGES] if not client.images.list(name=image)]
    if missing:
        unavailable(f"images missing: {', '.join(missing)} (run .ci/docker.sh)", CI_NEEDS)
    yield client
    client.close()


@pytest.fixture
def shared_locks(tmp_path: Path) -> str:
    """A lock directory every container user can write (containers run as uid 1000)."""
    path = tmp_path / "shared-locks"
    path.mkdir()
    path.chmod(0o1777)
    return str(path)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _registered(alias: str, address: str) -> tuple[tuple[str, int], ...]:
    """The servers registered as `alias`; none while the registry (a container starting) does not answer yet."""
    try:
        return registry.discover(alias, address, timeout=0.5)
    except rpycdl.DiscoveryError:
        return ()


def _wait(condition: Callable[[], Any], what: str, timeout: float = READY) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def containers_up(engine: Any, shared_locks: str) -> Iterator[Callable[..., str]]:
    """up(*specs): `rpycdl.site.up.up` with a registry container on a free port, fake:4, the
    shared lock directory, no monitor unless monitor_port=; waits until every server registered; returns
    the registry address."""
    started: list[Any] = []

    def start(*specs: str, **options: Any) -> str:
        address = f"127.0.0.1:{_free_udp_port()}"
        options.setdefault("monitor_port", 0)
        config = UpConfig(specs=list(specs), registry=address, port=0, inventory="fake:4", lock_dir=shared_locks,
                          shm_size="256m", ulimits=[], **options)  # no refused start: the fallback has its test
        started.extend(up(config, engine))
        for spec in specs:
            alias = spec.replace(":", "-").upper()
            _wait(lambda alias=alias: _registered(alias, address), f"{alias} to register")
        return address

    yield start
    for container in started:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)


def test_images_run_the_server_as_a_non_root_user(engine: Any) -> None:
    for name in SERVICE_IMAGES:
        config = engine.images.get(name).attrs["Config"]
        assert config["User"] not in ("", "0", "root"), name
        assert "exec rpycdl serve" in " ".join(config["Entrypoint"]), name
        assert config["Labels"]["rpycdl.service"] == name.split(":")[0].removeprefix("rpycdl-")
    assert engine.images.get("rpycdl-pytorch:2.5").attrs["Config"]["Labels"]["rpycdl.framework-version"] == "2.5"


def test_two_versions_register_and_connect_reaches_the_right_one(containers_up: Callable[..., str]) -> None:
    address = containers_up("pytorch:2.4", "pytorch:2.5")
    assert len(registry.discover("PYTORCH", address)) == 2

    def where(_: Any) -> tuple[str, str]:
        import os
        import sys

        return sys.version.split()[0], os.environ["RPYCDL_GPU_UUIDS"]

    for version in ("2.4", "2.5"):
        with rpycdl.connect(f"pytorch-{version}", registry_address=address) as conn:
            info = json.loads(conn.root.server_info())
            assert info["framework_version"] == version
            assert f"PYTORCH-{version}" in info["aliases"]
            python, uuids = conn.root.run_code(where, None, ngpus=1)
            assert python.startswith("3.11") and uuids.startswith("GPU-")


def test_servers_in_two_containers_never_double_book(containers_up: Callable[..., str]) -> None:
    address = containers_up("pytorch:2.4", "pytorch:2.5")
    servers = [registry.discover(f"PYTORCH-{v}", address)[0] for v in ("2.4", "2.5")]

    def job(_: Any) -> tuple[float, float, list[str]]:
        import os
        import time

        start = time.time()
        time.sleep(0.3)
        return start, time.time(), os.environ["RPYCDL_GPU_UUIDS"].split(",")

    results: list[tuple[float, float, list[str]]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with rpycdl.connect(host=servers[i % 2][0], port=servers[i % 2][1]) as conn:
                results.append(conn.root.run_code(job, None, ngpus=1 + i % 3 // 2))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(results) == 10
    for i, (start_a, end_a, gpus_a) in enumerate(results):
        for start_b, end_b, gpus_b in results[i + 1:]:
            if set(gpus_a) & set(gpus_b):
                assert end_a <= start_b or end_b <= start_a, f"GPUs {set(gpus_a) & set(gpus_b)} double-booked"


def test_down_removes_every_rpycdl_container(engine: Any, containers_up: Callable[..., str]) -> None:
    containers_up("jax")
    removed = down(engine, timeout=5)
    assert "rpycdl-registry" in removed and "rpycdl-jax" in removed
    assert not engine.containers.list(all=True, filters={"label": "rpycdl.role"})


def test_server_containers_require_the_credentials_they_are_given(containers_up: Callable[..., str], team: Any,
                                                                  tmp_path: Path) -> None:
    own = tmp_path / "credentials"  # copies the containers' user (uid 1000) may read, mode 600
    own.mkdir()
    files = {}
    for name, source in (("tls_cert", "server-localhost.crt"), ("tls_key", "server-localhost.key"),
                         ("tls_ca", "ca.crt")):
        copy = own / source
        copy.write_bytes((Path(team.dir) / source).read_bytes())
        copy.chmod(0o600)
        os.chown(copy, 1000, 1000)
        files[name] = str(copy)
    address = containers_up("pytorch:2.5", **files)
    with rpycdl.connect("pytorch-2.5", registry_address=address, **team.user("alice")) as conn:
        assert conn.identity["user"] == "alice" and conn.identity["verified"]
        assert conn.root.run_code(lambda x: x + 1, 1) == 2
    with pytest.raises(rpycdl.RpycdlError):  # no certificate: the server is skipped or refuses
        rpycdl.connect("pytorch-2.5", registry_address=address)

    with pytest.raises(rpycdl.InvalidRequestError, match="all three"):
        up(UpConfig(specs=["pytorch"], tls_cert=files["tls_cert"]))
    with pytest.raises(rpycdl.InvalidRequestError, match="need authentication"):
        up(UpConfig(specs=["pytorch"], host="0.0.0.0"))


def test_root_server_containers_with_a_user_map_run_each_job_as_its_owners_uid(
        containers_up: Callable[..., str], team: Any, tmp_path: Path) -> None:
    """`rpycdl up --user 0 --user-map FILE`: the servers run as root in their containers and each job as the
    "uid:gid" its owner's identity maps to (the image has no site accounts); the server says it isolates."""
    files = {name: str(Path(team.dir) / source) for name, source in (
        ("tls_cert", "server-localhost.crt"), ("tls_key", "server-localhost.key"), ("tls_ca", "ca.crt"))}
    user_map = tmp_path / "users.toml"
    user_map.write_text('[accounts]\nalice = "2001:2001"\nbob = "2002:2002"\n')
    address = containers_up("pytorch:2.5", user="0", user_map=str(user_map), **files)
    for user, uid in (("alice", 2001), ("bob", 2002)):
        with rpycdl.connect("pytorch-2.5", registry_address=address, **team.user(user)) as conn:
            ids = conn.root.run_code(lambda _: (__import__("os").getuid(), __import__("os").getgid()), None)
            assert ids == (uid, uid), f"{user}'s job ran as {ids}"
            assert conn.root.gpu_status()["server"]["isolation"] == "owner accounts"


def test_start_script_passes_credentials_read_only_and_checks_them(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    script = ["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--gpus", "fake:4"]
    out = subprocess.run([*script, "--host", "10.0.0.5", "--secret-file", str(secret), "pytorch"],
                         capture_output=True, text=True, check=True).stdout
    server = next(line for line in out.splitlines() if "--name rpycdl-pytorch " in line)
    assert f"-v {secret}:/run/rpycdl/secret-file:ro" in server
    assert "--secret-file /run/rpycdl/secret-file" in server and "--host 10.0.0.5" in server
    for extra, message in ((["--host", "10.0.0.5"], "need authentication"),
                           (["--tls-cert", str(secret)], "all three"),
                           (["--secret-file", "relative/secret"], "absolute path to a file")):
        refused = subprocess.run([*script, *extra, "pytorch"], capture_output=True, text=True)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr


def test_start_script_dry_run_prints_the_docker_commands() -> None:
    out = subprocess.run(["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--gpus", "fake:4",
                          "--lock-dir", "/tmp/x-locks", "pytorch:2.5", "deeplearning"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    registry_line = next(line for line in lines if "--name rpycdl-registry" in line)
    assert "registry --host" in registry_line and "--pid host" not in registry_line
    server = next(line for line in lines if "rpycdl-pytorch:2.5" in line and "--name rpycdl-pytorch-2.5" in line)
    for option in ("--network host", "-v /tmp/x-locks:/tmp/x-locks", "--shm-size", "--ulimit memlock=-1",
                   "--gpus fake:4", "--lock-dir /tmp/x-locks", "--pid host", "--pull never"):
        assert option in server, option
    assert "--gpus all" not in out  # simulated: no GPU access asked of the engine
    generic = next(line for line in lines if "rpycdl-deeplearning:latest" in line)
    assert ":/var/run/docker.sock" in generic and "--pid host" in generic
    monitor = next(line for line in lines if "--name rpycdl-monitor " in line)
    for option in ("--label rpycdl.role=monitor", "--pid host", "-v /tmp/x-locks:/tmp/x-locks", "--pull never",
                   "--restart unless-stopped", "-p 127.0.0.1:18870:18870", "--health-cmd python3",
                   "http://127.0.0.1:18870/healthz", "--entrypoint rpycdl rpycdl-pytorch:2.5 monitor --host 0.0.0.0 "
                   "--insecure --port 18870 --lock-dir /tmp/x-locks --gpus fake:4"):
        assert option in monitor, option
    for option in ("--network host", "--gpus all", "--ulimit", "NVIDIA"):  # its own network; no GPU access asked
        assert option not in monitor, option
    assert lines.index(monitor) > lines.index(generic) and lines[-1] == "monitor on http://127.0.0.1:18870/metrics"


def test_start_script_dry_run_passes_the_hosts_scheduling_and_mounts_its_fair_share_file_and_user_map(
        tmp_path: Path) -> None:
    settings, users = tmp_path / "fair-share.toml", tmp_path / "users.toml"
    settings.write_text('half_life = "12h"\n')
    users.write_text('[accounts]\nalice = "2001:2001"\n')
    out = subprocess.run(["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--gpus", "fake:4", "--policy",
                          "fair", "--placement", "spread", "--fair-share", str(settings), "--user", "0",
                          "--user-map", str(users), "pytorch"], capture_output=True, text=True, check=True).stdout
    server = next(line for line in out.splitlines() if "--name rpycdl-pytorch " in line)
    for option in (f"-v {settings}:/run/rpycdl/fair-share:ro", "--fair-share /run/rpycdl/fair-share",
                   f"-v {users}:/run/rpycdl/user-map:ro", "--user-map /run/rpycdl/user-map", "--user 0",
                   "--policy=fair", "--placement=spread"):
        assert option in server, option
    monitor = next(line for line in out.splitlines() if "--name rpycdl-monitor " in line)
    assert "--user 65534:" in monitor and "--user 0" not in monitor  # never root beside root servers
    refused = subprocess.run(["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--host", "10.0.0.5",
                              "--fair-share", str(settings), "pytorch"], capture_output=True, text=True)
    assert refused.returncode == 2 and "need authentication" in refused.stderr  # a fair-share file is no credential


def test_start_script_dry_run_of_the_monitor_on_gpus_another_port_or_none() -> None:
    """Real GPUs: the monitor gets NVML alone (the driver's utility capability), never counted as a CUDA user;
    --monitor-port moves it, 0 starts none; --insecure publishes it on --host."""
    def dry_run(*args: str) -> list[str]:
        return subprocess.run(["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--lock-dir",
                               "/tmp/x-locks", *args, "pytorch"], capture_output=True, text=True,
                              check=True).stdout.splitlines()

    lines = dry_run("--monitor-port", "19999")
    monitor = next(line for line in lines if "--name rpycdl-monitor " in line)
    for option in (r"--gpus all\,capabilities=utility", "-e NVIDIA_DRIVER_CAPABILITIES=utility",
                   "-p 127.0.0.1:19999:19999", "--port 19999 --lock-dir /tmp/x-locks --gpus nvml"):
        assert option in monitor, option
    assert lines[-1] == "monitor on http://127.0.0.1:19999/metrics"
    assert not [line for line in dry_run("--monitor-port", "0") if "monitor" in line]
    lines = dry_run("--host", "10.0.0.5", "--insecure", "--gpus", "fake:1")
    assert "-p 10.0.0.5:18870:18870" in next(line for line in lines if "--name rpycdl-monitor " in line)
    assert lines[-1] == "monitor on http://10.0.0.5:18870/metrics"
    refused = subprocess.run(["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--monitor-port", "70000",
                              "pytorch"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--monitor-port must be a TCP port" in refused.stderr


def test_the_monitor_containers_options(tmp_path: Path) -> None:
    """rpycdl up's monitor, as the engine is asked for it: NVML only on real GPUs, loopback unless --insecure."""
    gpus = _monitor_options(UpConfig(specs=["pytorch"], lock_dir="/srv/locks", user="1001"), "token")
    assert gpus["command"] == ["monitor", "--host", "0.0.0.0", "--insecure", "--port", "18870", "--lock-dir",
                               "/srv/locks", "--gpus", "nvml"]
    (request,) = gpus["device_requests"]
    assert request["Count"] == -1 and request["Capabilities"] == [["gpu", "utility"]]
    assert gpus["environment"] == {"NVIDIA_DRIVER_CAPABILITIES": "utility"}  # NVML, no CUDA library mounted
    assert gpus["ports"] == {"18870/tcp": ("127.0.0.1", 18870)} and gpus["pid_mode"] == "host"
    assert gpus["volumes"] == {"/srv/locks": {"bind": "/srv/locks", "mode": "rw"}} and gpus["user"] == "1001"
    assert gpus["labels"]["rpycdl.role"] == "monitor" and "network_mode" not in gpus
    assert gpus["healthcheck"]["test"][:2] == ["CMD", "python3"] and "/healthz" in gpus["healthcheck"]["test"][-1]
    fake = _monitor_options(UpConfig(specs=["jax"], inventory="fake:2", monitor_port=19000), "token")
    assert fake["command"][-2:] == ["--gpus", "fake:2"] and "device_requests" not in fake and "environment" not in fake
    assert fake["ports"] == {"19000/tcp": ("127.0.0.1", 19000)}
    public = _monitor_options(UpConfig(specs=["jax"], host="10.0.0.5", insecure=True), "token")
    assert public["ports"] == {"18870/tcp": ("10.0.0.5", 18870)}
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    authenticated = UpConfig(specs=["jax"], host="10.0.0.5", secret_file=str(secret))
    assert _monitor_options(authenticated, "token")["ports"] == {"18870/tcp": ("127.0.0.1", 18870)}
    with pytest.raises(rpycdl.InvalidRequestError, match="--monitor-port"):
        up(UpConfig(specs=["jax"], monitor_port=70000), client=object())  # type: ignore[arg-type]


# -- the host's monitor beside the servers ----------------------------------------------------------


def _fetch(port: int, path: str) -> str | None:
    """The body of http://127.0.0.1:PORT/PATH; None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.read().decode()
    except (OSError, urllib.error.URLError):
        return None


def _samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_rpycdl_up_starts_the_hosts_monitor_which_shows_the_gpus_and_a_jobs_grant(cleaned: Any,
                                                                                   shared_locks: str) -> None:
    port = _free_tcp_port()
    address = f"127.0.0.1:{_free_udp_port()}"
    args = ["up", "--registry", address, "--port", "0", "--gpus", "fake:3", "--lock-dir", shared_locks,
            "--shm-size", "64m", "--no-ulimits", "--monitor-port", str(port), "jax"]
    started = _rpycdl(*args)
    assert started.returncode == 0, started.stderr
    assert started.stdout.splitlines()[-1] == f"monitor on http://127.0.0.1:{port}/metrics", started.stdout
    monitor = cleaned.containers.get("rpycdl-monitor")
    host = monitor.attrs["HostConfig"]
    assert monitor.labels["rpycdl.role"] == "monitor" and host["PidMode"] == "host"
    assert host["PortBindings"] == {f"{port}/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(port)}]}
    assert f"{shared_locks}:{shared_locks}:rw" in host["Binds"] and not host.get("DeviceRequests")
    assert monitor.attrs["Config"]["Image"] == "rpycdl-jax:latest"
    assert _wait(lambda: _fetch(port, "/healthz"), "the monitor to answer") == "ok\n"
    health = monitor.attrs["Config"]["Healthcheck"]["Test"]
    assert health[0] == "CMD" and monitor.exec_run(health[1:]).exit_code == 0  # the engine's check passes
    gpus = _samples(_fetch(port, "/metrics") or "", "rpycdl_gpu_info")
    assert len(gpus) == 3 and all('model="Simulated GPU"' in gpu for gpu in gpus), gpus

    _wait(lambda: _registered("JAX", address), "JAX to register")
    done = threading.Event()
    results: list[Any] = []

    def job() -> None:
        with rpycdl.connect("jax", registry_address=address) as conn:
            results.append(conn.root.run_code(lambda _: __import__("time").sleep(3) or 7, None, ngpus=2))
        done.set()

    thread = threading.Thread(target=job)
    thread.start()
    try:
        holders = _wait(lambda: _samples(_fetch(port, "/metrics") or "", "rpycdl_gpu_holder_info"), "the grant")
        assert len(holders) == 2 and all('kind="whole"' in holder for holder in holders), holders
        assert len({holder.split('job="')[1].split('"')[0] for holder in holders}) == 1  # one job, two GPUs
    finally:
        thread.join(30)
    assert results == [7]
    after = _wait(lambda: 'rpycdl_jobs{state="SUCCEEDED"} 1.0' in (text := _fetch(port, "/metrics") or "") and text,
                  "the job's end in the ledger")
    assert not _samples(after, "rpycdl_gpu_holder_info")

    again = _rpycdl(*args)  # starting again leaves the one monitor as it is
    assert again.returncode == 0 and "rpycdl-monitor runs already" in again.stderr, again.stderr
    assert [c.id for c in cleaned.containers.list(filters={"label": "rpycdl.role=monitor"})] == [monitor.id]
    removed = _rpycdl("down", "--timeout", "2")
    assert removed.returncode == 0 and "removed rpycdl-monitor" in removed.stdout, removed.stdout
    assert not cleaned.containers.list(all=True, filters={"label": "rpycdl.role"})
    assert _fetch(port, "/healthz") is None


def test_start_script_dry_run_prints_a_docker_hosts_commands_with_or_without_an_engine_here(tmp_path: Path) -> None:
    """The dry run prints what a Docker host would run, whether this machine has an engine or not; the
    deeplearning server gets the engine's socket ($DOCKER_HOST's when it is unix://), and the socket's group
    only where the socket exists."""
    absent = tmp_path / "absent.sock"
    present = tmp_path / "present.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(present))
        for path in (absent, present):
            out = subprocess.run(["bash", str(REPO / "scripts/start_servers.sh"), "--dry-run", "--no-registry",
                                  "--gpus", "fake:1", "deeplearning"], capture_output=True, text=True, check=True,
                                 env={**os.environ, "DOCKER_HOST": f"unix://{path}"}).stdout
            generic = next(line for line in out.splitlines() if "rpycdl-deeplearning:latest" in line)
            assert f"-v {path}:/var/run/docker.sock" in generic, generic
            assert ("--group-add" in generic) == (path == present), generic
            if path == present:
                assert f"--group-add {present.stat().st_gid} " in generic


# -- starting them again, on engines that refuse the ulimits ---------------------------------------

ENGINE_REFUSAL = ("failed to create shim task: OCI runtime create failed: runc create failed: unable to start "
                  "container process: error during container init: error setting rlimits for ready process: "
                  "error setting rlimit type 8: operation not permitted: unknown")
"""What runc says when the engine may not raise memlock (rootless and sandboxed engines)."""


class RefusingAPI(docker.APIClient):
    """An engine that refuses to start a container (created, not started, as a real refusal leaves it) when
    `refuse(its inspect data)` gives a reason, in that reason's words."""

    def __init__(self, refuse: Callable[[dict[str, Any]], str | None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refuse = refuse

    def start(self, container: Any, *args: Any, **kwargs: Any) -> Any:
        why = self.refuse(self.inspect_container(container))
        if why:
            raise docker.errors.APIError("500 Server Error: Internal Server Error", explanation=why)
        return super().start(container, *args, **kwargs)


class RefusingEngine(docker.DockerClient):
    """A docker SDK client of the real engine, through RefusingAPI."""

    def __init__(self, refuse: Callable[[dict[str, Any]], str | None]) -> None:
        self.api = RefusingAPI(refuse, **docker.utils.kwargs_from_env())


def _refuses_ulimits(attrs: dict[str, Any]) -> str | None:
    return ENGINE_REFUSAL if attrs["HostConfig"].get("Ulimits") else None


def _rpycdl_containers(engine: Any) -> dict[str, tuple[str, str]]:
    """{name: (id, status)} of every container rpycdl started on the engine."""
    return {c.name: (c.id, c.status) for c in engine.containers.list(all=True, filters={"label": "rpycdl.role"})}


@pytest.fixture
def cleaned(engine: Any) -> Iterator[Any]:
    """The engine; every rpycdl container is removed after the test."""
    yield engine
    down(engine, timeout=2)


def test_up_runs_the_servers_with_the_engines_ulimits_when_it_refuses_them(cleaned: Any, shared_locks: str) -> None:
    notes: list[str] = []
    address = f"127.0.0.1:{_free_udp_port()}"
    config = UpConfig(specs=["jax", "pytorch:2.5"], registry=address, port=0, inventory="fake:2", lock_dir=shared_locks,
                      shm_size="64m", monitor_port=_free_tcp_port())  # the default ulimits
    started = up(config, RefusingEngine(_refuses_ulimits), say=notes.append)
    assert [c.name for c in started] == ["rpycdl-registry", "rpycdl-jax", "rpycdl-pytorch-2.5", "rpycdl-monitor"]
    (note,) = notes  # said once, for every server
    assert "refused the ulimits" in note and "(error setting rlimit type 8: operation not permitted)" in note
    assert "--no-ulimits" in note
    assert set(_rpycdl_containers(cleaned)) == {c.name for c in started}  # no Created one left behind
    for container in started[1:]:
        container.reload()
        assert container.status == "running" and not container.attrs["HostConfig"]["Ulimits"]
        assert container.attrs["HostConfig"]["PidMode"] == "host"
    for alias in ("JAX", "PYTORCH-2.5"):
        _wait(lambda alias=alias: _registered(alias, address), f"{alias} to register")


def test_up_twice_leaves_the_same_containers_and_replaces_stale_ones(cleaned: Any, shared_locks: str) -> None:
    address = f"127.0.0.1:{_free_udp_port()}"
    config = UpConfig(specs=["jax"], registry=address, port=0, inventory="fake:2", lock_dir=shared_locks,
                      shm_size="64m", ulimits=[], monitor_port=_free_tcp_port())
    up(config, cleaned)
    before = _rpycdl_containers(cleaned)
    notes: list[str] = []
    assert up(config, cleaned, say=notes.append) == []
    assert _rpycdl_containers(cleaned) == before  # one monitor still
    assert [note.split(" (")[0] for note in notes] == ["rpycdl-registry runs already", "rpycdl-jax runs already",
                                                       "rpycdl-monitor runs already"]

    cleaned.containers.get("rpycdl-jax").stop(timeout=2)  # exited
    cleaned.containers.get("rpycdl-monitor").stop(timeout=2)
    cleaned.containers.create(BASE, ["true"], name="rpycdl-tensorflow", labels={"rpycdl.role": "server"})  # created
    started = up(UpConfig(**{**config.__dict__, "specs": ["jax", "tensorflow"]}), cleaned, say=notes.append)
    assert [c.name for c in started] == ["rpycdl-jax", "rpycdl-tensorflow", "rpycdl-monitor"]
    after = _rpycdl_containers(cleaned)
    assert after["rpycdl-registry"] == before["rpycdl-registry"] and after["rpycdl-jax"][0] != before["rpycdl-jax"][0]
    assert after["rpycdl-monitor"][0] != before["rpycdl-monitor"][0]
    assert all(status == "running" for _, status in after.values()), after

    # a server shares the host's pids: it sees the processes of every job of the host, this one too
    _wait(lambda: _registered("JAX", address), "JAX to register")
    with rpycdl.connect("jax", registry_address=address) as conn:
        assert conn.root.run_code(lambda pid: __import__("os").path.exists(f"/proc/{pid}"), os.getpid())


def test_up_starts_servers_with_the_hosts_scheduling_and_its_fair_share_file(cleaned: Any, shared_locks: str,
                                                                             tmp_path: Path) -> None:
    settings = tmp_path / "fair-share.toml"
    settings.write_text('half_life = "12h"\n[weights]\nalice = 2\n')
    settings.chmod(0o644)  # read by the servers' user
    address = f"127.0.0.1:{_free_udp_port()}"
    config = UpConfig(specs=["jax"], registry=address, port=0, inventory="fake:2", lock_dir=shared_locks,
                      shm_size="64m", ulimits=[], monitor_port=0, scheduling=["--policy=fair", "--placement=spread"],
                      fair_share=str(settings))
    up(config, cleaned)
    _wait(lambda: _registered("JAX", address), "JAX to register")
    with rpycdl.connect("jax", registry_address=address) as conn:
        scheduling = conn.root.gpu_status()["server"]["scheduling"]
    assert scheduling == {"policy": "fair", "placement": "spread", "half_life": 43200.0, "weights": {"alice": 2.0},
                          "preempt": "off", "preempt_grace": 30.0}


def test_up_removes_what_it_created_when_a_start_fails(cleaned: Any, shared_locks: str) -> None:
    config = UpConfig(specs=["jax", "pytorch:2.5"], registry=f"127.0.0.1:{_free_udp_port()}", port=0,
                      inventory="fake:2", lock_dir=shared_locks, shm_size="64m", ulimits=[],
                      monitor_port=_free_tcp_port())
    refusing = RefusingEngine(lambda attrs: "no room" if attrs["Name"] == "/rpycdl-pytorch-2.5" else None)
    with pytest.raises(rpycdl.RpycdlError, match="cannot start the containers: no room"):
        up(config, refusing)
    assert _rpycdl_containers(cleaned) == {}  # nothing started or created is left: a retry meets no name
    refusing = RefusingEngine(lambda attrs: "port is already allocated" if attrs["Name"] == "/rpycdl-monitor" else None)
    with pytest.raises(rpycdl.RpycdlError, match=r"monitor: port is already allocated \(--monitor-port picks"):
        up(config, refusing)
    assert _rpycdl_containers(cleaned) == {}  # the servers it started are gone again
    assert [c.name for c in up(config, cleaned)] == ["rpycdl-registry", "rpycdl-jax", "rpycdl-pytorch-2.5",
                                                     "rpycdl-monitor"]
    with pytest.raises(rpycdl.RpycdlError, match="no image rpycdl-nosuch:latest on this engine: build it"):
        up(UpConfig(**{**config.__dict__, "specs": ["nosuch"], "start_registry": False}), cleaned)


def test_rpycdl_up_twice_and_down(cleaned: Any, shared_locks: str) -> None:
    monitor = _free_tcp_port()
    args = ["up", "--registry", f"127.0.0.1:{_free_udp_port()}", "--port", "0", "--gpus", "fake:2",
            "--lock-dir", shared_locks, "--shm-size", "64m", "--monitor-port", str(monitor), "jax"]
    first = _rpycdl(*args)
    assert first.returncode == 0 and "started rpycdl-jax" in first.stdout, first.stderr
    assert "started rpycdl-monitor" in first.stdout
    assert first.stdout.endswith(f"monitor on http://127.0.0.1:{monitor}/metrics\n"), first.stdout
    assert all(line.startswith("rpycdl up: ") for line in first.stderr.splitlines()), first.stderr  # a fallback
    again = _rpycdl(*args)
    assert again.returncode == 0 and again.stdout == f"monitor on http://127.0.0.1:{monitor}/metrics\n", again.stdout
    assert "rpycdl up: rpycdl-jax runs already" in again.stderr
    assert "rpycdl up: rpycdl-monitor runs already" in again.stderr
    other = _rpycdl(*args[:-3], "--monitor-port", "0", "jax")  # a monitor left running is said with its own address
    assert other.returncode == 0 and other.stdout == f"monitor on http://127.0.0.1:{monitor}/metrics\n", other.stdout
    assert [c.name for c in cleaned.containers.list(filters={"label": "rpycdl.role=monitor"})] == ["rpycdl-monitor"]
    removed = _rpycdl("down", "--timeout", "2")
    assert removed.returncode == 0 and "removed rpycdl-jax" in removed.stdout
    assert "removed rpycdl-monitor" in removed.stdout
    assert _rpycdl_containers(cleaned) == {}
    assert monitor_url(cleaned) is None


def _rpycdl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpycdl", *args], capture_output=True, text=True, timeout=120)


REFUSING_DOCKER = """#!/bin/bash
# docker, but `docker run` of a container named $REFUSE_NAME, or with --ulimit, fails as an engine that
# refuses it does: the container is created, and not started.
name=""; ulimit=0; args=()
for arg in "${@:2}"; do
    [ "$prev" = --name ] && name=$arg
    [ "$arg" = --ulimit ] && ulimit=1
    [ "$arg" = --detach ] || args+=("$arg")
    prev=$arg
done
if [ "$1" = run ] && { [ "$ulimit" = 1 ] || [ "$name" = "${REFUSE_NAME:-}" ]; }; then
    REAL create "${args[@]}" >/dev/null || exit
    [ "$name" = "${REFUSE_NAME:-}" ] && why="no room" || why="ENGINE_REFUSAL"
    echo "docker: Error response from daemon: $why." >&2
    exit 125
fi
exec REAL "$@"
"""


def test_start_script_falls_back_starts_again_harmlessly_and_cleans_up(cleaned: Any, shared_locks: str,
                                                                       tmp_path: Path) -> None:
    real = shutil.which("docker")
    if real is None:
        unavailable("no docker command", CI_NEEDS)
    wrapper = tmp_path / "bin" / "docker"
    wrapper.parent.mkdir()
    wrapper.write_text(REFUSING_DOCKER.replace("REAL", real).replace("ENGINE_REFUSAL", ENGINE_REFUSAL))
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{wrapper.parent}:{os.environ['PATH']}"}
    monitor = _free_tcp_port()
    script = ["bash", str(REPO / "scripts/start_servers.sh"), "--registry", f"127.0.0.1:{_free_udp_port()}",
              "--port", str(_free_tcp_port()), "--gpus", "fake:2", "--lock-dir", shared_locks, "--shm-size", "64m",
              "--monitor-port", str(monitor)]

    def start(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*script, *args], capture_output=True, text=True, timeout=120, env={**env, **extra})

    first = start("--no-registry", "jax")
    assert first.returncode == 0, first.stderr
    (line,) = first.stderr.splitlines()
    assert "refused the ulimits" in line and "(error setting rlimit type 8: operation not permitted)" in line
    assert "--no-ulimits" in line
    jax = cleaned.containers.get("rpycdl-jax")
    assert jax.status == "running" and not jax.attrs["HostConfig"]["Ulimits"]
    assert jax.attrs["HostConfig"]["PidMode"] == "host"
    address = f"monitor on http://127.0.0.1:{monitor}/metrics"
    assert first.stdout.splitlines()[-1] == address, first.stdout
    watcher = cleaned.containers.get("rpycdl-monitor")
    assert watcher.status == "running" and watcher.attrs["HostConfig"]["PidMode"] == "host"
    _wait(lambda: _fetch(monitor, "/healthz") == "ok\n", "the monitor to answer")

    again = start("--no-registry", "jax")
    assert again.returncode == 0 and "rpycdl-jax runs already" in again.stderr, again.stderr
    assert "rpycdl-monitor runs already" in again.stderr and again.stdout.splitlines()[-1] == address, again.stdout
    assert cleaned.containers.get("rpycdl-jax").id == jax.id
    assert cleaned.containers.get("rpycdl-monitor").id == watcher.id

    jax.stop(timeout=2)
    watcher.stop(timeout=2)
    stale = start("--no-registry", "jax")
    assert stale.returncode == 0 and "replacing the stale rpycdl-jax (exited)" in stale.stderr, stale.stderr
    assert "replacing the stale rpycdl-monitor (exited)" in stale.stderr
    replaced = cleaned.containers.get("rpycdl-jax")
    assert replaced.id != jax.id and replaced.status == "running"
    assert cleaned.containers.get("rpycdl-monitor").id != watcher.id

    down(cleaned, timeout=2)
    failed = start("jax", REFUSE_NAME="rpycdl-jax")  # the registry starts, then the server cannot
    assert failed.returncode == 1 and "no room" in failed.stderr, failed.stderr
    assert "removing the containers this run started: rpycdl-registry" in failed.stderr
    assert _rpycdl_containers(cleaned) == {}  # nothing left: a retry meets no name
    failed = start("jax", REFUSE_NAME="rpycdl-monitor")  # the registry and the server start, then the monitor cannot
    assert failed.returncode == 1 and "no room" in failed.stderr and "cannot start the monitor" in failed.stderr
    assert "removing the containers this run started: rpycdl-registry rpycdl-jax" in failed.stderr
    assert _rpycdl_containers(cleaned) == {}
    assert start("jax").returncode == 0
    assert set(_rpycdl_containers(cleaned)) == {"rpycdl-registry", "rpycdl-jax", "rpycdl-monitor"}
    stopped = subprocess.run(["bash", str(REPO / "scripts/stop_servers.sh"), "--timeout", "2"], capture_output=True,
                             text=True, timeout=60)
    assert stopped.returncode == 0 and _rpycdl_containers(cleaned) == {}, stopped.stderr


# -- jobs in their own container (the generic server, here on the host) --------------------


class Recorder(io.StringIO):
    """A stdout for the server to write to, remembering when each piece came."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.times.append((time.monotonic(), text))
        return super().write(text)


@pytest.fixture
def generic(engine: Any, server: Callable[..., int], connect: Callable[[int], rpycdl.Connection], tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> rpycdl.Connection:
    """A connection to a DEEPLEARNING server on the host that may mount from tmp_path."""
    monkeypatch.setenv("RPYCDL_MOUNT_ROOTS", str(tmp_path))
    return connect(server("deeplearning", "fake:2"))


def _job_containers(engine: Any) -> list[Any]:
    return engine.containers.list(all=True, sparse=True, filters={"label": "rpycdl.role=job"})


def test_container_job_streams_its_output_and_returns_its_exit_code(generic: rpycdl.Connection, engine: Any,
                                                                    tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "input.txt").write_text("from the host")
    script = ("import os, time; print('first', flush=True); time.sleep(1.5); "
              "print(open('/data/input.txt').read(), os.environ['NVIDIA_VISIBLE_DEVICES'], os.environ['GREETING'], "
              "os.getcwd())")
    out = Recorder()
    code = generic.root.run_container(BASE, ["python3", "-c", script], ngpus=2, env={"GREETING": "hi"}, workdir="/tmp",
                                      mounts=[{"source": str(data), "target": "/data"}], stdout=out)
    ended = time.monotonic()
    assert code == 0
    text = out.getvalue()
    assert "first" in text and "from the host" in text and " hi /tmp" in text
    assert "GPU-00000000-0000-4000-8000-000000000000,GPU-00000000-0000-4000-8000-000000000001" in text
    first = next(when for when, piece in out.times if "first" in piece)
    assert ended - first > 1.0, "output arrived only at the end, not live"
    assert not _job_containers(engine)


def test_failing_container_job_raises_with_the_log_tail(generic: rpycdl.Connection, engine: Any) -> None:
    with pytest.raises(ContainerError, match=r"(?s)exited with code 3.*oops-2") as info:
        generic.root.run_container(BASE, ["sh", "-c", "echo oops-1; echo oops-2 >&2; exit 3"], ngpus=1,
                                   stderr=io.StringIO())
    assert info.value.exit_code == 3 and "oops-1" in info.value.log_tail
    assert not _job_containers(engine)


def test_container_job_requests_are_checked(generic: rpycdl.Connection, tmp_path: Path) -> None:
    shared = tmp_path / "shared"  # another user could swap shared/d for a link to anywhere before the engine mounts it
    (shared / "d").mkdir(parents=True)
    shared.chmod(0o777)
    swappable = [({"command": ["true"], "mounts": [{"source": str(shared / "d"), "target": "/x"}]},
                  "no other account can change")] if os.geteuid() == 0 else []
    for kwargs, message in (({"command": "echo hi"}, "list of strings"), *swappable,
                            ({"command": ["true"], "mounts": [{"source": "/etc", "target": "/x"}]}, "not under"),
                            ({"command": ["true"], "image": "Bad Image!"}, "not an image"),
                            ({"command": ["true"], "ngpus": 3}, "has 2")):
        call = {"image": BASE, **kwargs}
        with pytest.raises(rpycdl.InvalidRequestError, match=message):
            generic.root.run_container(call.pop("image"), call.pop("command"), **call)


def test_timeout_and_cancel_remove_the_container(generic: rpycdl.Connection, engine: Any,
                                                 connect: Callable[[int], rpycdl.Connection]) -> None:
    with pytest.raises(rpycdl.JobTimeoutError, match="timeout"):
        generic.root.run_container(BASE, ["sleep", "60"], ngpus=1, timeout=1)
    assert not _job_containers(engine)

    errors: list[BaseException] = []
    port = generic.address[1]

    def run() -> None:
        try:
            connect(port).root.run_container(BASE, ["sleep", "60"], ngpus=1)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    _wait(lambda: [c for c in _job_containers(engine) if c.status == "running"], "the job container")
    job = next(j for j in generic.root.jobs() if j["state"] == "RUNNING")
    generic.root.cancel(job["job_id"])
    thread.join(10)
    assert errors and isinstance(errors[0], rpycdl.JobCancelledError), errors
    assert not _job_containers(engine)


def test_a_client_going_away_removes_its_job_container(generic: rpycdl.Connection, engine: Any) -> None:
    client = subprocess.Popen([sys.executable, "-c", (
        "import sys, rpycdl; conn = rpycdl.connect(host='127.0.0.1', port=int(sys.argv[1])); "
        f"conn.root.run_container({BASE!r}, ['sleep', '60'], ngpus=1)"), str(generic.address[1])])
    try:
        _wait(lambda: [c for c in _job_containers(engine) if c.status == "running"], "the job container")
        client.kill()
        _wait(lambda: not _job_containers(engine), "the container to be removed", timeout=5)
        _wait(lambda: all(not gpu["holders"] for gpu in generic.root.gpu_status()["gpus"]),
              "its GPU to be released (within a second of the container, promise 3)", timeout=1)
    finally:
        client.kill()
        client.wait()


def test_a_job_container_is_removed_when_its_connection_process_dies(
        generic: rpycdl.Connection, engine: Any, connect: Callable[[int], rpycdl.Connection]) -> None:
    port = generic.address[1]
    threading.Thread(target=lambda: _ignore(lambda: connect(port).root.run_container(BASE, ["sleep", "60"])),
                     daemon=True).start()
    _wait(lambda: [c for c in _job_containers(engine) if c.status == "running"], "the job container")
    job = next(j for j in generic.root.jobs() if j["state"] == "RUNNING")
    os.kill(job["owner_pid"], signal.SIGKILL)  # the connection process running it dies
    _wait(lambda: not _job_containers(engine), "the container to be removed", timeout=5)
    assert generic.root.run_container(BASE, ["true"], ngpus=2) == 0  # and its GPU is free again


def test_orphans_of_a_killed_server_are_removed_when_a_server_starts_again(
        engine: Any, cluster: Any, connect: Callable[[int], rpycdl.Connection]) -> None:
    process, port = cluster.add_server("deeplearning", "fake:2")
    threading.Thread(target=lambda: _ignore(lambda: connect(port).root.run_container(BASE, ["sleep", "60"])),
                     daemon=True).start()
    _wait(lambda: [c for c in _job_containers(engine) if c.status == "running"], "the job container")
    job = next(j for j in connect(port).root.jobs() if j["state"] == "RUNNING")
    process.popen.kill()  # the whole server dies: its parent, the job's watcher, the connection process
    watchers = subprocess.run(["pgrep", "-f", "rpycdl.server.container_watcher"], capture_output=True,
                              text=True).stdout.split()
    for pid in watchers:
        os.kill(int(pid), signal.SIGKILL)
    os.kill(job["owner_pid"], signal.SIGKILL)
    time.sleep(1)
    assert _job_containers(engine), "nobody was left to remove the container"
    cluster.add_server("deeplearning", "fake:2")
    _wait(lambda: not _job_containers(engine), "the orphaned container to be removed", timeout=10)


# -- detached container jobs (submit_container): they outlive their client and their server ------------


def _job_container(engine: Any, job_id: str, status: str = "running") -> Any:
    """The job's container, if it is in `status` (None, to look again, if one went between the engine's
    listing and its inspection: the SDK's list is not atomic)."""
    import docker

    try:
        return next((c for c in engine.containers.list(all=True, filters={"label": f"rpycdl.job={job_id}"})
                     if c.status == status), None)
    except docker.errors.NotFound:
        return None


def test_rpycdl_submit_of_a_container_returns_at_once_and_wait_exits_with_its_code(generic: rpycdl.Connection,
                                                                                     engine: Any) -> None:
    where = ["--host", "127.0.0.1", "--port", str(generic.address[1])]
    submitted = _rpycdl("submit", "deeplearning", "--image", BASE, "-q", *where, "--",
                        "sh", "-c", "echo first; sleep 2; echo last; exit 3")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert len(job_id) == 12 and job_id.isalnum(), submitted.stdout
    assert not generic.root.job(job_id).status().finished  # back before the container could end
    waited = _rpycdl("wait", job_id, *where)
    assert waited.returncode == 3, waited.stderr
    assert f"job {job_id}: FAILED" in waited.stderr
    logs = _rpycdl("logs", job_id, *where)
    assert (logs.returncode, logs.stdout) == (0, "first\nlast\n"), logs.stderr
    row = generic.root.job(job_id).info
    assert (row["kind"], row["exit_code"]) == ("container", 3) and "exited with code 3" in row["error"]
    assert not _job_containers(engine)  # removed before the job's end was recorded


TICKER = "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.2; done"

CONTAINER_CLIENT = """
import sys
import rpycdl
conn = rpycdl.connect(host="127.0.0.1", port=int(sys.argv[1]))
job = conn.root.submit_container(sys.argv[2], ["sh", "-c", sys.argv[3]], name="survivor")
print(job.id, flush=True)
sys.stdin.read()  # until the test kills it
"""


def test_a_container_job_outlives_its_client_and_its_server_killed_and_is_cancelled_by_the_next(
        engine: Any, cluster: Any, connect: Callable[[int], rpycdl.Connection]) -> None:
    process, port = cluster.add_server("deeplearning", "fake:2")
    client = subprocess.Popen([sys.executable, "-c", CONTAINER_CLIENT, str(port), BASE, TICKER],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        job_id = client.stdout.readline().strip()  # type: ignore[union-attr]
        container = _wait(lambda: _job_container(engine, job_id), "the job container")
    finally:
        client.kill()
        client.wait()
    job = connect(port).root.job(job_id)
    supervisor = job.info["owner_pid"]
    process.popen.kill()  # the server parent, and with it its connection processes
    process.popen.wait()
    again = connect(cluster.add_server("deeplearning", "fake:2")[1])
    container.reload()
    assert container.status == "running", f"the container is {container.status} after its client and server died"
    assert running(supervisor), "the supervisor died with its client or its server"
    assert {row["job_id"]: row["state"] for row in again.root.jobs()}[job_id] == "RUNNING"
    assert _job_container(engine, job_id), "the restarted server removed a container whose job still runs"
    job = again.root.job(job_id)
    written = len(list(job.logs()))
    lines = job.logs(follow=True)  # from the first line, then live: two lines written after this call
    assert [next(lines) for _ in range(written + 2)] == [f"tick {n}\n" for n in range(written + 2)]
    assert job.cancel().state is JobState.CANCELLED, job.info
    rest = list(lines)  # the follow ends with the job, its lines in order
    assert rest == [f"tick {n}\n" for n in range(written + 2, written + 2 + len(rest))], rest
    assert not _job_containers(engine)  # removed before the job's end was recorded
    wait_until(lambda: all(not gpu["holders"] for gpu in again.root.gpu_status()["gpus"]), 1, "its GPU to be free")


def test_a_killed_supervisor_makes_a_container_job_lost_frees_its_gpus_and_removes_its_container(
        generic: rpycdl.Connection, engine: Any) -> None:
    job = generic.root.submit_container(BASE, ["sleep", "60"], ngpus=2)
    _wait(lambda: _job_container(engine, job.id), "the job container")
    supervisor = job.refresh()["owner_pid"]
    os.kill(supervisor, signal.SIGKILL)
    wait_until(lambda: all(not gpu["holders"] for gpu in generic.root.gpu_status()["gpus"]), 1,
               "the GPUs to be free within a second of the supervisor's death")
    status = wait_until(lambda: (s := job.status()).state is JobState.LOST and s, 2, "the job to be LOST")
    assert status.error.startswith(f"its supervisor (pid {supervisor}) died"), status.error
    # its watcher, which watches the supervisor, removes it at once: 0.12 to 0.21 s after the kill in 4 runs
    # here (Docker 20.10, overlay2); the GPUs were free after 0.03 to 0.11 s, the row LOST after 0.05 to 0.46 s
    wait_until(lambda: not _job_containers(engine), 3, "the container to be removed")
    with pytest.raises(rpycdl.JobLostError):
        job.result()


def _ignore(call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException:  # noqa: BLE001 - the connection is killed on purpose
        pass


def test_up_makes_an_existing_lock_directory_of_ours_writable_by_every_server(tmp_path: Path) -> None:
    # servers in containers run as uid 1000: a lock directory of mode 0700 would crash-loop them
    from rpycdl.site.up import prepare_lock_dir

    directory = tmp_path / "locks"
    directory.mkdir(mode=0o700)
    prepare_lock_dir(str(directory))
    assert directory.stat().st_mode & 0o7777 == 0o1777
    private = tmp_path / "private"  # root servers' (rpycdl up --user 0): root's, and never loosened
    prepare_lock_dir(str(private), private=True)
    assert private.stat().st_mode & 0o7777 == 0o2751
    private.chmod(0o750)
    prepare_lock_dir(str(private), private=True)
    assert private.stat().st_mode & 0o7777 == 0o750
