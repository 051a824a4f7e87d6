"""Promise 10, root never acts on a path a user can change (issue 34): a root server with owner accounts,
attacked by a local user (bob, from his shell: a process of his own account, forked from the test and holding
ctypes, as a hostile user's would with inotify and renameat2) and by his jobs. Real servers, real accounts
(made with useradd: root is needed, which CI has; elsewhere the tests skip, saying so)."""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import pwd
import re
import select
import stat
import struct
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dill
import pytest
import rpyc
from docs_pages import REPO
from helpers import (
    ACCOUNTS,
    MONITOR_ACCOUNT,
    Background,
    Team,
    gate_job,
    monitored_lock_dir,
    open_gate,
    rpycdl_cli,
    wait_until,
    write_user_map,
)

import rpycdl
from rpycdl.site import local
from rpycdl.site.local import LocalCluster

pytestmark = pytest.mark.slow

CTX = multiprocessing.get_context("fork")
LIBC = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2
AT_FDCWD = -100
IN_ACCESS, IN_OPEN, IN_CLOSE_NOWRITE, IN_NONBLOCK = 0x1, 0x20, 0x10, 0o4000
TRIES = 20
"""The chown race's tries: each a detached job of bob's whose output directory he attacks from its submission
to its end (the issue's bound: at least 20)."""


@dataclass
class Site:
    """A root server (owner accounts) on fake:1 with TLS and a user map; its lock directory monitored."""

    base: Path
    locks: Path
    state: Path
    team: Team
    port: int
    cluster: LocalCluster

    def connect(self, user: str) -> rpycdl.Connection:
        return rpycdl.connect(host="127.0.0.1", port=self.port, **self.team.user(user))


@pytest.fixture
def site(team, accounts, monitor_account, passable_dir) -> Iterator[Site]:
    write_user_map(passable_dir / "users.toml")
    locks = monitored_lock_dir(passable_dir / "locks", monitor_account.pw_gid)
    cluster = LocalCluster(str(locks))
    try:
        _, port = cluster.add_server("pytorch", "fake:1", *team.server_args("localhost"), "--user-map",
                                     str(passable_dir / "users.toml"), isolated=True)
        yield Site(passable_dir, locks, locks / "state", team, port, cluster)
    finally:
        cluster.close()


def as_account(account: pwd.struct_passwd, work: Callable[..., Any], *args: Any) -> Any:
    """Run `work(*args)` in a child forked from this process that became `account` (a local user's shell:
    no capability, its own uid and groups); returns what it returned, re-raises what it raised."""
    reader, writer = CTX.Pipe(duplex=False)

    def child() -> None:
        os.setgroups([])
        os.setresgid(account.pw_gid, account.pw_gid, account.pw_gid)
        os.setresuid(account.pw_uid, account.pw_uid, account.pw_uid)
        try:
            writer.send(("value", work(*args)))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            writer.send(("error", exc))

    process = CTX.Process(target=child)
    process.start()
    kind, value = reader.recv()
    process.join(30)
    if kind == "error":
        raise value
    return value


def _exchange(first: str, second: str) -> bool:
    """Swap two names atomically (renameat2 RENAME_EXCHANGE); whether it was done."""
    return LIBC.renameat2(AT_FDCWD, first.encode(), AT_FDCWD, second.encode(), RENAME_EXCHANGE) == 0


def _swapper(output: str, victim: str, ready: Any, stop: Any, report: Any) -> None:
    """Bob's shell against his job's output directory: a tree of his in it, and a link to `victim` beside it;
    every time something opens or reads the directory (inotify), and in between all along, the two swapped."""
    sub, link = os.path.join(output, "sub"), os.path.join(output, "link")
    os.makedirs(os.path.join(sub, "deeper"), exist_ok=True)
    for index in range(40):
        Path(sub, f"f{index}").write_text("bob")
    os.symlink(victim, link)
    watch = LIBC.inotify_init1(IN_NONBLOCK)
    for path in (output, sub):
        LIBC.inotify_add_watch(watch, path.encode(), IN_OPEN | IN_ACCESS | IN_CLOSE_NOWRITE)
    ready.set()
    swaps = events = 0
    while not stop.is_set():
        if select.select([watch], [], [], 0.0005)[0]:
            try:
                events += len(os.read(watch, 65536)) // struct.calcsize("iIII")
            except BlockingIOError:
                pass
        if os.path.isdir(output):
            swaps += _exchange(sub, link)
    report.put((swaps, events))


