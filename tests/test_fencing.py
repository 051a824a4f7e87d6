"""Jobs fenced in (a root server: a cgroup per job, a private /tmp when asked): host memory, processes, CPU and GPU
device nodes bounded, everything a job started killed at its end however it daemonized, its usage in the ledger.
Each job attacks its fence from inside, as a job of another user would."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import forkserver, rpycdl_cli, running, scrape, server_pid, unavailable, wait_until

import rpycdl
from rpycdl.security import cgroupfs, cgroups, devices


@pytest.fixture(autouse=True)
def fenced() -> None:
    found = cgroups.detect()
    if isinstance(found, str):
        unavailable(f"this machine cannot fence jobs: {found}", "run the tests as root with cgroups mounted")


def _toucher():  # nested, so that dill sends it by value: the server cannot import this module
    def touch(size: int) -> int:
        """Touch `size` bytes of fresh memory, a page at a time; then burn 0.3 s of CPU."""
        import time

        memory = bytearray(size)
        for offset in range(0, size, 4096):
            memory[offset] = 1
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        return len(memory)

    return touch


touch = _toucher()


def test_a_job_over_its_memory_fails_naming_its_limit_and_the_next_runs(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    with pytest.raises(rpycdl.HostMemoryExceededError, match=r"used 25\d MiB of host memory.*256 MiB.*memory="):
        conn.root.run_code(touch, 1 << 30, memory="256MiB")
    assert conn.root.run_code(touch, 64 << 20, memory="256MiB") == 64 << 20
    assert "--max-job-memory" in str(pytest.raises(rpycdl.InvalidRequestError, conn.root.run_code, touch, 1,
                                                   memory="100TiB").value)


def test_a_server_default_memory_binds_jobs_that_do_not_ask(server, connect):
    conn = connect(server("pytorch", "fake:1", "--job-memory", "200MiB"))
    with pytest.raises(rpycdl.HostMemoryExceededError, match="--job-memory"):
        conn.root.run_code(touch, 512 << 20)


def test_a_job_cannot_start_more_processes_than_job_pids(server, connect):
    def fork_bomb(count: int) -> int:
        import os
        import time

        started = 0
        for _ in range(count):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
            except OSError:
                break
            started += 1
        return started

    conn = connect(server("pytorch", "fake:1", "--job-pids", "32"))
    started = conn.root.run_code(fork_bomb, 200)
    assert 16 <= started < 32  # the job process and its threads count too


def test_a_job_gets_the_cpus_it_asks_for(server, connect):
    def quota(_: None) -> str:
        path = next(line.split(":", 2)[2] for line in open("/proc/self/cgroup").read().splitlines()
                    if line.split(":")[1] in ("cpu", "cpu,cpuacct", "cpuacct,cpu", ""))
        for where in (f"/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us", f"/sys/fs/cgroup{path}/cpu.max",
                      f"/sys/fs/cgroup/cpu,cpuacct{path}/cpu.cfs_quota_us"):
            if os.path.exists(where):
                return open(where).read().split()[0]
        return "not found"

    conn = connect(server("pytorch", "fake:1"))
    assert conn.root.run_code(quota, cpus=0.5) == "50000"
    with pytest.raises(rpycdl.InvalidRequestError, match="cpus="):
        conn.root.run_code(quota, cpus=10_000)


def test_what_a_job_daemonized_into_a_new_session_dies_at_its_end(server, connect):
    def daemon(_: None) -> int:
        import os
        import time

        read, write = os.pipe()
        if os.fork() == 0:  # double fork, a new session, a clean environment: nothing names the job
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                os.execve("/bin/sleep", ["sleep", "300"], {})
            os._exit(0)
        time.sleep(0.2)
        return int(os.read(read, 32))

    conn = connect(server("pytorch", "fake:1"))
    pid = conn.root.run_code(daemon)
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z",
               5, "the job's daemon to be killed")


def test_a_job_cannot_open_the_device_node_of_a_gpu_it_was_not_granted(server, connect, tmp_path):
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for minor in (0, 1):
        os.mknod(nodes / f"nvidia{minor}", 0o666 | stat.S_IFCHR, os.makedev(devices.NVIDIA_MAJOR, minor))

    def open_nodes(where: str) -> dict[str, str]:
        import errno
        import os

        seen = {}
        for minor in (0, 1):
            try:
                os.close(os.open(f"{where}/nvidia{minor}", os.O_RDWR))
                seen[str(minor)] = "opened"
            except OSError as exc:
                seen[str(minor)] = errno.errorcode[exc.errno]
        return {"granted": os.environ["CUDA_VISIBLE_DEVICES"], **seen}

    conn = connect(server("pytorch", "fake:2"))
    seen = conn.root.run_code(open_nodes, str(nodes))
    granted, other = seen["granted"], str(1 - int(seen["granted"]))
    assert seen[other] == errno.errorcode[errno.EPERM], seen  # the cgroup refuses it
    assert seen[granted] != errno.errorcode[errno.EPERM], seen  # no driver here: ENXIO, but not refused


def test_a_job_with_a_private_tmp_sees_nothing_of_the_hosts_and_leaves_nothing(server, connect):
    planted = Path("/tmp") / f"rpycdl-host-{uuid.uuid4().hex}"
    planted.write_text("the host's")

    def look(name: str) -> dict[str, object]:
        import os

        with open(f"/tmp/{name}-mine", "w") as mine:
            mine.write("the job's")
        return {"planted": os.path.exists(f"/tmp/{name}"), "tmpdir": os.environ["TMPDIR"],
                "shm": sorted(os.listdir("/dev/shm")), "files": sorted(os.listdir("/tmp"))}

    try:
        conn = connect(server("pytorch", "fake:1", "--job-tmp", "64MiB"))
        seen = conn.root.run_code(look, planted.name)
        assert seen["planted"] is False and seen["tmpdir"] == "/tmp" and seen["shm"] == []
        assert f"{planted.name}-mine" in seen["files"]  # type: ignore[operator]
        assert not Path(f"{planted}-mine").exists()  # gone with the job, never on the host
        again = conn.root.run_code(look, "second")
        assert f"{planted.name}-mine" not in again["files"]  # type: ignore[operator]
    finally:
        planted.unlink()


def test_a_jobs_usage_is_in_the_ledger(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    job = conn.root.submit(touch, 100 << 20)
    assert job.wait(60).state == rpycdl.JobState.SUCCEEDED
    row = job.refresh()
    assert row["peak_memory"] >= 100 << 20 and row["cpu_seconds"] >= 0.3 and row["max_procs"] >= 1, row


def test_the_server_says_how_it_fences_and_the_monitor_which_live(server, connect, cluster):
    conn = connect(server("pytorch", "fake:1", "--job-tmp", "auto"))
    fencing = conn.root.gpu_status()["server"]["fencing"]
    assert fencing.startswith("cgroup v") and "memory" in fencing and fencing.endswith("private /tmp")
    _, base = cluster.add_monitor("fake:1")
    kind = fencing.split(" (")[0]
    assert scrape(base)["rpycdl_fencing_info"] == [({"fencing": kind}, 1.0)]
    connect(server("pytorch", "fake:1", "--no-fence"))
    both = [({"fencing": kind}, 1.0), ({"fencing": "none"}, 1.0)]
    wait_until(lambda: scrape(base)["rpycdl_fencing_info"] == both, what="the monitor to see both servers")


def test_cgroups_of_jobs_are_removed_at_their_end(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    found = cgroups.detect()
    assert not isinstance(found, str)
    name = conn.root.run_code(lambda _: next(line.rsplit("/", 1)[1] for line in open("/proc/self/cgroup")
                                             if "/rpycdl/job-" in line))
    base = next(iter(found.bases.values()))
    wait_until(lambda: not (base / name).exists(), 5, "the job's cgroup to be removed")


def test_on_cgroup_v2_a_device_program_refuses_the_nodes_it_names(tmp_path):
    """The v2 path on the host's cgroup v2 mount (this machine's controllers may be on v1: the device program needs
    none), with the code a v2 host runs: a job's cgroup made, joined, limited to no node of minor 1, removed."""
    unified = next((point for point, kind, _ in cgroupfs.mounts() if kind == "cgroup2"), None)
    if unified is None:
        unavailable("no cgroup v2 hierarchy is mounted here", "mount cgroup2 (as most hosts do)")
    own = cgroupfs.own_paths().get("", "/").lstrip("/")
    base = Path(unified) / own / f"rpycdl-test-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    nodes = tmp_path / "dev"
    nodes.mkdir()
    for minor in (0, 1):
        os.mknod(nodes / f"nvidia{minor}", 0o666 | stat.S_IFCHR, os.makedev(devices.NVIDIA_MAJOR, minor))
    try:
        job = cgroups.Hierarchy(2, {"": base}).create("job-1-1-0")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            seen = []
            try:
                job.join()
                job.limit(cgroups.Limits(deny=((devices.NVIDIA_MAJOR, 1),)))
                for minor in (0, 1):
                    try:
                        os.close(os.open(nodes / f"nvidia{minor}", os.O_RDWR))
                        seen.append("opened")
                    except OSError as exc:
                        seen.append(errno.errorcode[exc.errno])
                os.close(os.open("/dev/null", os.O_RDWR))
                seen.append("null")
            finally:
                os.write(write, ",".join(seen).encode())
                os._exit(0)
        os.close(write)
        told = os.read(read, 1024).decode().split(",")
        os.waitpid(pid, 0)
        assert told == ["ENXIO", "EPERM", "null"], told  # minor 0: allowed (no driver here); minor 1: refused
        assert job.pids() == set()
        job.remove()
        assert not (base / "job-1-1-0").exists()
    finally:
        base.rmdir()


