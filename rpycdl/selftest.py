"""`rpycdl selftest`: checks the NVML path end to end on a machine with real GPUs, and prints a report."""

from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import rpycdl
from rpycdl.gpus import GPU, NvmlInventory
from rpycdl.local import LocalCluster


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
        gpus = NvmlInventory().gpus()
    except Exception as exc:  # noqa: BLE001
        report.say(f"FAIL  NVML inventory: {exc}")
        return 1

    def inventory_matches_smi() -> str:
        smi = _nvidia_smi()
        assert len(smi) == len(gpus), f"NVML sees {len(gpus)} GPUs, nvidia-smi {len(smi)}"
        for gpu, row in zip(gpus, smi, strict=True):
            assert (str(gpu.index), gpu.uuid, gpu.name) == (row["index"], row["uuid"], row["name"]), (gpu, row)
            assert abs(gpu.memory_total / 2**20 - float(row["memory_mib"])) < 2, (gpu, row)
        return "; ".join(f"{g.index} {g.uuid} {g.name} {g.memory_total / 2**30:.1f} GiB" for g in gpus)

    report.check("NVML inventory equals nvidia-smi", inventory_matches_smi)
    with tempfile.TemporaryDirectory(prefix="rpycdl-selftest-") as lock_dir, LocalCluster(lock_dir) as cluster:
        _, port = cluster.add_server("pytorch", "nvml")
        report.check("PyTorch job with ngpus=1 sees exactly its GPU", lambda: _one_gpu(port, gpus))
        report.check(f"{len(gpus) + 1} one-GPU jobs on {len(gpus)} GPU(s): the last waits, then runs",
                     lambda: _last_waits(port, len(gpus)))
    report.say(f"{len(report.lines) - 1 - report.failed} passed, {report.failed} failed")
    if report_path:
        with open(report_path, "w", encoding="utf-8") as out:
            out.write("\n".join(report.lines) + "\n")
    return 1 if report.failed else 0


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
