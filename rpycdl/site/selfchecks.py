"""The self-test's checks of warm starts and of isolation on real GPUs (rpycdl.site.selftest runs them): a
CUDA call through a server whose forkserver preloaded torch, CUDA calls on a warm session, a job of a second
account seeing exactly its GPU, and the watchdog stopping a job that reaches a GPU it was not granted."""

from __future__ import annotations

import os
import pwd
import statistics
import subprocess
import tempfile
import time
from typing import Any

import rpycdl
from rpycdl.gpu.inventory import GPU
from rpycdl.site.local import LocalCluster

_warm: Any = None
"""What a session's first call of warm_session leaves on its GPU (in the session's process)."""

SECOND_ACCOUNT = "rpycdl-selftest"
"""The account the second-account check runs a job as (made if missing)."""


def _cuda_call(_: Any) -> dict[str, Any]:
    """Runs on the server: one small CUDA kernel, and what the job found imported when it started."""
    import os
    import sys

    preloaded = "torch" in sys.modules
    import torch

    x = torch.ones(256, device="cuda")
    return {"preloaded": preloaded, "sum": float(x.sum()), "uid": os.getuid(), "count": torch.cuda.device_count(),
            "granted": os.environ["RPYCDL_GPU_UUIDS"],
            "uuid": str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))}


def _reach_other(indices: list[int]) -> str:
    """Runs on the server with one GPU: points CUDA_VISIBLE_DEVICES at another of the host's GPUs (`indices`)
    before CUDA starts, allocates there and holds it: the watchdog must stop it."""
    import os
    import time

    other = next(index for index in indices if str(index) != os.environ["CUDA_VISIBLE_DEVICES"])
    os.environ["CUDA_VISIBLE_DEVICES"] = str(other)
    import torch

    held = torch.ones(2**28, device="cuda")
    time.sleep(60)
    return f"still running with {held.numel()} floats on GPU {other}"


