"""Promise 9, users cannot touch each other (issue 26): a server started as root runs each job as its
owner's Unix account, and a job of one user that attacks another user's work, the server's state and its
secrets, through every path we know of, is refused or finds nothing. Real servers, real accounts (made
here with useradd: the tests need root, which CI has; elsewhere they skip, saying so)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    ACCOUNTS,
    MONITOR_ACCOUNT,
    Background,
    Team,
    monitored_lock_dir,
    open_gate,
    rpycdl_cli,
    running,
    scrape,
    wait_until,
    write_user_map,
)

import rpycdl
from rpycdl import cli
from rpycdl.scheduler.ledger import Ledger
from rpycdl.site import local
from rpycdl.site.local import LocalCluster

pytestmark = pytest.mark.slow

AWS_SECRET = "rpycdl-test-aws-secret-3f1e9c0d"
"""A store credential in the server's environment: no job may find it."""


@dataclass
class Site:
    """An isolated site: two root servers sharing one state directory, A (its own lock directory) for alice's
    work, B for the attacks, TLS with the team's certificates, a user map, a shared secret on disk and store
    credentials in the servers' environment and home."""

    base: Path
    cluster: LocalCluster
    team: Team
    state: Path
    locks_a: Path
    port_a: int
    port_b: int
    server_a: int
    secret_file: Path
    server_home: Path

    def connect(self, user: str, port: int | None = None) -> rpycdl.Connection:
        return rpycdl.connect(host="127.0.0.1", port=port or self.port_a, secret_file=str(self.secret_file),
                              **self.team.user(user))


@pytest.fixture
def site(team, accounts, monitor_account, passable_dir) -> Iterator[Site]:
    base = passable_dir  # everyone may pass through: only rpycdl's own modes protect
    write_user_map(base / "users.toml")
    secret_file = base / "secret"
    secret_file.write_bytes(os.urandom(32).hex().encode())
    secret_file.chmod(0o600)
    home = base / "server-home"
    (home / ".aws").mkdir(parents=True)
    home.chmod(0o700)
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {AWS_SECRET}\n")
    env = {"AWS_ACCESS_KEY_ID": "rpycdl-test-key-id", "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "HOME": str(home)}
    locks_b = base / "locks-b"
    state, locks_a = (monitored_lock_dir(base / name, monitor_account.pw_gid) for name in ("state", "locks-a"))
    flags = [*team.server_args("localhost"), "--secret-file", str(secret_file), "--user-map", str(base / "users.toml"),
             "--state-dir", str(state)]
    cluster = LocalCluster(str(locks_a))
    try:
        process, port_a = cluster.add_server("pytorch", "fake:1", *flags, "--policy", "fair", isolated=True, env=env)
        _, port_b = cluster.add_server("pytorch", "fake:1", *flags, isolated=True, env=env, lock_dir=str(locks_b))
        yield Site(base, cluster, team, state, locks_a, port_a, port_b, process.popen.pid, secret_file, home)
    finally:
        cluster.close()


def _make_alice_job():
    """Alice's running job: leaves a secret in its output directory, keeps one in its memory and its
    environment, reports its pid, and holds its GPU until the gate opens."""

    def alice_job(args: dict[str, Any]) -> str:
        import os
        import time

        import rpycdl

        secret = "alice-memory-" + args["token"]
        os.environ["ALICE_TOKEN"] = secret
        with open(os.path.join(rpycdl.output_dir(), "out.txt"), "w") as out:
            out.write("alice-output-" + args["token"])
        with open(args["pids"], "w") as pids:
            pids.write(str(os.getpid()))
        while not os.path.exists(args["gate"]):
            time.sleep(0.02)
        return secret

    return alice_job


ALICE_JOB = _make_alice_job()


def _make_attack():
    """Bob's job: tries each attack it is given, and says how each ended ("done", or the error's name)."""

    def attack(targets: dict[str, Any]) -> dict[str, Any]:
        import os
        import signal

        import rpycdl

        def attempt(what):
            try:
                what()
                return "done"
            except Exception as exc:  # noqa: BLE001 - how it was refused is the answer
                return type(exc).__name__

        def read(path):
            with open(path, "rb") as file:
                file.read(1)

        def write(path):
            with open(path, "r+b") as file:
                file.write(b"x")

        tried = {}
        for name, path in targets["read"].items():
            tried[f"read {name}"] = attempt(lambda path=path: read(path))
        for name, path in targets["write"].items():
            tried[f"write {name}"] = attempt(lambda path=path: write(path))
        for name, path in targets["remove"].items():
            tried[f"remove {name}"] = attempt(lambda path=path: os.unlink(path))
        for name, path in targets["list"].items():
            tried[f"list {name}"] = attempt(lambda path=path: os.listdir(path))
        tried["replace her payload"] = attempt(lambda: os.replace(targets["mine"], targets["payload"]))
        tried["plant in her output"] = attempt(lambda: open(os.path.join(targets["her output"], "planted"), "w"))
        tried["signal her job"] = attempt(lambda: os.kill(targets["her pid"], signal.SIGKILL))
        tried["signal the server"] = attempt(lambda: os.kill(targets["server pid"], signal.SIGKILL))
        with open("/proc/self/environ", "rb") as own:
            environ = own.read().decode(errors="replace")
        dump = os.path.join(rpycdl.output_dir(), "memory")
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb") as mem, open(dump, "wb") as out:
            for line in maps:
                span, perms = line.split()[:2]
                start, end = (int(bound, 16) for bound in span.split("-"))
                if perms.startswith("r") and "[vvar]" not in line and "[vsyscall]" not in line:
                    try:
                        mem.seek(start)
                        out.write(mem.read(end - start))
                    except OSError:
                        pass
        mine = os.path.join(rpycdl.output_dir(), "mine")
        open(mine, "w").close()
        return {"tried": tried, "environ": environ, "uid": os.getuid(), "gid": os.getgid(),
                "home": os.environ.get("HOME"), "user": os.environ.get("USER"), "umask": os.umask(0o077),
                "mine": os.stat(mine).st_uid}

    return attack


ATTACK = _make_attack()


def _files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """The regular files under `root` (by name relative to it), but in the subtrees `skip`."""
    found = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name not in skip]
        for name in files:
            path = Path(directory, name)
            if stat.S_ISREG(path.lstat().st_mode):
                found[str(path.relative_to(root))] = str(path)
    return found


