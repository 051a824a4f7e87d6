"""Fixtures: a real registry and real servers on loopback, in subprocesses."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import ACCOUNTS, MONITOR_ACCOUNT, Team, unavailable
from hypothesis import settings

import rpycdl
from rpycdl import cli
from rpycdl.scheduler import lockdir
from rpycdl.site.local import LocalCluster, start

settings.register_profile("ci", max_examples=100)  # hypothesis' own default: the full count
settings.register_profile("quick", max_examples=10)
settings.load_profile("ci" if os.environ.get("CI") else "quick")
"""Property tests run the full count of examples in CI (.ci/run sets CI) and a tenth of it elsewhere, so that
the unit tier stays quick to run while working. A test that wants another count than the profile's says it as
a multiple of `settings.default.max_examples`, so that it scales with the profile."""

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
"""Ctrl-C at its default in every process the tests start, as a shell starts a command: a test run started in
the background of a script (nohup, `&`) ignores SIGINT, its children inherit that, and a Python started ignoring
SIGINT never raises KeyboardInterrupt (the tests that press Ctrl-C in a client would then wait in vain)."""


@pytest.fixture(autouse=True)
def no_credentials_file(tmp_path, monkeypatch) -> None:
    """Tests never read the credentials file of whoever runs them, nor the working directories it sent."""
    monkeypatch.setenv("RPYCDL_CONFIG", str(tmp_path / "no-credentials.toml"))
    monkeypatch.setenv("RPYCDL_MANIFESTS", str(tmp_path / "manifests"))


@pytest.fixture(autouse=True)
def shared_modes_again() -> Iterator[None]:
    """Each test starts with this process's modes for the lock and state directories as it found them: one that
    builds a root server's context in the test process (ServerContext: lockdir.use_private_modes, a umask of 077)
    would leave every later test of the process making private directories that other accounts cannot enter."""
    modes, mask = dict(lockdir._MODES), os.umask(0o022)
    os.umask(mask)
    yield
    lockdir._MODES.update(modes)
    os.umask(mask)


@pytest.fixture(scope="session")
def team(tmp_path_factory) -> Team:
    """A team's CA made with `rpycdl certs`: a server certificate for localhost and 127.0.0.1,
    users alice, bob and carol, and root, an admin."""
    directory = str(tmp_path_factory.mktemp("team-ca"))
    for argv in (["ca", directory], ["server", directory, "--name", "localhost", "--ip", "127.0.0.1"],
                 *(["user", directory, user] for user in ACCOUNTS), ["user", directory, "root", "--admin"]):
        assert cli.main(["certs", *argv]) == 0
    return Team(directory)


@pytest.fixture(scope="session")
def accounts() -> Iterator[dict[str, pwd.struct_passwd]]:
    """The Unix accounts of helpers.ACCOUNTS by identity (alice, bob, carol), made with useradd where they are
    missing and removed after the tests. They need root and useradd: elsewhere the test skips, saying so (under
    CI, it fails)."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        unavailable("jobs that run as their owners need Unix accounts made for the test: root and useradd",
                    "run the tests as root")
    made = []
    for account in ACCOUNTS.values():
        try:
            pwd.getpwnam(account)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", account], check=True)
            made.append(account)
    yield {identity: pwd.getpwnam(account) for identity, account in ACCOUNTS.items()}
    for account in made:
        subprocess.run(["userdel", "--remove", account], check=False, capture_output=True)


@pytest.fixture(scope="session")
def monitor_account(accounts) -> Iterator[pwd.struct_passwd]:
    """The account (and group) helpers.MONITOR_ACCOUNT, made with useradd where missing and removed after."""
    made = False
    try:
        pwd.getpwnam(MONITOR_ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", MONITOR_ACCOUNT],
                       check=True)
        made = True
    yield pwd.getpwnam(MONITOR_ACCOUNT)
    if made:
        subprocess.run(["userdel", MONITOR_ACCOUNT], check=False, capture_output=True)


@pytest.fixture
def lock_dir(tmp_path) -> str:
    """A lock directory of the test's own (servers sharing it share GPUs)."""
    path = tmp_path / "locks"
    path.mkdir()
    return str(path)


@pytest.fixture
def cluster(lock_dir) -> Iterator[LocalCluster]:
    """A registry on a free loopback port; add servers with cluster.add_server(service, gpus)."""
    with LocalCluster(lock_dir) as local:
        yield local


@pytest.fixture
def server(cluster) -> Callable[..., int]:
    """Start a server: server("pytorch", "fake:2", *extra_args) -> its port."""

    def start(service: str = "pytorch", gpus: str = "fake:2", *extra: str) -> int:
        return cluster.add_server(service, gpus, *extra)[1]

    return start


@pytest.fixture
def connect() -> Iterator[Callable[[int], rpycdl.Connection]]:
    """connect(port) -> an rpycdl connection to 127.0.0.1:port, closed after the test."""
    conns: list[rpycdl.Connection] = []

    def open_(port: int) -> rpycdl.Connection:
        conn = rpycdl.connect(host="127.0.0.1", port=port)
        conns.append(conn)
        return conn

    yield open_
    for conn in conns:
        conn.close()


@pytest.fixture
def two(cluster, connect) -> tuple[int, rpycdl.Connection]:
    """A server with two simulated GPUs, and a connection to it: (its port, the connection)."""
    port = cluster.add_server("pytorch", "fake:2")[1]
    return port, connect(port)


@pytest.fixture(scope="module")
def shared_port(tmp_path_factory) -> Iterator[int]:
    """One registry and fake:2 server for a whole test module (for tests that leave no state behind)."""
    with LocalCluster(str(tmp_path_factory.mktemp("shared-locks"))) as local:
        yield local.add_server("pytorch", "fake:2")[1]


@pytest.fixture
def conn(shared_port, connect) -> rpycdl.Connection:
    """A connection to the module's shared server."""
    return connect(shared_port)


@pytest.fixture
def tls_server(server, team) -> Iterator[Callable[[str], rpycdl.Connection]]:
    """A fake:2 server with mutual TLS, its port as `.port`; as_user(name) -> a connection as one of the
    team's users (alice, bob, carol, root: an admin), closed after the test."""
    port = server("pytorch", "fake:2", *team.server_args())
    opened: list[rpycdl.Connection] = []

    def as_user(name: str) -> rpycdl.Connection:
        opened.append(rpycdl.connect(host="127.0.0.1", port=port, **team.user(name)))
        return opened[-1]

    as_user.port = port  # type: ignore[attr-defined]
    yield as_user
    for conn in opened:
        conn.close()


@pytest.fixture
def monitor(cluster) -> Iterator[str]:
    """A monitor of the cluster's lock directory on a free port; its base URL."""
    process = start(["monitor", "--gpus", "fake:2", "--lock-dir", cluster.lock_dir, "--port", "0"])
    try:
        yield "http://127.0.0.1:" + process.wait_for(r"on http://127\.0\.0\.1:(\d+)/metrics").group(1)
    finally:
        process.stop()


@pytest.fixture
def passable_dir() -> Iterator[Path]:
    """A directory of the test's own that every account may pass through (mode 755, as /tmp or /var/lib), for
    what jobs that run as their owners must reach (pytest's tmp_path is root's alone); removed after."""
    base = Path(tempfile.mkdtemp(prefix="rpycdl-accounts-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)
