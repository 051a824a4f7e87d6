"""GPU inventories: the simulated one (fake:N, fake:NxSIZE) and NVML, played by tests/fake_nvml.py."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND, Device, make_nvml

from rpycdl import InvalidRequestError, NoInventoryError
from rpycdl.gpu.inventory import FakeInventory, NvmlInventory, load_inventory
from rpycdl.site.local import LocalCluster
from rpycdl.units import GiB, format_size, parse_size

# -- the simulated inventory -----------------------------------------------------------------


def test_fake_4_has_four_16_gib_gpus_with_stable_distinct_identities():
    inventory = FakeInventory("fake:4")
    gpus = inventory.gpus()
    assert [gpu.index for gpu in gpus] == [0, 1, 2, 3]
    assert all(gpu.memory_total == 16 * GiB and gpu.name == "Simulated GPU" for gpu in gpus)
    assert len({gpu.uuid for gpu in gpus}) == 4 and all(gpu.uuid.startswith("GPU-") for gpu in gpus)
    assert len({gpu.pci_bus_id for gpu in gpus}) == 4
    assert inventory.simulated and inventory.spec == "fake:4"
    assert inventory.memory_used() == {gpu.uuid: 0 for gpu in gpus}
    # every server given a spec sees the same GPUs, as containers sharing real ones do
    assert [gpu.uuid for gpu in FakeInventory("fake:2").gpus()] == [gpu.uuid for gpu in gpus[:2]]
    assert FakeInventory("fake:4").gpus() == gpus
    assert gpus[0].to_dict()["uuid"] == gpus[0].uuid
    inventory.gpus().clear()  # a copy: the inventory keeps its GPUs
    assert len(inventory.gpus()) == 4


@pytest.mark.parametrize("spec, count, memory", [
    ("fake:2x16GiB", 2, 16 * GiB),
    ("fake:1x512MiB", 1, 512 * 2**20),
    ("fake:3x8GB", 3, 8 * 10**9),
    ("fake:2x1.5GiB", 2, int(1.5 * GiB)),
    ("fake:1x80gib", 1, 80 * GiB),
    ("fake:64", 64, 16 * GiB),
    ("  fake:2  ", 2, 16 * GiB),
])
def test_fake_specs_with_sizes(spec, count, memory):
    gpus = FakeInventory(spec).gpus()
    assert len(gpus) == count
    assert {gpu.memory_total for gpu in gpus} == {memory}


@pytest.mark.parametrize("spec", [
    "fake:", "fake:0", "fake:65", "fake:-1", "fake:x", "fake:two", "fake:2x", "fake:2xlots", "fake:2x16XB",
    "fake:2x0", "fake:2x0GiB", "fake:2:16GiB", "fake:2 x16GiB", "fake4", "fake:2x-1GiB",
])
def test_bad_fake_specs_are_refused_with_a_hint(spec):
    with pytest.raises(InvalidRequestError) as info:
        FakeInventory(spec)
    message = str(info.value)
    assert repr(spec) in message or repr(spec.split("x", 1)[-1]) in message, message
    assert "fake:" in message or "16GiB" in message, message


def test_parse_size():
    assert parse_size("16GiB") == 16 * GiB
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size(" 1024 ") == 1024
    assert parse_size("2TiB") == 2 * 2**40
    for bad in ("lots", "16XB", "-1GiB", "", "GiB"):
        with pytest.raises(InvalidRequestError, match="not a memory size"):
            parse_size(bad)


def test_format_size_says_sizes_in_words_that_parse_size_reads_back():
    cases = {0: "0 B", 1023: "1023 B", 1024: "1 KiB", 512 * 2**20: "512 MiB", GiB: "1 GiB", int(1.5 * GiB): "1.5 GiB",
             8 * GiB: "8 GiB", int(79.6 * GiB): "79.6 GiB", 1024 * GiB: "1 TiB", GiB - 1: "1 GiB"}
    assert {size: format_size(size) for size in cases} == cases
    for size in (512 * 2**20, 8 * GiB, int(1.5 * GiB)):
        assert parse_size(format_size(size)) == size


def test_load_inventory_by_spec_and_from_the_environment(monkeypatch):
    assert len(load_inventory("fake:2").gpus()) == 2
    monkeypatch.setenv("RPYCDL_GPUS", "fake:3x8GiB")
    inventory = load_inventory(None)
    assert inventory.spec == "fake:3x8GiB" and len(inventory.gpus()) == 3
    assert len(load_inventory("fake:1").gpus()) == 1  # an explicit spec wins over the environment
    with pytest.raises(InvalidRequestError, match="unknown GPU inventory 'cuda:0'.*fake:N"):
        load_inventory("cuda:0")


def test_load_inventory_nvml_here():
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        with pytest.raises(NoInventoryError, match=r"--gpus fake:2 \(or RPYCDL_GPUS=fake:2\)"):
            load_inventory("nvml")
    else:  # a machine with a driver: NVML lists what nvidia-smi lists
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        inventory = load_inventory("nvml")
        assert len(inventory.gpus()) == count >= 1 and not inventory.simulated


# -- NVML, played by the fake driver -----------------------------------------------------------


def _devices() -> list[Device]:
    return [
        Device("GPU-11111111-aaaa-bbbb-cccc-000000000000", "NVIDIA H100 80GB HBM3", 80 * GiB, 3 * GiB,
               "00000000:18:00.0"),
        Device("GPU-22222222-aaaa-bbbb-cccc-000000000000", "NVIDIA H100 80GB HBM3", 80 * GiB, 0, "00000000:2A:00.0"),
        Device("GPU-33333333-aaaa-bbbb-cccc-000000000000", "NVIDIA A100-SXM4-40GB", 40 * GiB, 512 * 2**20,
               "00000000:3B:00.0"),
    ]


@pytest.mark.parametrize("legacy_bytes", [False, True], ids=["str", "bytes"])
def test_nvml_inventory_lists_the_drivers_gpus(legacy_bytes):
    nvml = make_nvml(_devices(), legacy_bytes=legacy_bytes)
    inventory = NvmlInventory(nvml=nvml)
    gpus = inventory.gpus()
    assert [(g.index, g.uuid, g.name, g.memory_total, g.pci_bus_id) for g in gpus] == [
        (0, "GPU-11111111-aaaa-bbbb-cccc-000000000000", "NVIDIA H100 80GB HBM3", 80 * GiB, "00000000:18:00.0"),
        (1, "GPU-22222222-aaaa-bbbb-cccc-000000000000", "NVIDIA H100 80GB HBM3", 80 * GiB, "00000000:2A:00.0"),
        (2, "GPU-33333333-aaaa-bbbb-cccc-000000000000", "NVIDIA A100-SXM4-40GB", 40 * GiB, "00000000:3B:00.0"),
    ]
    assert all(isinstance(g.uuid, str) and isinstance(g.name, str) for g in gpus)
    assert inventory.spec == "nvml" and not inventory.simulated
    assert nvml.driver.init_count == 0, "NVML left initialised: a forking server parent must hold no NVML state"


@pytest.mark.parametrize("legacy_bytes", [False, True], ids=["str", "bytes"])
def test_nvml_memory_used_is_queried_live(legacy_bytes):
    nvml = make_nvml(_devices(), legacy_bytes=legacy_bytes)
    inventory = NvmlInventory(nvml=nvml)
    uuids = [gpu.uuid for gpu in inventory.gpus()]
    assert inventory.memory_used() == {uuids[0]: 3 * GiB, uuids[1]: 0, uuids[2]: 512 * 2**20}
    nvml.driver.devices[1].used = 70 * GiB  # a job started on GPU 1
    assert inventory.memory_used()[uuids[1]] == 70 * GiB
    assert nvml.driver.init_count == 0
    assert nvml.driver.calls.count("nvmlInit") == nvml.driver.calls.count("nvmlShutdown") == 3


def test_nvml_utilization_is_queried_live_and_unknown_where_it_fails():
    nvml = make_nvml(_devices())
    inventory = NvmlInventory(nvml=nvml)
    uuids = [gpu.uuid for gpu in inventory.gpus()]
    nvml.driver.devices[0].utilization = 87
    nvml.driver.devices[2].lost = True
    assert inventory.utilization() == {uuids[0]: 0.87, uuids[1]: 0.0, uuids[2]: None}
    assert FakeInventory("fake:2").utilization() == {gpu.uuid: None for gpu in FakeInventory("fake:2").gpus()}
    assert nvml.driver.init_count == 0


@pytest.mark.parametrize("code, text", [(NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
                                        (NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded")])
def test_nvml_init_failure_gives_no_inventory_error_with_a_hint(code, text):
    nvml = make_nvml(_devices(), init_error=code)
    with pytest.raises(NoInventoryError) as info:
        NvmlInventory(nvml=nvml)
    message = str(info.value)
    assert "NVML could not start" in message and text in message
    assert "--gpus fake:2" in message and "RPYCDL_GPUS=fake:2" in message
    assert nvml.driver.calls == ["nvmlInit"]  # nothing else was asked of a driver that did not start


def test_one_broken_gpu_gives_none_for_that_gpu_only():
    nvml = make_nvml(_devices())
    inventory = NvmlInventory(nvml=nvml)
    uuids = [gpu.uuid for gpu in inventory.gpus()]
    nvml.driver.devices[1].lost = True  # GPU 1 fell off the bus after the server started
    assert inventory.memory_used() == {uuids[0]: 3 * GiB, uuids[1]: None, uuids[2]: 512 * 2**20}
    assert len(inventory.gpus()) == 3  # still listed: its lock and its holder must stay visible
    assert nvml.driver.init_count == 0
    nvml.driver.devices[1].lost = False  # it came back
    assert inventory.memory_used()[uuids[1]] == 0


def test_driver_gone_after_start_gives_unknown_memory_not_an_error():
    nvml = make_nvml(_devices())
    inventory = NvmlInventory(nvml=nvml)
    nvml.driver.init_error = NVML_ERROR_DRIVER_NOT_LOADED
    assert inventory.memory_used() == {gpu.uuid: None for gpu in inventory.gpus()}


def test_a_gpu_broken_at_start_gives_no_inventory_error_naming_it():
    devices = _devices()
    devices[2].lost = True
    nvml = make_nvml(devices)
    with pytest.raises(NoInventoryError, match=r"NVML could not query GPU 2 \(GPU is lost\)"):
        NvmlInventory(nvml=nvml)
    assert nvml.driver.init_count == 0


def test_a_driver_with_no_gpus_gives_an_empty_inventory():
    nvml = make_nvml([])
    assert NvmlInventory(nvml=nvml).gpus() == []
    assert nvml.driver.init_count == 0


def test_the_fake_driver_refuses_what_a_real_one_refuses():
    """The fake is only worth its tests if it is as strict as the driver."""
    nvml = make_nvml(1)
    with pytest.raises(nvml.NVMLError) as info:
        nvml.nvmlDeviceGetCount()  # before nvmlInit
    assert info.value.value == nvml.NVML_ERROR_UNINITIALIZED
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nvml.NVMLError):
        nvml.nvmlDeviceGetHandleByUUID(b"GPU-no-such-gpu")
    nvml.nvmlShutdown()
    nvml.nvmlInit()
    with pytest.raises(nvml.NVMLError):
        nvml.nvmlDeviceGetName(handle)  # a handle of an earlier session
    nvml.nvmlShutdown()
    legacy = make_nvml(1, legacy_bytes=True)
    legacy.nvmlInit()
    with pytest.raises(TypeError):
        legacy.nvmlDeviceGetHandleByUUID(legacy.driver.devices[0].uuid)  # old pynvml wants bytes


def test_nvml_per_process_memory_and_the_watchdog_on_it():
    import subprocess

    from rpycdl.gpu.watchdog import ELSEWHERE, OVER_MEMORY, GPUWatch

    nvml = make_nvml(_devices())
    inventory = NvmlInventory(nvml=nvml)
    gpus = {gpu.uuid: gpu for gpu in inventory.gpus()}
    gpu = inventory.gpus()[2]
    # A job: a process group whose leader started a child; the driver sees the child on the GPU.
    job = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        child = int(job.stdout.readline())
        nvml.driver.devices[2].processes = {child: 3 * GiB, os.getpid(): 30 * GiB, 999999: None}
        assert inventory.process_memory(gpu.uuid) == {child: 3 * GiB, os.getpid(): 30 * GiB, 999999: 0}
        assert inventory.processes()[gpu.uuid] == {child: 3 * GiB, os.getpid(): 30 * GiB, 999999: 0}
        assert nvml.driver.init_count == 0

        watch = GPUWatch(inventory, gpus, {gpu.uuid: 2 * GiB}, allowance=GiB, interval=0)
        assert watch.check(job.pid) is None  # 3 GiB: within the grant plus the allowance; ours is not the job's
        nvml.driver.devices[2].processes[child] = 3 * GiB + 1
        why, reason = watch.check(job.pid)
        assert why == OVER_MEMORY and f"GPU 2 ({gpu.uuid})" in reason and "grant of 2048 MiB" in reason
        nvml.driver.devices[2].lost = True  # a query that fails stops nobody
        assert inventory.process_memory(gpu.uuid) is None and watch.check(job.pid) is None

        # A job granted GPU 0 whole whose process shows up on GPU 1 (it reset CUDA_VISIBLE_DEVICES).
        nvml.driver.devices[2].lost = False
        nvml.driver.devices[2].processes = {}
        whole = GPUWatch(inventory, gpus, {inventory.gpus()[0].uuid: 0}, allowance=GiB, interval=0)
        nvml.driver.devices[0].processes = {child: 70 * GiB}
        assert whole.check(job.pid) is None  # all of its own GPU: fine
        nvml.driver.devices[1].processes = {child: 1}
        why, reason = whole.check(job.pid)
        assert why == ELSEWHERE and f"GPU 1 ({inventory.gpus()[1].uuid}), which it was not granted" in reason
    finally:
        os.killpg(job.pid, 9)
        job.wait()


# -- simulated GPUs shared by every user of a lock directory ---------------------------------------


@pytest.fixture
def shared_cluster():
    """A registry, and servers started with a usual umask (files 0644, directories 0755), sharing a lock
    directory every user may reach (tmp_path is not: pytest makes its base mode 700)."""
    old = os.umask(0o022)
    lock_dir = tempfile.mkdtemp(prefix="rpycdl-test-locks-")
    os.chmod(lock_dir, 0o777)
    try:
        with LocalCluster(lock_dir) as cluster:
            yield cluster
    finally:
        os.umask(old)
        shutil.rmtree(lock_dir, ignore_errors=True)


def test_simulated_gpus_follow_the_lock_directorys_sharing_rules(shared_cluster, connect):
    def allocate(nbytes):  # a job on simulated GPUs "allocates" some of its GPU; returns its pid
        import os

        from rpycdl import simulate_memory

        simulate_memory(nbytes)
        return os.getpid()

    _, port = shared_cluster.add_server("pytorch", "fake:1")
    pid = connect(port).root.run_code(allocate, 2**20)
    uuid = connect(port).root.gpu_status()["gpus"][0]["uuid"]
    state = Path(shared_cluster.lock_dir) / "simulated-gpus"
    for path, mode in ((state, 0o777), (state / uuid, 0o777), (state / uuid / str(pid), 0o666)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, (path, oct(path.stat().st_mode))

    if os.geteuid() != 0:
        return  # another user's job is played below by root becoming nobody
    # A job of another user's server (uid 65534) writes beside ours, and replaces a file of ours
    # whose pid it happens to reuse (played here by writing under our job's pid).
    code = ("import os, sys; from rpycdl import simulate_memory; os.setgid(65534); os.setuid(65534); "
            "simulate_memory(3 * 2**20); os.getpid = lambda: int(sys.argv[1]); simulate_memory(5 * 2**20)")
    env = {**os.environ, "RPYCDL_SIMULATED_GPUS": str(state), "RPYCDL_GPU_UUIDS": uuid}
    other = subprocess.run([sys.executable, "-c", code, str(pid)], env=env, capture_output=True, text=True, timeout=30)
    assert other.returncode == 0, other.stderr
    assert (state / uuid / str(pid)).read_text() == str(5 * 2**20)
    assert [p.stat().st_uid for p in (state / uuid).iterdir()] == [65534, 65534]