def test_a_job_of_another_user_reaches_nothing_of_alices_nor_of_the_servers(site, accounts, tmp_path):
    token = os.urandom(8).hex()
    gates = site.base / "gates"
    gates.mkdir(mode=0o777)
    gates.chmod(0o777)
    workdir = tmp_path / "alice-src"
    workdir.mkdir()
    (workdir / "secret.txt").write_text("alice-workdir-" + token)

    alice = site.connect("alice")
    done = alice.root.submit(lambda token: print("alice-log-" + token) or "alice-result-" + token, token)
    assert done.wait(60).state is rpycdl.JobState.SUCCEEDED
    running = Background(site.connect("alice"), ALICE_JOB, {"token": token, "pids": str(gates / "alice.pid"),
                                                            "gate": str(gates / "open")}, working_dir=str(workdir))
    running.wait_state("running")
    her_pid = int(wait_until(lambda: (gates / "alice.pid").exists() and (gates / "alice.pid").read_text(),
                             what="alice's job to start"))
    pending = alice.root.submit(lambda _: "never", None)  # waits behind her running job on server A
    wait_until(lambda: pending.status().state is rpycdl.JobState.PENDING, what="her second job to wait")
    jobs = site.state / "jobs"
    running_dir = jobs / running.job_id
    assert pwd.getpwuid(os.stat(running_dir / "work").st_uid).pw_name == ACCOUNTS["alice"]

    locks = _files(site.locks_a, skip=("simulated-gpus",))
    targets = {
        "read": {"the ledger": site.state / "ledger.sqlite3", "her log": jobs / done.id / "log",
                 "her result": jobs / done.id / "result", "her payload": jobs / pending.id / "payload",
                 "her result's key": jobs / pending.id / "result.key",
                 "her working copy": running_dir / "work" / "secret.txt",
                 "her output": running_dir / "output" / "out.txt", "her environment": f"/proc/{her_pid}/environ",
                 "her memory": f"/proc/{her_pid}/mem", "the TLS key": Path(site.team.dir) / "server-localhost.key",
                 "the shared secret": site.secret_file, "the server's environment": f"/proc/{site.server_a}/environ",
                 "the store's credentials": site.server_home / ".aws" / "credentials"},
        "write": {"the ledger": site.state / "ledger.sqlite3", "her payload": jobs / pending.id / "payload",
                  **{f"lock file {name}": path for name, path in locks.items()}},
        "remove": {"her payload": jobs / pending.id / "payload",
                   **{f"lock file {name}": path for name, path in locks.items()}},
        "list": {"the jobs": jobs, "the working directories' cache": site.state / "workdirs",
                 "her working copy": running_dir / "work"},
        "mine": str(site.base / "gates"), "payload": str(jobs / pending.id / "payload"),
        "her output": str(running_dir / "output"), "her pid": her_pid, "server pid": site.server_a,
    }
    targets = {key: {k: str(v) for k, v in value.items()} if isinstance(value, dict) else value
               for key, value in targets.items()}
    with site.connect("bob", site.port_b) as bob:
        seen = bob.root.run_code(ATTACK, targets)
    assert any(name.startswith("write lock file gpus/") for name in seen["tried"]), seen["tried"]
    assert {name: how for name, how in seen["tried"].items() if how != "PermissionError"} == {}, seen["tried"]

    bob_account = accounts["bob"]
    assert (seen["uid"], seen["gid"], seen["user"], seen["home"], seen["umask"], seen["mine"]) == (
        bob_account.pw_uid, bob_account.pw_gid, ACCOUNTS["bob"], bob_account.pw_dir, 0o077, bob_account.pw_uid)
    for needle in (AWS_SECRET, "rpycdl-test-key-id"):
        assert needle not in seen["environ"], f"{needle} in the job's own environment"
    dumped = wait_until(lambda: next(site.state.glob("artifacts/bob/*/memory"), None), what="the upload of its dump")
    memory = dumped.read_bytes()
    assert len(memory) > 1 << 20  # it read itself
    # The shared secret and the store's key are in the server's memory (and its connection processes'):
    # a job forked from any of them would carry them.
    for needle in (site.secret_file.read_bytes(), AWS_SECRET.encode(), b"alice-memory-" + token.encode()):
        assert needle not in memory, f"found {needle[:12]!r}... in the memory of bob's job"

    assert running.done is False and os.path.exists(f"/proc/{her_pid}"), "her job was touched"
    open_gate(str(gates / "open"))
    assert running.result() == "alice-memory-" + token
    assert alice.root.job(done.id).result() == "alice-result-" + token
    assert Ledger(site.state).get(done.id).user == "alice"


