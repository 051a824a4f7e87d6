"""Servers inside a confinement, as a Kubernetes pod or a Slurm job starts them: real `rpycdl serve` processes
on the fake NVML driver (tests/fake_nvml_driver.py) with CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES set
manage exactly the GPUs these leave them, share the lock directory with other servers by UUID, and give
their jobs the indices CUDA counts there."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from fake_nvml import Device
from helpers import Background, gate_job, open_gate, wait_until

import rpycdl
from rpycdl import InvalidRequestError, JobState
from rpycdl.site.local import Process, one_account, start
from rpycdl.site.selftest import confined

UUIDS = [f"GPU-{i}{i}{i}{i}cafe-0000-4000-8000-00000000000{i}" for i in range(4)]


def gpu_env(_):
    import os

    return {name: os.environ[name] for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NV_GPU",
                                                "NVIDIA_VISIBLE_DEVICES", "RPYCDL_GPU_UUIDS")}


def driver(state: Path, denied: tuple[int, ...] = ()) -> dict[str, str]:
    """The environment that has a process use the fake driver, its four GPUs in `state`, `denied` ones kept
    from it as by a cgroup."""
    state.write_text(json.dumps([asdict(Device(uuid, bus_id=f"00000000:{16 + i:02X}:00.0", denied=i in denied))
                                 for i, uuid in enumerate(UUIDS)]))
    return {"RPYCDL_NVML_MODULE": "fake_nvml_driver", "FAKE_NVML_STATE": str(state),
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def node(tmp_path, monkeypatch, cluster) -> Callable[..., Process]:
    """node(denied=(), **confinement) starts `rpycdl serve --gpus nvml` on a host of four GPUs played by the
    fake driver, `denied` ones kept from it, with the confinement's variables set."""
    for variable in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)

    def serve(denied: tuple[int, ...] = (), **confinement: str) -> Process:
        env = {**driver(tmp_path / f"nvml-{len(cluster.processes)}.json", denied), **confinement}
        process = start(["serve", "--service", "pytorch", "--gpus", "nvml", "--host", "127.0.0.1", "--port", "0",
                         "--registry", cluster.registry_address, "--lock-dir", cluster.lock_dir, *one_account()],
                        env=env)
        cluster.processes.append(process)  # stopped with the cluster
        return process

    return serve


@pytest.fixture
def port_of() -> Iterator[Callable[[Process], int]]:
    yield lambda process: int(process.wait_for(r"on 127\.0\.0\.1:(\d+) as").group(1))


def _gpus(conn: rpycdl.Connection) -> list[tuple[int, str]]:
    return [(gpu["index"], gpu["uuid"]) for gpu in conn.root.gpu_status()["gpus"]]


def test_a_slurm_job_without_device_cgroups_manages_its_gpus_by_their_host_index(node, port_of, connect):
    conn = connect(port_of(node(CUDA_VISIBLE_DEVICES="3,1")))
    assert _gpus(conn) == [(1, UUIDS[1]), (3, UUIDS[3])]
    env = conn.root.run_code(gpu_env, None, ngpus=-1)
    assert env == {"CUDA_VISIBLE_DEVICES": "1,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NV_GPU": f"{UUIDS[1]},{UUIDS[3]}",
                   "NVIDIA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[3]}", "RPYCDL_GPU_UUIDS": f"{UUIDS[1]},{UUIDS[3]}"}
    with pytest.raises(InvalidRequestError, match="3 GPU"):
        conn.root.run_code(gpu_env, None, ngpus=3, queue_timeout=5)
    job = conn.root.submit(gpu_env, None, ngpus=1)  # its supervisor reads the inventory again, as confined
    assert job.wait(30).state is JobState.SUCCEEDED
    assert job.result()["CUDA_VISIBLE_DEVICES"] in ("1", "3")