def test_on_cgroup_v2_a_cgroup_with_processes_hands_its_controllers_down_once_they_move_to_a_leaf():
    """cgroup v2 lets a cgroup other than the root enable controllers for its children only once it holds no
    processes (the lent GPU machine's server sat in such a cgroup, and its jobs got no memory limit). Here a cgroup
    holding a process and its children, on the host's v2 mount, with a controller v1 does not hold."""
    unified = next((point for point, kind, _ in cgroupfs.mounts() if kind == "cgroup2"), None)
    root = Path(unified or "/nonexistent")
    available = (root / "cgroup.controllers").read_text().split() if unified else []
    free = [c for c in ("hugetlb", "rdma", "misc", "io", "cpuset") if c in available]
    if not free:
        unavailable("no controller is free on a cgroup v2 mount here", "a host with a cgroup v2 controller not on v1")
    controller = free[0]
    was = (root / "cgroup.subtree_control").read_text().split()
    (root / "cgroup.subtree_control").write_text(f"+{controller}")  # the root may, processes or not
    own = root / f"rpycdl-test-{uuid.uuid4().hex[:8]}"
    own.mkdir()
    holder = subprocess.Popen(["sh", "-c", f"echo $$ > {own}/cgroup.procs; sleep 60 & exec sleep 60"])
    try:
        wait_until(lambda: len((own / "cgroup.procs").read_text().split()) == 2, 10, "the holder and its child")
        with pytest.raises(OSError) as refused:
            (own / "cgroup.subtree_control").write_text(f"+{controller}")
        assert refused.value.errno == errno.EBUSY  # the kernel's rule the move answers
        cgroupfs.delegate(own, [controller])
        assert (own / "cgroup.procs").read_text().split() == []
        assert len((own / cgroupfs.LEAF / "cgroup.procs").read_text().split()) == 2
        assert controller in (own / "cgroup.subtree_control").read_text().split()
        job = own / "job"
        job.mkdir()
        assert controller in (job / "cgroup.controllers").read_text().split()  # what a job's cgroup now gets
        job.rmdir()
    finally:
        holder.kill()
        holder.wait()
        procs_left = lambda: [p for d in (own, own / cgroupfs.LEAF) if d.is_dir()  # noqa: E731
                              for p in (d / "cgroup.procs").read_text().split()]
        for pid in procs_left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        wait_until(lambda: not procs_left(), 10, "the holder's processes to end")
        for where in (own / cgroupfs.LEAF, own):
            if where.is_dir():
                where.rmdir()
        if controller not in was:
            (root / "cgroup.subtree_control").write_text(f"-{controller}")


