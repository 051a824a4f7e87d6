"""Jobs fenced in (a root server: a cgroup per job, a private /tmp when asked): host memory, processes, CPU and GPU
device nodes bounded, everything a job started killed at its end however it daemonized, its usage in the ledger.
Each job attacks its fence from inside, as a job of another user would."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

import pytest
from helpers import unavailable, wait_until

import rpycdl
from rpycdl.security import cgroups


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
        os.mknod(nodes / f"nvidia{minor}", 0o666 | stat.S_IFCHR, os.makedev(cgroups.NVIDIA_MAJOR, minor))

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


def test_the_server_says_how_it_fences(server, connect):
    conn = connect(server("pytorch", "fake:1", "--job-tmp", "auto"))
    fencing = conn.root.gpu_status()["server"]["fencing"]
    assert fencing.startswith("cgroup v") and "memory" in fencing and fencing.endswith("private /tmp")


def test_cgroups_of_jobs_are_removed_at_their_end(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    found = cgroups.detect()
    assert not isinstance(found, str)
    name = conn.root.run_code(lambda _: next(line.rsplit("/", 1)[1] for line in open("/proc/self/cgroup")
                                             if "/rpycdl/job-" in line))
    base = next(iter(found.bases.values()))
    wait_until(lambda: not (base / name).exists(), 5, "the job's cgroup to be removed")