class _Spill:
    """An argument whose unpickling appends the environment it finds to `path`: where a payload is loaded (a load
    check while its job waits, then its job process), its owner's code runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"import os\nwith open({self.path!r}, 'a') as out: out.write(repr(dict(os.environ)) + '\\n')",)


def _make_gated():
    """A job that holds its GPU until its gate opens (made in a function: dill sends it by value)."""

    def gated(gate: str) -> None:
        import os
        import time

        while not os.path.exists(gate):
            time.sleep(0.02)

    return gated


GATED = _make_gated()


def test_a_detached_jobs_payload_is_unpickled_where_no_credential_is(site):
    """A detached job that waits has its payload test-loaded by its supervisor meanwhile, then run: neither process
    may carry the credentials the supervisor reads (its store's, for the job's uploads)."""
    spills = site.base / "spills"
    spills.mkdir(mode=0o777)
    spills.chmod(0o777)
    spill, gate = spills / "environ", spills / "open"
    with site.connect("bob", site.port_b) as bob:
        blocker = bob.root.submit(GATED, str(gate))
        wait_until(lambda: blocker.status().state is rpycdl.JobState.RUNNING, what="bob's first job to hold the GPU")
        waiting = bob.root.submit(lambda spilled: "loaded", _Spill(str(spill)))
        wait_until(spill.exists, what="its payload's load check while it waits")
        open_gate(str(gate))
        assert waiting.result(timeout=60) == "loaded"
    found = spill.read_text().splitlines()
    assert len(found) == 2, found  # the load check's, then the job's
    for environ in found:
        for needle in (AWS_SECRET, "rpycdl-test-key-id"):
            assert needle not in environ, f"{needle} where bob's payload was unpickled"


def test_refusals_name_the_identity_and_what_to_do(site, tmp_path):
    with site.connect("root") as root:  # an admin certificate, whose account would be root
        with pytest.raises(rpycdl.NotAllowedError, match="jobs never run as root"):
            root.root.run_code(abs, -1)
    own = tmp_path / "ca"  # the team's CA, copied: dave's certificate is not left in the session's directory
    shutil.copytree(site.team.dir, own)
    assert cli.main(["certs", "user", str(own), "dave"]) == 0
    with rpycdl.connect(host="127.0.0.1", port=site.port_a, secret_file=str(site.secret_file),
                        **Team(str(own)).user("dave")) as dave:
        with pytest.raises(rpycdl.NotAllowedError, match="'dave', does not exist on this server"):
            dave.root.submit(abs, -1)


def test_unverified_clients_are_refused_or_run_as_the_guest(site, accounts, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret-for-guests")
    secret.chmod(0o600)
    flags = ["--secret-file", str(secret), "--state-dir", str(site.state)]
    _, refusing = site.cluster.add_server("pytorch", "fake:1", *flags, isolated=True, lock_dir=str(site.base / "l1"))
    with rpycdl.connect(host="127.0.0.1", port=refusing, secret_file=str(secret)) as conn:
        with pytest.raises(rpycdl.NotAllowedError, match="not verified .* --guest-user"):
            conn.root.run_code(abs, -1)
    _, guests = site.cluster.add_server("pytorch", "fake:1", *flags, "--guest-user", ACCOUNTS["bob"], isolated=True,
                                        lock_dir=str(site.base / "l2"))
    with rpycdl.connect(host="127.0.0.1", port=guests, secret_file=str(secret)) as conn:
        assert conn.root.run_code(lambda _: __import__("os").getuid(), None) == accounts["bob"].pw_uid


def test_what_a_job_starts_and_leaves_runs_as_its_owner_and_goes_with_it(site, accounts, tmp_path):
    def job(_):
        import os
        import subprocess

        child = subprocess.Popen(["setsid", "sleep", "60"])
        return os.getuid(), child.pid

    with site.connect("alice") as alice:
        uid, child = alice.root.run_code(job, None)
    assert uid == accounts["alice"].pw_uid
    wait_until(lambda: not running(child), 5, "what the job left to be gone")  # gone, or a zombie
    with site.connect("alice") as alice:
        row = alice.root.jobs()[0]
    assert row["user"] == "alice" and row["state"] == "SUCCEEDED"
    with site.connect("bob") as bob:  # the GPU is free again once nothing of alice's job runs
        assert bob.root.run_code(lambda _: __import__("os").getuid(), None, queue_timeout=5) == accounts["bob"].pw_uid


def test_the_isolation_mode_is_said_and_one_lock_directory_has_one(site, cluster, server):
    flags = ["--host", "127.0.0.1", "--port", str(site.port_a),
             *(f"--{key.replace('_', '-')}={value}" for key, value in site.team.user("alice").items()),
             f"--secret-file={site.secret_file}"]
    shown = rpycdl_cli("status", *flags)
    assert shown.returncode == 0 and "isolation: owner accounts" in shown.stdout, shown.stdout + shown.stderr
    one = rpycdl_cli("status", "--host", "127.0.0.1", "--port", str(server("pytorch", "fake:1")))
    assert "isolation: one account" in one.stdout, one.stdout
    assert "isolation: owner accounts" in site.cluster.processes[1].lines[0]  # the ready line
    mixed = rpycdl_cli("serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none",
                       "--one-account", "--lock-dir", str(site.locks_a), timeout=60)
    assert mixed.returncode == 1 and "isolation 'owner accounts'" in mixed.stderr, mixed.stderr
    as_root = rpycdl_cli("monitor", "--gpus", "fake:1", "--lock-dir", str(site.locks_a), "--port", "0")
    assert as_root.returncode == 1 and "--user ACCOUNT" in as_root.stderr, as_root.stderr  # root reads nothing there
    watching = local.start(["monitor", "--gpus", "fake:1", "--lock-dir", str(site.locks_a), "--state-dir",
                            str(site.state), "--port", "0", "--user", MONITOR_ACCOUNT])
    try:
        base = "http://127.0.0.1:" + watching.wait_for(r"on http://127\.0\.0\.1:(\d+)/metrics").group(1)
        assert scrape(base)["rpycdl_isolation_info"] == [({"mode": "owner accounts"}, 1.0)]
    finally:
        watching.stop()
