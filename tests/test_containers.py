"""Framework containers against a real Docker engine: images, versions, shared locks, job containers.

The images come from .ci/docker.sh (a debootstrapped base without any framework, so the
versions are announced from the build argument). Without an engine or the images these
tests skip, except in CI (CI set), where they fail.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

import rpycdl
from rpycdl import registry
from rpycdl.containers import ContainerError

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parent.parent
BASE = "rpycdl-base:bookworm"
SERVICE_IMAGES = ["rpycdl-pytorch:2.4", "rpycdl-pytorch:2.5", "rpycdl-tensorflow:latest", "rpycdl-jax:latest",
                  "rpycdl-deeplearning:latest"]
READY = 30.0


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the container tests (see .ci/docker.sh)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A docker SDK client; the images must exist."""
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no usable engine
        _unavailable(f"no Docker engine ({exc})")
    missing = [image for image in [BASE, *SERVICE_IMAGES] if not client.images.list(name=image)]
    if missing:
        _unavailable(f"images missing: {', '.join(missing)} (run .ci/docker.sh)")
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
    """up(*specs): `rpycdl.containers.up` with a registry container on a free port, fake:4, the
    shared lock directory; waits until every server registered; returns the registry address."""
    from rpycdl.containers import UpConfig, up

    started: list[Any] = []

    def start(*specs: str, **options: Any) -> str:
        address = f"127.0.0.1:{_free_udp_port()}"
        config = UpConfig(specs=list(specs), registry=address, port=0, gpus="fake:4", lock_dir=shared_locks,
                          shm_size="256m", ulimits=[], **options)  # this sandbox may not raise memlock
        started.extend(up(config, engine))
        for spec in specs:
            alias = spec.replace(":", "-").upper()
            _wait(lambda alias=alias: registry.discover(alias, address), f"{alias} to register")
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
    from rpycdl.containers import down

    containers_up("jax")
    removed = down(engine, timeout=5)
    assert "rpycdl-registry" in removed and "rpycdl-jax" in removed
    assert not engine.containers.list(all=True, filters={"label": "rpycdl.role"})


def test_server_containers_require_the_credentials_they_are_given(containers_up: Callable[..., str], team: Any,
                                                                  tmp_path: Path) -> None:
    from rpycdl.containers import UpConfig, up

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
    assert any("rpycdl registry" in line or "registry --host" in line for line in lines)
    server = next(line for line in lines if "rpycdl-pytorch:2.5" in line and "--name rpycdl-pytorch-2.5" in line)
    for option in ("--network host", "-v /tmp/x-locks:/tmp/x-locks", "--shm-size", "--ulimit memlock=-1",
                   "--gpus fake:4", "--lock-dir /tmp/x-locks"):
        assert option in server, option
    assert "--gpus all" not in out  # simulated: no GPU access asked of the engine
    generic = next(line for line in lines if "rpycdl-deeplearning:latest" in line)
    assert "/var/run/docker.sock" in generic


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
    for kwargs, message in (({"command": "echo hi"}, "list of strings"),
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
    job = next(j for j in generic.root.jobs() if j["state"] == "running")
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
    job = next(j for j in generic.root.jobs() if j["state"] == "running")
    os.kill(job["owner_pid"], signal.SIGKILL)  # the connection process running it dies
    _wait(lambda: not _job_containers(engine), "the container to be removed", timeout=5)
    assert generic.root.run_container(BASE, ["true"], ngpus=2) == 0  # and its GPU is free again


def test_orphans_of_a_killed_server_are_removed_when_a_server_starts_again(
        engine: Any, cluster: Any, connect: Callable[[int], rpycdl.Connection]) -> None:
    process, port = cluster.add_server("deeplearning", "fake:2")
    threading.Thread(target=lambda: _ignore(lambda: connect(port).root.run_container(BASE, ["sleep", "60"])),
                     daemon=True).start()
    _wait(lambda: [c for c in _job_containers(engine) if c.status == "running"], "the job container")
    job = next(j for j in connect(port).root.jobs() if j["state"] == "running")
    process.popen.kill()  # the whole server dies: its parent, the job's watcher, the connection process
    watchers = subprocess.run(["pgrep", "-f", "rpycdl.containers"], capture_output=True, text=True).stdout.split()
    for pid in watchers:
        os.kill(int(pid), signal.SIGKILL)
    os.kill(job["owner_pid"], signal.SIGKILL)
    time.sleep(1)
    assert _job_containers(engine), "nobody was left to remove the container"
    cluster.add_server("deeplearning", "fake:2")
    _wait(lambda: not _job_containers(engine), "the orphaned container to be removed", timeout=10)


def _ignore(call: Callable[[], Any]) -> None:
    try:
        call()
    except BaseException:  # noqa: BLE001 - the connection is killed on purpose
        pass
