"""A server's GPUs inside a confinement: NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES, in every form they
take, read against the fake NVML driver of tests/fake_nvml.py (rpycdl.gpu.inventory.confine)."""

from __future__ import annotations

import pytest
from fake_nvml import NVML_ERROR_NO_PERMISSION, Device, make_nvml

from rpycdl import NoInventoryError
from rpycdl.gpu.inventory import NvmlInventory

UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-4000-8000-00000000000{i}" for i in range(4)]


def _nvml(denied: tuple[int, ...] = (), legacy_bytes: bool = False):
    """Four GPUs in PCI bus order; `denied` ones kept from this process, as by a cgroup's device rules."""
    return make_nvml([Device(uuid, bus_id=f"00000000:{16 + i:02X}:00.0", denied=i in denied)
                      for i, uuid in enumerate(UUIDS)], legacy_bytes=legacy_bytes)


def _gpus(environ: dict[str, str], denied: tuple[int, ...] = ()) -> list[tuple[int, str]]:
    """(index, UUID) of each GPU a server gets with `environ`."""
    nvml = _nvml(denied)
    gpus = NvmlInventory(nvml=nvml, environ=environ).gpus()
    assert nvml.driver.init_count == 0
    return [(gpu.index, gpu.uuid) for gpu in gpus]


def _refused(environ: dict[str, str], denied: tuple[int, ...] = ()) -> str:
    with pytest.raises(NoInventoryError) as info:
        NvmlInventory(nvml=_nvml(denied), environ=environ)
    return str(info.value)


@pytest.mark.parametrize("environ", [{}, {"NVIDIA_VISIBLE_DEVICES": "all"}, {"NVIDIA_VISIBLE_DEVICES": "ALL"},
                                     {"NVIDIA_VISIBLE_DEVICES": "void"}, {"NVIDIA_VISIBLE_DEVICES": ""}])
def test_unconfined_a_server_gets_every_gpu_by_its_nvml_index(environ):
    """The runtime's `void` and empty mean what unset does: it adds no GPU itself."""
    assert _gpus(environ) == list(enumerate(UUIDS))


@pytest.mark.parametrize("value", ["void", "/var/run/nvidia-container-devices", "nvidia.com/gpu=0,nvidia.com/gpu=1"])
def test_what_the_runtime_or_cdi_applied_inside_a_container_is_every_gpu_nvml_shows(value):
    """CDI injects a pod's GPUs and its specs set NVIDIA_VISIBLE_DEVICES=void; the device plugin's volume-mounts
    strategy sets a path; the runtime's CDI mode takes CDI names: NVML shows just the GPUs given."""
    nvml = make_nvml([Device(UUIDS[1]), Device(UUIDS[3])])
    gpus = NvmlInventory(nvml=nvml, environ={"NVIDIA_VISIBLE_DEVICES": value}).gpus()
    assert [(gpu.index, gpu.uuid) for gpu in gpus] == [(0, UUIDS[1]), (1, UUIDS[3])]


@pytest.mark.parametrize("value", ["1,3", "3,1", " 1 , 3 ", f"{UUIDS[1]},{UUIDS[3]}", f"{UUIDS[3][:12]},1",
                                   f"{UUIDS[1].lower()},{UUIDS[3]}"])
def test_cuda_visible_devices_by_index_uuid_or_prefix(value):
    """Indices are CUDA's (PCI bus order, as CUDA_DEVICE_ORDER=PCI_BUS_ID counts); the order given does
    not matter, since a job gets a CUDA_VISIBLE_DEVICES of its own; GPUs keep their index."""
    assert _gpus({"CUDA_VISIBLE_DEVICES": value}) == [(1, UUIDS[1]), (3, UUIDS[3])]