def _owners(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` (and itself): (owner uid, mode), never following a link."""
    found = {".": (root.lstat().st_uid, stat.S_IMODE(root.lstat().st_mode))}
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(directory, name)
            status = path.lstat()
            found[str(path.relative_to(root))] = (status.st_uid, stat.S_IMODE(status.st_mode))
    return found


def _victim(base: Path) -> Path:
    """A tree of root's that no job may come to own or read: a shadow-like file, a private key, a subtree."""
    victim = base / "victim"
    (victim / "etc").mkdir(parents=True)
    for name, mode in (("shadow", 0o640), ("server.key", 0o600), ("etc/passwd", 0o644)):
        (victim / name).write_text(f"root's {name}\n")
        (victim / name).chmod(mode)
    victim.chmod(0o755)
    return victim


def _make_outputs() -> Callable[[dict[str, Any]], str]:
    """Bob's detached job (made in a function, so that dill sends it by value): leaves two files in its output
    directory."""

    def outputs(args: dict[str, Any]) -> str:
        import os

        import rpycdl

        for name in ("a.txt", "b.txt"):
            with open(os.path.join(rpycdl.output_dir(), name), "w") as out:
                out.write(args["token"])
        return "done"

    return outputs


OUTPUTS = _make_outputs()


def test_the_chown_race_changes_the_owner_of_nothing_outside_the_users_own_tree(site, accounts, tmp_path):
    victim = _victim(site.base)
    before = _owners(victim)
    workdir = tmp_path / "src"
    (workdir / "pkg").mkdir(parents=True)
    (workdir / "pkg" / "x.py").write_text("X = 1\n")
    swaps = events = 0
    with site.connect("alice") as alice, site.connect("bob") as bob:
        for attempt in range(TRIES):
            gate = site.base / f"gate-{attempt}"
            holder = Background(alice, gate_job(str(gate)), attempt)
            holder.wait_state("running")
            job = bob.root.submit(OUTPUTS, {"token": f"t{attempt}"}, working_dir=str(workdir))
            output = site.state / "jobs" / job.id / "output"
            ready, stop, report = CTX.Event(), CTX.Event(), CTX.Queue()
            attacker = CTX.Process(target=_as, args=(accounts["bob"], _swapper, str(output), str(victim), ready, stop,
                                                     report), daemon=True)
            attacker.start()
            try:
                assert ready.wait(30), "bob's shell could not plant its tree in his job's output directory"
                open_gate(str(gate))
                assert holder.result() == attempt
                ended = job.wait(60)
            finally:
                stop.set()
            done, seen = report.get(timeout=30)
            attacker.join(30)
            swaps, events = swaps + done, events + seen
            assert _owners(victim) == before, f"try {attempt}: root's tree changed hands"
            assert ended.state is rpycdl.JobState.SUCCEEDED, ended
            names = {artifact["name"] for artifact in job.wait_artifacts()["files"]}
            assert {"a.txt", "b.txt"} <= names and not {name for name in names if "shadow" in name or "key" in name}
    assert swaps > TRIES * 10 and events > 0, (swaps, events)  # the attacker raced all along, and saw root look
    bob_uid = accounts["bob"].pw_uid
    his = [path.split("/") for path, (uid, _) in _owners(site.locks).items() if uid == bob_uid]  # but his outputs:
    assert not [path for path in his if path[3:4] not in (["output"], ["work"]) and path[1:3] != ["artifacts", "bob"]]


def _as(account: pwd.struct_passwd, work: Callable[..., Any], *args: Any) -> None:
    os.setgroups([])
    os.setresgid(account.pw_gid, account.pw_gid, account.pw_gid)
    os.setresuid(account.pw_uid, account.pw_uid, account.pw_uid)
    work(*args)


def _tamper(targets: dict[str, str]) -> dict[str, str]:
    """Bob's shell: rename, remove, replace by a link or write each target; how each ended."""
    found = {}
    for name, path in targets.items():
        for how, act in (("rename", lambda p: os.rename(p, p + ".aside")), ("remove", os.unlink),
                         ("link", lambda p: os.symlink("/etc/passwd", p + ".new") or os.replace(p + ".new", p)),
                         ("write", lambda p: open(p, "a").close())):
            try:
                act(path)
                found[f"{how} {name}"] = "done"
            except OSError as exc:
                found[f"{how} {name}"] = errno.errorcode.get(exc.errno, str(exc))
    return found


def test_a_user_can_rename_replace_or_write_no_lock_file_record_log_or_result(site, accounts):
    gate = site.base / "gate"
    with site.connect("alice") as alice:
        finished = alice.root.submit(lambda _: print("alice's log") or "alice's result", None)
        assert finished.wait(60).state is rpycdl.JobState.SUCCEEDED
        holder = Background(alice, gate_job(str(gate)), None)
        holder.wait_state("running")
        waiting = alice.root.submit(lambda _: None, None)
        wait_until(lambda: waiting.status().state is rpycdl.JobState.PENDING, what="her job to wait")
        jobs = site.state / "jobs"
        targets = {
            **{f"lock {path.name}": str(path) for path in (site.locks / "gpus").iterdir()},
            **{f"held {path.name}": str(path) for path in (site.locks / "held").iterdir()},
            **{f"queue {path.name}": str(path) for folder in ("queue", "rows")
               for path in (site.locks / folder).iterdir()},
            "her job's directory": str(jobs / finished.id), "her log": str(jobs / finished.id / "log"),
            "her result": str(jobs / finished.id / "result"), "the queue lock": str(site.locks / "queue.lock"),
        }
        assert any(name.startswith("held ") for name in targets) and any(name.startswith("queue ") for name in targets)
        tried = as_account(accounts["bob"], _tamper, targets)
        assert {name: how for name, how in tried.items() if how not in ("EACCES", "EPERM", "EISDIR")} == {}, tried
        open_gate(str(gate))
        assert holder.result() is None and waiting.wait(60).state is rpycdl.JobState.SUCCEEDED
        assert list(finished.logs()) == ["alice's log\n"] and finished.result() == "alice's result"


def test_a_lock_file_replaced_under_a_running_job_kills_nothing(site):
    """What a user did while the directories were open to all (issue 34, attack 6), played by root now that only
    root can: the GPU's lock file renamed aside and a new one put at its name. The server's sweep, probing through
    its descriptor of the file that was there, saw nobody holding the job's grant and SIGKILLed the job ("granted
    again: its connection process died"); a grant whose holder lives stays granted, and the log says why."""
    gate = site.base / "gate"
    server = site.cluster.processes[1]
    with site.connect("alice") as alice:
        holder = Background(alice, gate_job(str(gate)), "alive")
        holder.wait_state("running")
        [lock] = (site.locks / "gpus").iterdir()
        lock.rename(lock.with_name("aside"))
        lock.touch()
        wait_until(lambda: holder.done or any("lock file was replaced" in line for line in server.lines), 10,
                   "the server's sweep to find the grant unlocked")
        assert not holder.done, f"the running job was ended: {holder.error!r}"
        open_gate(str(gate))
        assert holder.result() == "alive"


def _make_planted() -> Callable[[dict[str, str]], dict[str, str]]:
    """Bob's job: links out of its output directory, saved and left for the upload; what each save said."""

    def planted(args: dict[str, str]) -> dict[str, str]:
        import os

        import rpycdl

        output = rpycdl.output_dir()
        os.symlink(args["secret"], os.path.join(output, "secret"))
        os.symlink(args["tree"], os.path.join(output, "tree"))
        os.makedirs(os.path.join(output, "real"))
        with open(os.path.join(output, "real", "mine.txt"), "w") as mine:
            mine.write("bob's")
        said = {}
        for name in ("secret", "tree/shadow", "real/mine.txt"):
            try:
                rpycdl.save_artifact(os.path.join(output, name))
                said[name] = "saved"
            except Exception as exc:  # noqa: BLE001 - the test reads it
                said[name] = type(exc).__name__
        return said

    return planted


PLANTED = _make_planted()


def test_links_a_user_leaves_in_his_directories_make_the_server_read_nothing_outside(site):
    victim = _victim(site.base)
    with site.connect("bob") as bob:
        job = bob.root.submit(PLANTED, {"secret": str(victim / "shadow"), "tree": str(victim)})
        assert job.wait(60).state is rpycdl.JobState.SUCCEEDED
        said = job.result()
        artifacts = job.wait_artifacts()
    assert said == {"secret": "InvalidRequestError", "tree/shadow": "InvalidRequestError", "real/mine.txt": "saved"}
    assert [artifact["name"] for artifact in artifacts["files"]] == ["real/mine.txt"]
    stored = site.state / "artifacts" / "bob" / job.id
    assert sorted(str(path.relative_to(stored)) for path in stored.rglob("*")) == ["real", "real/mine.txt"]


def _make_value_trap() -> Callable[[str], Any]:
    """A job whose value's unpickling, wherever it happens, writes the uid that unpickled it to `path`."""

    def value_trap(path: str) -> Any:
        import os

        class Trap:
            def __reduce__(self):
                return (os.system, (f"id -u >> {path}",))

        return Trap()

    return value_trap


VALUE_TRAP = _make_value_trap()


def test_a_jobs_outcome_runs_nothing_of_it_as_root(site, accounts):
    """An original client (plain RPyC, its value made on the server) of a root server whose unverified clients run
    as a guest account: the job's value is unpickled there only if it is plain data."""
    marker = site.base / "unpickled"
    marker.touch()
    marker.chmod(0o666)  # the job may write it too: the uids in it tell who unpickled the value
    _, port = site.cluster.add_server("pytorch", "fake:1", "--guest-user", ACCOUNTS["bob"], isolated=True)
    original = rpyc.connect("127.0.0.1", port, config={"allow_public_attrs": True, "sync_request_timeout": 60})
    try:
        assert original.root.run_code(dill.dumps(lambda x: {"sum": x + 1}, recurse=True), 1)["sum"] == 2  # plain
        with pytest.raises(Exception, match="does not unpickle") as refused:
            original.root.run_code(dill.dumps(VALUE_TRAP, recurse=True), str(marker))
        assert "rpycdl.connect" in str(refused.value)  # what to do instead
    finally:
        original.close()
    assert "0" not in marker.read_text().split(), "a job's value ran code as root"


def test_root_processes_carry_no_job_id_on_their_command_line_and_hidepid_is_asked_for(site):
    gate = site.base / "gate"
    with site.connect("alice") as alice:
        holder = Background(alice, gate_job(str(gate)), None)
        holder.wait_state("running")
        waiting = alice.root.submit(lambda _: None, None)
        wait_until(lambda: waiting.status().state is rpycdl.JobState.PENDING, what="her job to wait")

        def root_processes() -> list[tuple[str, str]]:
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    name = Path(f"/proc/{pid}/comm").read_text().strip()
                    uid = os.stat(f"/proc/{pid}").st_uid
                except OSError:
                    continue
                if uid == 0 and "rpycdl" in cmdline:
                    found.append((name, cmdline))
            return found

        # the waiting job heads its line: its supervisor is started ahead of its turn (DISPATCH_AHEAD)
        processes = wait_until(lambda: (found := root_processes()) and any(
            name == "rpycdl-superv" for name, _ in found) and found, what="her job's supervisor")
        lines = [line for _, line in processes]
        assert not [line for line in lines if waiting.id in line or str(site.state) in line], lines
        open_gate(str(gate))
        assert holder.result() is None and waiting.wait(60).state is rpycdl.JobState.SUCCEEDED
    server = site.cluster.processes[1]
    assert any("hidepid" in line for line in server.lines), server.lines[:5]


def test_a_root_server_refuses_a_lock_directory_another_account_could_change(site, accounts, tmp_path):
    squatted = site.base / "squatted"
    squatted.mkdir()
    os.chown(squatted, accounts["bob"].pw_uid, accounts["bob"].pw_gid)
    open_tree = site.base / "open" / "locks"
    open_tree.parent.mkdir()
    open_tree.parent.chmod(0o777)
    for lock_dir, why in ((squatted, "belongs to another account"), (open_tree, "writable by others")):
        refused = rpycdl_cli("serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry",
                             "none", "--lock-dir", str(lock_dir), timeout=60)
        assert refused.returncode == 1 and why in refused.stderr and "root" in refused.stderr, refused.stderr
    assert not any(squatted.iterdir()) and not open_tree.exists()  # nothing made there


# -- the modes of the lock and state directories, as docs/security.md gives them ------------------------------


def _mode_table() -> list[tuple[re.Pattern[str], str, str, str]]:
    """docs/security.md's table of modes: (path pattern over L/... and S/..., owner, group, mode), in order."""
    text = (REPO / "docs" / "security.md").read_text()
    section = text.split("## Modes of the lock and state directories", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        for pattern in re.findall(r"`([LS](?:/[^`]*)?)`", cells[0]):
            regex = re.escape(pattern).replace(r"\*\*", ".+").replace(r"\*", "[^/]*")
            rows.append((re.compile(regex), cells[1], cells[2], cells[3].strip("`")))
    return rows


def _check_modes(locks: Path, state: Path, users: set[int]) -> list[str]:
    """What in the live tree differs from the table (every entry must match a row: the first that does)."""
    table, wrong = _mode_table(), []
    assert len(table) > 30, "docs/security.md lost its table of modes"
    group = locks.stat().st_gid
    entries = [(locks, "L"), (state, "S")]
    for top, letter in ((locks, "L"), (state, "S")):
        for directory, dirs, files in os.walk(top):
            for name in [*dirs, *files]:
                path = Path(directory, name)
                if letter == "L" and path.is_relative_to(state):
                    continue
                entries.append((path, f"{letter}/{path.relative_to(top)}"))
    for path, shown in entries:
        try:
            status = path.lstat()
        except FileNotFoundError:
            continue  # gone meanwhile: a record, a FIFO
        row = next((row for row in table if row[0].fullmatch(shown)), None)
        if row is None:
            wrong.append(f"{shown}: in no row of the table")
            continue
        _, owner, in_group, mode = row
        owners = {"root": {0}, "the job's owner": users, "root or the job's owner": {0, *users}}.get(owner)
        if owners is not None and status.st_uid not in owners:
            wrong.append(f"{shown}: owner uid {status.st_uid}, the table says {owner}")
        if in_group == "G" and status.st_gid != group:
            wrong.append(f"{shown}: group {status.st_gid}, the table says the lock directory's ({group})")
        if mode != "any" and stat.S_IMODE(status.st_mode) != int(mode, 8):
            wrong.append(f"{shown}: mode {stat.S_IMODE(status.st_mode):o}, the table says {mode}")
    return wrong


def test_every_start_and_restart_leaves_the_modes_this_table_gives(team, accounts, monitor_account, passable_dir):
    """The monitor (as its account) first, then a root server, jobs of every kind, a root monitor (refused),
    the monitor and the server restarted each while the other runs, a second server: after each step the live
    tree matches docs/security.md's table of modes."""
    write_user_map(passable_dir / "users.toml")
    locks = monitored_lock_dir(passable_dir / "locks", monitor_account.pw_gid)
    state, users = locks / "state", {account.pw_uid for account in accounts.values()}
    flags = (*team.server_args("localhost"), "--user-map", str(passable_dir / "users.toml"))
    monitor_args = ["monitor", "--gpus", "fake:1", "--lock-dir", str(locks), "--port", "0", "--user", MONITOR_ACCOUNT]
    gate = passable_dir / "gate"
    with LocalCluster(str(locks)) as cluster:
        monitor = local.start(monitor_args)
        base = monitor.wait_for(r"on (http://127\.0\.0\.1:\d+)/metrics").group(1)
        assert not any(state.iterdir()) if state.exists() else True  # the monitor made nothing
        server, port = cluster.add_server("pytorch", "fake:1", *flags, isolated=True)
        site = Site(passable_dir, locks, state, team, port, cluster)
        workdir = passable_dir / "src"
        workdir.mkdir()
        (workdir / "a.py").write_text("A = 1\n")
        with site.connect("alice") as alice, site.connect("bob") as bob:
            done = alice.root.submit(OUTPUTS, {"token": "x"}, working_dir=str(workdir))
            assert done.wait(60).state is rpycdl.JobState.SUCCEEDED and done.result() == "done"
            holder = Background(alice, gate_job(str(gate)), None, working_dir=str(workdir))
            holder.wait_state("running")
            waiting = bob.root.submit(OUTPUTS, {"token": "y"})
            wait_until(lambda: waiting.status().state is rpycdl.JobState.PENDING, what="bob's job to wait")
            assert _check_modes(locks, state, users) == []
            assert "rpycdl_gpu_holder_info" in urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
            as_root = rpycdl_cli("monitor", "--gpus", "fake:1", "--lock-dir", str(locks), "--port", "0")
            assert as_root.returncode == 1 and "--user ACCOUNT" in as_root.stderr, as_root.stderr
            assert _check_modes(locks, state, users) == []
            monitor.stop()
            monitor = local.start(monitor_args)  # restarted while the server, a job and a waiter run
            base = monitor.wait_for(r"on (http://127\.0\.0\.1:\d+)/metrics").group(1)
            assert _check_modes(locks, state, users) == []
            _, second = cluster.add_server("pytorch", "fake:1", *flags, isolated=True)  # another start, jobs live
            assert _check_modes(locks, state, users) == []
            open_gate(str(gate))
            assert holder.result() is None and waiting.wait(60).state is rpycdl.JobState.SUCCEEDED
        server.stop()  # restarted while the monitor runs
        cluster.add_server("pytorch", "fake:1", *flags, isolated=True)
        page = urllib.request.urlopen(f"{base}/api/host", timeout=10).read().decode()
        assert waiting.id in page  # the monitor reads the host still, as its account
        monitor.stop()
        assert _check_modes(locks, state, users) == []
        assert second