def _widened(_: Any) -> dict[str, Any]:
    """Runs on the server with one GPU: resets CUDA_VISIBLE_DEVICES before CUDA starts, then says what CUDA sees
    and which of the host's GPU device nodes it may open."""
    import errno
    import os
    import re

    granted = os.environ["CUDA_VISIBLE_DEVICES"]
    del os.environ["CUDA_VISIBLE_DEVICES"]
    import torch

    nodes = {}
    for name in sorted(entry for entry in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", entry)):
        try:
            os.close(os.open(f"/dev/{name}", os.O_RDWR))
            nodes[name] = "opened"
        except OSError as exc:
            nodes[name] = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return {"granted": granted, "count": torch.cuda.device_count(), "nodes": nodes}


def _session_load(_: Any) -> dict[str, Any]:
    """Runs in a session: puts a tensor on the session's GPU, where the next calls find it."""
    import os

    import torch

    global _warm
    _warm = torch.zeros(256, device="cuda")
    return {"count": torch.cuda.device_count(), "granted": os.environ["RPYCDL_GPU_UUIDS"],
            "uuid": str(getattr(torch.cuda.get_device_properties(0), "uuid", ""))}


def _session_step(_: Any) -> float:
    """Runs in a session after _session_load: one small CUDA kernel on the tensor it left, waited for."""
    _warm.add_(1)
    return float(_warm[0])


def forkserver_untouched(server: int) -> str:
    """The server parent and its forkserver hold no GPU device open (promise 6, with a preload)."""
    found = []
    for pid in [server, *(int(child) for child in open(f"/proc/{server}/task/{server}/children").read().split())]:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                found.append(f"{pid}: {target}")
    assert not found, f"GPU devices open in the server or its forkserver: {found}"
    return "no /dev/nvidia* open in the server parent or its forkserver"


def preloaded_cuda_call(port: int, server: int) -> str:
    """Five CUDA calls through run_code on a server whose forkserver preloaded torch; their times."""
    times = []
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        for _ in range(5):
            start = time.perf_counter()
            seen = conn.root.run_code(_cuda_call, None, ngpus=1)
            times.append(time.perf_counter() - start)
            assert seen["preloaded"] and seen["sum"] == 256.0, seen
    untouched = forkserver_untouched(server)
    return (f"torch was imported when each job started; call to result {', '.join(f'{t:.2f}' for t in times)} s "
            f"(target: under 0.6 s); {untouched}")


def warm_session(port: int) -> str:
    """A session with one GPU: a first call loads a tensor onto it, then 20 calls each run a kernel on that
    tensor; the first call's time and the others' median and slowest."""
    with rpycdl.connect(host="127.0.0.1", port=port) as conn, conn.root.session(ngpus=1) as session:
        start = time.perf_counter()
        seen = session.run(_session_load)
        first = time.perf_counter() - start
        times = []
        for step in range(1, 21):
            start = time.perf_counter()
            value = session.run(_session_step)
            times.append(time.perf_counter() - start)
            assert value == step, f"call {step} found the tensor at {value}: the session lost its globals"
    assert seen["count"] == 1 and seen["granted"].endswith(seen["uuid"].removeprefix("GPU-")), seen
    median = statistics.median(times) * 1e3
    return (f"first call (import, CUDA context, tensor) {first:.2f} s; then a CUDA call {median:.2f} ms at the median, "
            f"{max(times) * 1e3:.2f} ms at most, of 20 (target: under 5 ms); the session saw only {seen['granted']}")


def second_account(gpus: list[GPU]) -> str:
    """As root: a server running unverified clients' jobs as a second account (--guest-user); its job runs as
    that account and sees exactly its GPU."""
    if os.geteuid() != 0:
        return "not root: the servers here run every job as one account (nothing to check)"
    try:
        account = pwd.getpwnam(SECOND_ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", SECOND_ACCOUNT], check=True)
        account = pwd.getpwnam(SECOND_ACCOUNT)
    with tempfile.TemporaryDirectory(prefix="rpycdl-selftest-account-") as lock_dir:
        os.chmod(lock_dir, 0o755)
        with LocalCluster(lock_dir) as cluster:
            _, port = cluster.add_server("pytorch", "nvml", "--guest-user", SECOND_ACCOUNT, isolated=True)
            with rpycdl.connect(host="127.0.0.1", port=port) as conn:
                seen = conn.root.run_code(_cuda_call, None, ngpus=1)
    assert seen["uid"] == account.pw_uid, f"the job ran as uid {seen['uid']}, not {SECOND_ACCOUNT}'s"
    assert seen["count"] == 1 and seen["granted"].endswith(seen["uuid"].removeprefix("GPU-")), seen
    return f"a job ran as {SECOND_ACCOUNT} (uid {seen['uid']}) and saw only {seen['granted']}"


def reaching_another_gpu(port: int, gpus: list[GPU]) -> str:
    """A job granted one GPU that widens CUDA_VISIBLE_DEVICES to another is stopped by the watchdog."""
    if len(gpus) < 2:
        return "one GPU: there is no other GPU for a job to reach"
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        try:
            value = conn.root.run_code(_reach_other, [gpu.index for gpu in gpus], ngpus=1, timeout=120)
        except rpycdl.GPUNotGrantedError as exc:
            return f"stopped: {exc}"
    raise AssertionError(f"the job was not stopped: {value}")


def fenced_devices(port: int, fencing: str) -> str:
    """A job granted one GPU that resets CUDA_VISIBLE_DEVICES sees that GPU alone, where the server fences jobs (its
    cgroup refuses the other GPUs' device nodes: on a one-GPU host, there is none to refuse)."""
    if fencing.startswith("none"):
        return f"the server does not fence its jobs ({fencing}): nothing to check"
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        seen = conn.root.run_code(_widened, None, ngpus=1, timeout=120)
    opened = [name for name, what in seen["nodes"].items() if what == "opened"]
    refused = [name for name, what in seen["nodes"].items() if what == "EPERM"]
    assert seen["count"] == 1 and len(opened) == 1 and len(refused) == len(seen["nodes"]) - 1, seen
    return (f"{fencing}: with CUDA_VISIBLE_DEVICES reset, CUDA saw {seen['count']} GPU; device nodes opened "
            f"{opened}, refused {refused or 'none (no other GPU here)'}")


def fenced_memory(port: int, fencing: str) -> str:
    """A job over its memory= (host memory) is stopped, its error naming the limit, where the server fences jobs."""
    if fencing.startswith("none"):
        return f"the server does not fence its jobs ({fencing}): nothing to check"

    def hog(size: int) -> int:
        memory = bytearray(size)
        for offset in range(0, size, 4096):
            memory[offset] = 1
        return size

    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        try:
            conn.root.run_code(hog, 2 << 30, ngpus=1, memory="512MiB", timeout=120)
        except rpycdl.HostMemoryExceededError as exc:
            return f"stopped: {exc}"
    raise AssertionError("a job touching 2 GiB under memory='512MiB' was not stopped")