def test_a_server_with_no_fence_fences_nothing(server, connect):
    conn = connect(server("pytorch", "fake:1", "--no-fence"))
    assert conn.root.gpu_status()["server"]["fencing"] == "none (--no-fence)"
    cgroup = conn.root.run_code(lambda _: open("/proc/self/cgroup").read())
    assert "/rpycdl/job-" not in cgroup
    detached = conn.root.submit(lambda _: open("/proc/self/cgroup").read())  # its supervisor is told too
    assert detached.wait(60).state is rpycdl.JobState.SUCCEEDED and "/rpycdl/job-" not in detached.result()
    assert conn.root.run_code(touch, 512 << 20, memory="256MiB") == 512 << 20  # asked, but not held to it


def test_a_command_over_its_memory_fails_naming_its_limit(server):
    port = server("pytorch", "fake:1")
    hog = "m = bytearray(1 << 30)\nfor i in range(0, len(m), 4096): m[i] = 1"
    ran = rpycdl_cli("run", "pytorch", "--host", "127.0.0.1", "--port", str(port), "--memory", "200MiB", "--",
                     sys.executable, "-c", hog, timeout=120)
    assert ran.returncode != 0 and "killed the command (SIGKILL) at its job's memory limit" in ran.stderr, ran.stderr
    assert "its limit (200 MiB)" in ran.stderr and "--memory" in ran.stderr
    conn = rpycdl.connect(host="127.0.0.1", port=port)
    try:  # the same submitted: its row says so
        job = conn.root.submit_command([sys.executable, "-c", hog], memory="200MiB")
        assert job.wait(60).state is rpycdl.JobState.FAILED
        row = job.refresh()
        assert row["error_type"] == "HostMemoryExceededError" and "200 MiB" in row["error"], row
    finally:
        conn.close()


