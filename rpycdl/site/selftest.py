"""`rpycdl selftest`: checks the NVML path end to end on a machine with real GPUs, and prints a report."""

from __future__ import annotations

import io
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import rpycdl
from rpycdl import errors
from rpycdl.defaults import ENV_CUDA_VISIBLE, ENV_NVIDIA_VISIBLE
from rpycdl.gpu.inventory import GPU, NvmlInventory
from rpycdl.scheduler.load import read_load
from rpycdl.site import selfchecks
from rpycdl.site.local import LocalCluster, one_account, start


def _nvidia_smi() -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        raise RuntimeError("nvidia-smi is not on PATH")
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"],
                         check=True, capture_output=True, text=True).stdout
    rows = [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]
    return [{"index": r[0], "uuid": r[1], "name": r[2], "memory_mib": r[3]} for r in rows]


def _torch_job(_: Any) -> dict[str, Any]:
    """Runs on the server: what PyTorch sees with the granted GPUs."""
    import os

    import torch

    props = torch.cuda.get_device_properties(0)
    uuid = str(getattr(props, "uuid", ""))
    x = torch.ones(1024, 1024, device="cuda")
    return {"count": torch.cuda.device_count(), "uuid": uuid, "granted": os.environ["RPYCDL_GPU_UUIDS"],
            "visible": os.environ["CUDA_VISIBLE_DEVICES"], "sum": float((x @ x).sum()), "torch": torch.__version__}