def test_a_slurm_job_with_device_cgroups_gives_its_jobs_the_indices_cuda_counts_there(node, port_of, connect):
    """NVML counts the host's four GPUs but may open only 1 and 3; CUDA there sees two, 0 and 1, and so
    must a job's CUDA_VISIBLE_DEVICES count."""
    conn = connect(port_of(node(denied=(0, 2), CUDA_VISIBLE_DEVICES="0,1")))
    assert _gpus(conn) == [(0, UUIDS[1]), (1, UUIDS[3])]
    env = conn.root.run_code(gpu_env, None, ngpus=-1)
    assert (env["CUDA_VISIBLE_DEVICES"], env["NVIDIA_VISIBLE_DEVICES"]) == ("0,1", f"{UUIDS[1]},{UUIDS[3]}")


def test_confined_servers_share_the_lock_directory_by_uuid(node, port_of, connect, tmp_path):
    """Two pods of one node given two GPUs each, and a server that sees all four: the pods' jobs run side by
    side on their own GPUs, and the third server's job waits for a GPU they hold."""
    first = connect(port_of(node(CUDA_VISIBLE_DEVICES="0,1")))
    second = connect(port_of(node(NVIDIA_VISIBLE_DEVICES=f"{UUIDS[2]},{UUIDS[3]}")))
    whole = connect(port_of(node()))
    assert _gpus(second) == [(2, UUIDS[2]), (3, UUIDS[3])] and len(_gpus(whole)) == 4
    gate = str(tmp_path / "gate")
    jobs = [Background(conn, gate_job(gate), None, ngpus=2) for conn in (first, second)]
    for job in jobs:
        job.wait_state("running", 15)  # both at once, neither waiting for the other
    waiting = Background(whole, gpu_env, None, ngpus=1)
    waiting.wait_state("pending", 15)
    open_gate(gate)
    assert [job.result(30) for job in jobs] == [None, None]
    assert waiting.result(30)["RPYCDL_GPU_UUIDS"] in UUIDS


@pytest.mark.parametrize("confinement, words", [
    ({"CUDA_VISIBLE_DEVICES": "MIG-a1b2c3d4-0000-4000-8000-000000000000"}, "names the MIG device"),
    ({"NVIDIA_VISIBLE_DEVICES": "none"}, "leave no GPU here"),
    ({"CUDA_VISIBLE_DEVICES": "4"}, "'4' names no GPU here (this process may use 4 GPU(s)"),
])
def test_a_server_refuses_a_confinement_it_cannot_honour_in_one_line(node, confinement, words):
    process = node(**confinement)
    assert process.popen.wait(30) == 1
    wait_until(lambda: any(words in line for line in process.lines), 5, f"the server to say {words!r}")
    assert not any("Traceback" in line for line in process.lines), process.lines


def torch_as_the_driver_shows_it(_):
    """What the self-test's PyTorch job reports, as CUDA would show the job its GPUs: those it was granted."""
    import os

    granted = os.environ["RPYCDL_GPU_UUIDS"]
    return {"count": len(granted.split(",")), "uuid": granted, "granted": granted,
            "visible": os.environ["CUDA_VISIBLE_DEVICES"]}


@pytest.mark.parametrize("denied, confinement, said", [
    ((), {"CUDA_VISIBLE_DEVICES": "2"}, f"GPU 2 {UUIDS[2]} listed alone; the job saw it as CUDA_VISIBLE_DEVICES=2"),
    ((0, 2), {"CUDA_VISIBLE_DEVICES": "1"}, f"GPU 1 {UUIDS[3]} listed alone"),
    ((), {"NVIDIA_VISIBLE_DEVICES": UUIDS[1]}, f"GPU 1 {UUIDS[1]} listed alone"),
])
def test_the_selftest_checks_a_confined_server(tmp_path, monkeypatch, lock_dir, denied, confinement, said):
    for variable, value in driver(tmp_path / "nvml.json", denied).items():
        monkeypatch.setenv(variable, value)
    assert said in confined(lock_dir, confinement, torch_as_the_driver_shows_it)


def test_the_selftests_confinement_check_can_fail(tmp_path, monkeypatch, lock_dir):
    def sees_two(_):  # as a job on a server whose mapping were wrong would
        return {**torch_as_the_driver_shows_it(None), "count": 2}

    for variable, value in driver(tmp_path / "nvml.json").items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(AssertionError, match="'count': 2"):
        confined(lock_dir, {"CUDA_VISIBLE_DEVICES": "0"}, sees_two)