def test_nvidia_visible_devices_by_uuid_or_host_index_on_a_bare_host():
    assert _gpus({"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}) == [(0, UUIDS[0]), (2, UUIDS[2])]
    assert _gpus({"NVIDIA_VISIBLE_DEVICES": "2"}) == [(2, UUIDS[2])]


def test_nvidia_visible_devices_the_runtime_applied_already():
    """Inside a container the runtime gave two of the host's eight GPUs (host indices 5 and 7), NVML shows
    just those two: the variable's host indices are no NVML indices there, and both GPUs are the server's."""
    nvml = make_nvml([Device(UUIDS[0]), Device(UUIDS[1])])
    gpus = NvmlInventory(nvml=nvml, environ={"NVIDIA_VISIBLE_DEVICES": "5,7"}).gpus()
    assert [(gpu.index, gpu.uuid) for gpu in gpus] == [(0, UUIDS[0]), (1, UUIDS[1])]
    gpus = NvmlInventory(nvml=nvml, environ={"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[1]}"}).gpus()
    assert [gpu.uuid for gpu in gpus] == [UUIDS[1]]


def test_a_pod_given_two_of_eight_gpus_by_the_device_plugin():
    """The device plugin's pod: the runtime mounted two GPUs (NVML shows those) and set their UUIDs."""
    nvml = make_nvml([Device(UUIDS[2]), Device(UUIDS[3])])
    gpus = NvmlInventory(nvml=nvml, environ={"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[3]}"}).gpus()
    assert [(gpu.index, gpu.uuid) for gpu in gpus] == [(0, UUIDS[2]), (1, UUIDS[3])]


def test_a_cgroup_keeps_gpus_out_and_cuda_counts_only_the_others():
    """A Slurm job with ConstrainDevices: NVML counts the host's four GPUs but may open only 1 and 3, and
    Slurm sets CUDA_VISIBLE_DEVICES=0,1 (CUDA here sees two GPUs). A job's CUDA_VISIBLE_DEVICES must then
    name them 0 and 1 too."""
    assert _gpus({}, denied=(0, 2)) == [(0, UUIDS[1]), (1, UUIDS[3])]
    assert _gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, denied=(0, 2)) == [(0, UUIDS[1]), (1, UUIDS[3])]
    assert _gpus({"CUDA_VISIBLE_DEVICES": "1"}, denied=(0, 2)) == [(1, UUIDS[3])]
    assert _gpus({"CUDA_VISIBLE_DEVICES": UUIDS[3]}, denied=(0, 2)) == [(1, UUIDS[3])]
    assert "'2' names no GPU here (this process may use 2 GPU(s): 0 GPU-1111" in \
        _refused({"CUDA_VISIBLE_DEVICES": "1,2"}, denied=(0, 2))
    assert "names no GPU here" in _refused({"CUDA_VISIBLE_DEVICES": UUIDS[0]}, denied=(0, 2))


def test_the_fake_driver_refuses_a_gpu_a_cgroup_keeps_out():
    nvml = _nvml(denied=(1,))
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 4
    for ask in (lambda: nvml.nvmlDeviceGetHandleByIndex(1), lambda: nvml.nvmlDeviceGetHandleByUUID(UUIDS[1])):
        with pytest.raises(nvml.NVMLError) as info:
            ask()
        assert info.value.value == NVML_ERROR_NO_PERMISSION
    nvml.nvmlShutdown()


def test_both_variables_leave_what_both_name():
    environ = {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[2]}", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert _gpus(environ) == [(2, UUIDS[2])]
    message = _refused({"NVIDIA_VISIBLE_DEVICES": UUIDS[1], "CUDA_VISIBLE_DEVICES": "2"})
    assert f"NVIDIA_VISIBLE_DEVICES='{UUIDS[1]}' and CUDA_VISIBLE_DEVICES='2' leave no GPU here" in message


@pytest.mark.parametrize("environ", [{"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": " "},
                                     {"NVIDIA_VISIBLE_DEVICES": "none"}, {"NVIDIA_VISIBLE_DEVICES": "None"}])
def test_a_confinement_to_no_gpu_refuses_to_start(environ):
    [(variable, value)] = environ.items()
    message = _refused(environ)
    assert f"{variable}={value!r} leave no GPU here (this process may use 4 GPU(s): 0 {UUIDS[0]}" in message
    assert "unset the variable for every GPU" in message


@pytest.mark.parametrize("environ, word, why", [
    ({"CUDA_VISIBLE_DEVICES": "4"}, "4", "no GPU here"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, "-1", "no GPU here"),
    ({"CUDA_VISIBLE_DEVICES": "0,,1"}, "", "no GPU here"),
    ({"CUDA_VISIBLE_DEVICES": "all"}, "all", "no GPU here"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-99999999"}, "GPU-99999999", "no GPU here"),
    ({"CUDA_VISIBLE_DEVICES": "1111aaaa"}, "1111aaaa", "no GPU here"),  # a UUID without GPU- is none to CUDA
    ({"CUDA_VISIBLE_DEVICES": "GPU-"}, "GPU-", "more than one GPU"),
    ({"CUDA_VISIBLE_DEVICES": f"1,{UUIDS[1]}"}, UUIDS[1], "twice"),
    ({"NVIDIA_VISIBLE_DEVICES": "0,0"}, "0", "twice"),
    ({"NVIDIA_VISIBLE_DEVICES": "7"}, "7", "no GPU here"),
])
def test_an_entry_that_names_no_single_gpu_refuses_to_start(environ, word, why):
    [(variable, value)] = environ.items()
    assert f"{variable}={value!r}: {word!r} names {why} (this process may use 4 GPU(s)" in _refused(environ)


@pytest.mark.parametrize("environ", [
    {"CUDA_VISIBLE_DEVICES": "MIG-a1b2c3d4-0000-4000-8000-000000000000"},
    {"CUDA_VISIBLE_DEVICES": f"0,MIG-{UUIDS[1]}/1/0"},
    {"NVIDIA_VISIBLE_DEVICES": "0:1"},
    {"NVIDIA_VISIBLE_DEVICES": "mig-a1b2c3d4-0000-4000-8000-000000000000"},
])
def test_mig_devices_are_refused_in_words(environ):
    [(variable, value)] = environ.items()
    message = _refused(environ)
    assert f"{variable}={value!r} names the MIG device" in message
    assert "not MIG instances" in message and f"unset {variable}" in message


def test_the_confinement_holds_with_an_old_pynvml_too():
    nvml = _nvml(legacy_bytes=True)
    gpus = NvmlInventory(nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": UUIDS[2]}).gpus()
    assert [(gpu.index, gpu.uuid) for gpu in gpus] == [(2, UUIDS[2])]
    assert NvmlInventory(nvml=nvml, environ={}).memory_used().keys() == set(UUIDS)
    assert NvmlInventory(nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": "3"}).memory_used().keys() == {UUIDS[3]}