def _quarter_job(seconds: float) -> dict[str, Any]:
    """Runs on the server with a share of a GPU: holds a 1 GiB tensor for `seconds`."""
    import os
    import time

    import torch

    held = torch.ones(2**30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer PyTorch only
    return {"uuid": str(getattr(torch.cuda.get_device_properties(0), "uuid", "")),
            "granted": os.environ["RPYCDL_GPU_UUIDS"], "grant": int(os.environ["RPYCDL_GPU_MEMORY"]),
            "fraction": get_fraction(0) if get_fraction else None, "start": start, "end": end,
            "held": held.numel()}


def _over_grant_torch_job(_: Any) -> dict[str, Any]:
    """Runs on the server with a share of a GPU: half its grant fits, then three quarters more must
    not (PyTorch's own out-of-memory error, before any memory is taken from CUDA)."""
    import os

    import torch

    grant = int(os.environ["RPYCDL_GPU_MEMORY"])
    first = torch.empty(grant // 2, dtype=torch.uint8, device="cuda")
    try:
        second = torch.empty(grant // 4 * 3, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as exc:
        return {"oom": True, "grant": grant, "first": first.numel(), "message": str(exc).strip().splitlines()[0][:300]}
    return {"oom": False, "grant": grant, "first": first.numel(), "second": second.numel()}


def _find_cudart() -> str:
    """Path of a CUDA runtime library in this process's reach: the one PyTorch loaded, else one
    installed beside it (pip's nvidia-cuda-runtime package, or torch/lib), else the system's."""
    import ctypes.util
    import glob
    import os

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcudart" in path and ".so" in path:
                    return path
        package = os.path.dirname(torch.__file__)
        for pattern in (f"{os.path.dirname(package)}/nvidia/*/lib/libcudart.so*",  # pip's nvidia-cuda-runtime
                        f"{package}/lib/libcudart*.so*"):
            found = sorted(glob.glob(pattern))
            if found:
                return found[0]
    name = ctypes.util.find_library("cudart")
    if name is None:
        raise RuntimeError("no CUDA runtime library (libcudart) found")
    return name


def _raw_alloc_job(seconds: float) -> str:
    """Runs on the server with a share of a GPU: takes well past its grant (half as much again, and
    at least 2 GiB more: past the watchdog's default allowance of 1 GiB plus the CUDA context)
    outside any framework's cap (CuPy with its limit removed, else cudaMalloc through ctypes),
    says how on stdout, and holds it for `seconds`: the watchdog must stop it first."""
    import ctypes
    import os
    import time

    grant = int(os.environ["RPYCDL_GPU_MEMORY"])
    size = grant + max(grant // 2, 2 * 2**30)
    os.environ.pop("CUPY_GPU_MEMORY_LIMIT", None)  # read when CuPy creates its memory pool
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        method = f"CuPy {cupy.__version__} without CUPY_GPU_MEMORY_LIMIT"
        held = cupy.empty(size, dtype=cupy.uint8)  # cudaMalloc: device memory is taken at once
    else:
        path = _find_cudart()
        cudart = ctypes.CDLL(path)
        cudart.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        cudart.cudaMalloc.restype = ctypes.c_int
        held = ctypes.c_void_p()
        status = cudart.cudaMalloc(ctypes.byref(held), size)
        if status != 0:
            raise RuntimeError(f"cudaMalloc({size}) failed with CUDA error {status}")
        method = f"cudaMalloc from {path}"
    print(f"method: {method}; allocated {size} bytes", flush=True)
    time.sleep(seconds)
    del held  # held until here
    return f"still running after {seconds:g} s holding {size} bytes with {method}"


def _hold_job(seconds: float) -> tuple[float, float]:
    import time as t

    start = t.time()
    t.sleep(seconds)
    return start, t.time()


class Report:
    """Checks and their outcomes, printed as they happen."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failed = 0

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)

    def check(self, name: str, fn: Callable[[], str]) -> None:
        try:
            detail = fn()
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, not raised
            self.failed += 1
            self.say(f"FAIL  {name}: {type(exc).__name__}: {exc}")
        else:
            self.say(f"ok    {name}: {detail}")


def run_selftest(report_path: str | None = None) -> int:
    """Run every check; returns 0 when all passed."""
    report = Report()
    report.say(f"rpycdl {rpycdl.__version__} self-test on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, "
               f"Python {platform.python_version()}")
    try:
        every = NvmlInventory(environ={}).gpus()  # as nvidia-smi, which no *_VISIBLE_DEVICES restricts
        gpus = NvmlInventory().gpus()  # as this process's servers: confined, if this process is
    except Exception as exc:  # noqa: BLE001
        report.say(f"FAIL  NVML inventory: {exc}")
        return 1

    def inventory_matches_smi() -> str:
        smi = _nvidia_smi()
        assert len(smi) == len(every), f"NVML sees {len(every)} GPUs, nvidia-smi {len(smi)}"
        for gpu, row in zip(every, smi, strict=True):
            assert (str(gpu.index), gpu.uuid, gpu.name) == (row["index"], row["uuid"], row["name"]), (gpu, row)
            assert abs(gpu.memory_total / 2**20 - float(row["memory_mib"])) < 2, (gpu, row)
        return "; ".join(f"{g.index} {g.uuid} {g.name} {g.memory_total / 2**30:.1f} GiB" for g in every)

    report.check("NVML inventory equals nvidia-smi", inventory_matches_smi)
    with tempfile.TemporaryDirectory(prefix="rpycdl-selftest-") as lock_dir, LocalCluster(lock_dir) as cluster:
        for variable, value in ((ENV_CUDA_VISIBLE, str(gpus[-1].index)), (ENV_NVIDIA_VISIBLE, gpus[0].uuid)):
            report.check(f"a server started with {variable}={value} manages that GPU alone, and a PyTorch job "
                         "there sees it", lambda confinement={variable: value}: confined(lock_dir, confinement))
        server, port = cluster.add_server("pytorch", "nvml")
        report.check("PyTorch job with ngpus=1 sees exactly its GPU", lambda: _one_gpu(port, gpus))
        report.check(f"{len(gpus) + 1} one-GPU jobs on {len(gpus)} GPU(s): the last waits, then runs",
                     lambda: _last_waits(port, len(gpus)))
        report.check("two PyTorch jobs with gpus=0.25 run at the same time on one GPU", lambda: _quarters_share(port))
        report.check("a PyTorch job allocating past its gpus=0.25 grant gets PyTorch's out-of-memory error",
                     lambda: _torch_oom(port))
        report.check("a job allocating past its gpus=0.25 grant outside PyTorch is stopped by the watchdog",
                     lambda: _watchdog_stops(port))
        report.check("a detached PyTorch job runs to its end and its result is kept", lambda: _detached(port))
        report.check("under --placement least-busy, a second compute-heavy share avoids the GPU the first keeps busy "
                     "(where there is another)", lambda: _least_busy(gpus))
        report.check("a CUDA call through run_code on a server whose forkserver preloaded torch",
                     lambda: selfchecks.preloaded_cuda_call(port, server.popen.pid))
        report.check("CUDA calls on a warm session find what its first call left on the GPU",
                     lambda: selfchecks.warm_session(port))
        report.check("a job of a second account sees exactly its GPU", lambda: selfchecks.second_account(gpus))
        report.check("a job reaching a GPU it was not granted is stopped by the watchdog",
                     lambda: selfchecks.reaching_another_gpu(port, gpus))
        fencing = next(line for line in server.lines if "fencing: " in line).split("fencing: ")[1].split(";")[0]
        report.check("a job that resets CUDA_VISIBLE_DEVICES sees only its GPU (its cgroup's device rules)",
                     lambda: selfchecks.fenced_devices(port, fencing))
        report.check("a job over its memory= is stopped, naming its limit",
                     lambda: selfchecks.fenced_memory(port, fencing))
        monitor = cluster.add_monitor("nvml")[1]
        report.check("the monitor's /metrics shows NVML's memory and utilisation of every GPU",
                     lambda: _monitor_sees_nvml(monitor, gpus))
    report.say(f"{len(report.lines) - 1 - report.failed} passed, {report.failed} failed")
    if report_path:
        with open(report_path, "w", encoding="utf-8") as out:
            out.write("\n".join(report.lines) + "\n")
    return 1 if report.failed else 0


def _busy_job(seconds: float) -> dict[str, Any]:
    """Runs on the server with a share of a GPU: keeps its SMs busy with matrix products for `seconds`."""
    import os
    import time

    import torch

    x = torch.randn(4096, 4096, device="cuda")
    start = time.time()
    while time.time() - start < seconds:
        x = torch.tanh(x @ x)
        torch.cuda.synchronize()
    return {"granted": os.environ["RPYCDL_GPU_UUIDS"], "start": start, "end": time.time()}


def _least_busy(gpus: list[GPU]) -> str:
    """A server of its own lock directory with --placement least-busy: one compute-heavy share, then, once the
    sampler has seen its GPU busy, a second one; where each was placed, and the loads the sampler saw."""
    with tempfile.TemporaryDirectory(prefix="rpycdl-selftest-placement-") as lock_dir:
        process = start(["serve", "--service", "pytorch", "--gpus", "nvml", "--host", "127.0.0.1", "--port", "0",
                         "--registry", "none", "--lock-dir", lock_dir, "--placement", "least-busy", *one_account()])
        try:
            port = int(process.wait_for(r"on 127\.0\.0\.1:(\d+) as").group(1))
            with rpycdl.connect(host="127.0.0.1", port=port) as conn:
                first = conn.root.submit(_busy_job, 20.0, gpus=0.25)
                deadline, seen = time.monotonic() + 15, {}
                while time.monotonic() < deadline and max(seen.values(), default=0.0) < 0.5:
                    time.sleep(0.5)
                    seen = read_load(lock_dir, time.time())
                second = conn.root.submit(_busy_job, 5.0, gpus=0.25)
                placed = [job.result(120)["granted"] for job in (second, first)][::-1]
        finally:
            process.stop()
    loads = ", ".join(f"{uuid}: {busy:.2f}" for uuid, busy in sorted(seen.items()))
    assert max(seen.values(), default=0.0) >= 0.5, f"the sampler never saw the first share's GPU busy ({loads})"
    if len(gpus) > 1:
        assert placed[0] != placed[1], f"both shares on {placed[0]} although the sampler saw {loads}"
    return f"first share on {placed[0]}, second on {placed[1]} ({len(gpus)} GPU(s)); loads seen: {loads}"


def confined(lock_dir: str, confinement: dict[str, str], job: Callable[[Any], dict[str, Any]] = _torch_job) -> str:
    """Start a server on NVML with the `confinement` variables set, as a Slurm job or a pod starts one (one
    GPU by CUDA's index, or by UUID as the container runtime is given it); check that it lists only the GPU
    they name, and that `job` sees that GPU alone; stop it."""
    [(variable, value)] = confinement.items()
    process = start(["serve", "--service", "pytorch", "--gpus", "nvml", "--host", "127.0.0.1", "--port", "0",
                     "--registry", "none", "--lock-dir", lock_dir, *one_account()], env=confinement)
    try:
        port = int(process.wait_for(r"on 127\.0\.0\.1:(\d+) as").group(1))
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            listed = [(gpu["index"], gpu["uuid"]) for gpu in conn.root.gpu_status()["gpus"]]
            seen = conn.root.run_code(job, None, ngpus=1)
    finally:
        process.stop()
    expected = NvmlInventory(environ={**os.environ, **confinement}).gpus()  # the server's environment
    assert listed == [(gpu.index, gpu.uuid) for gpu in expected] and len(listed) == 1, \
        f"{variable}={value}: the server lists {listed}"
    uuid = listed[0][1]
    assert seen["count"] == 1 and seen["granted"] == uuid and uuid.endswith(seen["uuid"].removeprefix("GPU-")), seen
    assert seen["visible"] == str(listed[0][0]), seen
    return f"GPU {listed[0][0]} {uuid} listed alone; the job saw it as CUDA_VISIBLE_DEVICES={seen['visible']}"


def _one_gpu(port: int, gpus: list[GPU]) -> str:
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        seen = conn.root.run_code(_torch_job, None, ngpus=1)
    assert seen["count"] == 1, f"torch sees {seen['count']} devices"
    assert seen["uuid"] and seen["granted"].endswith(seen["uuid"].removeprefix("GPU-")), seen
    assert seen["visible"] in {str(g.index) for g in gpus}, seen
    return f"torch {seen['torch']} sees 1 device, UUID {seen['uuid']} = granted {seen['granted']}"


def _last_waits(port: int, count: int) -> str:
    states: dict[int, list[str]] = {}
    spans: dict[int, tuple[float, float]] = {}

    def submit(n: int) -> None:
        with rpycdl.connect(host="127.0.0.1", port=port) as conn:
            spans[n] = conn.root.run_code(_hold_job, 2.0, ngpus=1,
                                         on_state=lambda state, _: states.setdefault(n, []).append(state))

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(count + 1)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join()
    last = count
    assert len(spans) == count + 1, f"only {len(spans)} of {count + 1} jobs returned"
    assert states.get(last, [])[:1] == ["pending"], f"the last job never waited: {states}"
    first_end = min(spans[n][1] for n in range(count))
    assert spans[last][0] >= first_end, f"the last job started before any GPU was released: {spans}"
    return f"job {last} waited ({' -> '.join(states[last])}) and finished after the others"


def _quarters_share(port: int) -> str:
    seen: dict[int, dict[str, Any]] = {}
    failures: list[Exception] = []

    def submit(n: int) -> None:
        try:
            with rpycdl.connect(host="127.0.0.1", port=port) as conn:
                seen[n] = conn.root.run_code(_quarter_job, 3.0, gpus=0.25)
        except Exception as exc:  # noqa: BLE001 - reported by the check
            failures.append(exc)

    threads = [threading.Thread(target=submit, args=(n,)) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    first, second = seen[0], seen[1]
    assert first["granted"] == second["granted"], f"granted different GPUs: {first['granted']}, {second['granted']}"
    assert first["uuid"] and first["uuid"] == second["uuid"], f"PyTorch saw different GPUs: {first}, {second}"
    overlap = min(first["end"], second["end"]) - max(first["start"], second["start"])
    assert overlap > 0, f"the jobs ran one after the other: {first}, {second}"
    return (f"both on {first['granted']}, each holding 1 GiB of a {first['grant'] / 2**30:.1f} GiB grant, "
            f"overlapping for {overlap:.1f} s; PyTorch's memory fraction {first['fraction']}")


def _torch_oom(port: int) -> str:
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        seen = conn.root.run_code(_over_grant_torch_job, None, gpus=0.25)
    assert seen["oom"], f"PyTorch allocated {seen['first'] + seen['second']} bytes on a grant of {seen['grant']}"
    return (f"{seen['first'] / 2**30:.1f} GiB of a {seen['grant'] / 2**30:.1f} GiB grant fit; "
            f"the next {seen['grant'] // 4 * 3 / 2**30:.1f} GiB: {seen['message']}")


def _watchdog_stops(port: int) -> str:
    out = io.StringIO()
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        try:
            value = conn.root.run_code(_raw_alloc_job, 60.0, gpus=0.25, timeout=120, stdout=out)
        except errors.GPUMemoryExceededError as exc:
            stopped = exc
        else:
            raise AssertionError(f"the job was not stopped: {value}")
    said = [line.removeprefix("method: ") for line in out.getvalue().splitlines() if line.startswith("method: ")]
    assert said, f"the job was stopped before it allocated: {stopped}"
    return f"{said[0]}; stopped: {stopped}"


def _detached(port: int) -> str:
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        job = conn.root.submit(_torch_job, None, ngpus=1, name="selftest")
    job = rpycdl.job(job.id, host="127.0.0.1", port=port)  # found again over a new connection
    status = job.wait(120)
    assert status.state is rpycdl.JobState.SUCCEEDED, status
    seen = job.result()
    assert seen["count"] == 1 and seen["granted"].endswith(seen["uuid"].removeprefix("GPU-")), seen
    return f"job {job.id} {status.state.value}, saw {seen['uuid']}"


def _monitor_sees_nvml(url: str, gpus: list[GPU]) -> str:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        families = {family.name: family for family in text_string_to_metric_families(response.read().decode())}

    def by_uuid(name: str) -> dict[str, float]:
        return {sample.labels["uuid"]: sample.value for sample in families[name].samples}

    total, used = by_uuid("rpycdl_gpu_memory_total_bytes"), by_uuid("rpycdl_gpu_memory_used_bytes")
    busy = by_uuid("rpycdl_gpu_utilization_ratio")
    for gpu in gpus:
        assert total.get(gpu.uuid) == gpu.memory_total, (gpu, total)
        assert 0 <= used.get(gpu.uuid, -1) <= gpu.memory_total, (gpu, used)
        assert 0 <= busy.get(gpu.uuid, -1) <= 1, (gpu, busy)
    return "; ".join(f"{g.index}: {used[g.uuid] / 2**30:.2f} GiB used, {busy[g.uuid]:.0%} busy" for g in gpus)