def test_the_gpu_self_tests_memory_check_passes_on_a_fencing_server_and_says_so_elsewhere(server, connect):
    from rpycdl.site import selfchecks

    port = server("pytorch", "fake:1")
    fencing = connect(port).root.gpu_status()["server"]["fencing"]
    assert selfchecks.fenced_memory(port, fencing).startswith("stopped: job ")
    assert "nothing to check" in selfchecks.fenced_memory(port, "none (not root)")


def _daemonizer():  # nested, so that dill sends it by value
    def daemonizing(where: str) -> None:
        """Runs on the server: starts a daemon (a double fork into a new session, exec'd with an empty environment:
        nothing of it names its job), says where things are, and waits."""
        import json
        import os
        import time

        read, write = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(write, str(os.getpid()).encode())
                os.execve("/bin/sleep", ["sleep", "300"], {})
            os._exit(0)
        daemon = int(os.read(read, 32))
        cgroup = next(line.rsplit("/", 1)[1] for line in open("/proc/self/cgroup") if "/rpycdl/job-" in line)
        with open(f"{where}.tmp", "w") as out:
            json.dump({"daemon": daemon, "keeper": os.getppid(), "cgroup": cgroup}, out)
        os.rename(f"{where}.tmp", where)
        time.sleep(300)

    return daemonizing


_daemonizing = _daemonizer()


def test_a_jobs_daemon_dies_through_its_cgroup_when_the_server_its_forkserver_and_its_keeper_are_killed(
        cluster, connect, tmp_path):
    """kill -9 of the server parent, its forkserver and the job's keeper: the job's daemon, which nothing else
    would find (adopted by init, no variable naming its job), is killed through the job's cgroup by the connection
    process, which notices, and the cgroup is removed."""
    _, port = cluster.add_server("pytorch", "fake:1")
    parent = server_pid(cluster, port)
    conn = connect(port)
    where = tmp_path / "daemon.json"
    threading.Thread(target=lambda: _swallow(lambda: conn.root.run_code(_daemonizing, str(where))),
                     daemon=True).start()
    info = json.loads(wait_until(lambda: where.exists() and where.read_text(), 20, "the job's daemon"))
    for pid in (parent, forkserver(parent), info["keeper"]):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not running(info["daemon"]), 5, "the job's daemon to be killed")
    found = cgroups.detect()
    assert not isinstance(found, str)
    wait_until(lambda: not any((base / info["cgroup"]).exists() for base in found.bases.values()), 5,
               "the job's cgroup to be removed")


def _swallow(call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException:  # noqa: BLE001, S110 - its connection dies in this test, as planned
        pass


def test_a_sessions_call_over_its_memory_ends_the_session_naming_its_limit(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    with pytest.raises(rpycdl.HostMemoryExceededError, match=r"256 MiB.*its memory="):  # it ends the session
        with conn.root.session(memory="256MiB") as session:
            assert session.run(touch, 16 << 20) == 16 << 20
            session.run(touch, 1 << 30)
    assert conn.root.run_code(touch, 16 << 20) == 16 << 20  # the next job runs
