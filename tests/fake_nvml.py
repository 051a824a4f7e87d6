"""A stand-in for pynvml that plays an NVIDIA driver, for rpycdl.gpu.inventory.NvmlInventory(nvml=...).

make_nvml() builds a module with the pynvml functions rpycdl uses. It behaves like the driver in
the ways that matter to a caller: every query needs nvmlInit() first (reference counted, undone by
nvmlShutdown()), a handle is only good within the init session that made it, errors are NVMLError
with a numeric `value`, and strings come back as str (nvidia-ml-py today) or bytes (older pynvml).
The test changes the driver's state through `module.driver` (memory use, a GPU falling off the bus).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

GiB = 1024**3

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}


class NVMLError(Exception):
    """As pynvml's: carries the NVML return code in `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class Device:
    """One GPU of the fake driver. `lost` makes every query about it fail, as after an Xid error; `denied`
    keeps it from this process, as a cgroup's device rules do (a Slurm job's with ConstrainDevices): NVML
    still counts it, and refuses a handle to it with NVML_ERROR_NO_PERMISSION."""

    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    total: int = 40 * GiB
    used: int = 0
    bus_id: str = "00000000:07:00.0"
    lost: bool = False
    denied: bool = False
    utilization: int = 0  # percent of the last sample period its kernels ran
    memory_utilization: int = 0  # percent of it its memory was read or written
    processes: dict[int, int | None] = field(default_factory=dict)  # pid -> bytes used (None: not available)
    minor: int | None = None  # its device node's minor number (/dev/nvidia<minor>); None: its place in the list


@dataclass
class Utilization:
    gpu: int
    memory: int


@dataclass
class MemoryInfo:
    total: int
    free: int
    used: int


@dataclass
class ProcessInfo:
    """As pynvml's c_nvmlProcessInfo_t: usedGpuMemory is None where the driver cannot say."""

    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's field name


@dataclass
class PciInfo:
    busId: str | bytes  # noqa: N815 - pynvml's field name
    bus: int = 0
    device: int = 0
    domain: int = 0


@dataclass(frozen=True)
class Handle:
    index: int
    session: int


@dataclass
class Driver:
    """The driver's state, shared by every function of one fake module."""

    devices: list[Device]
    init_error: int | None = None  # nvmlInit fails with this NVML return code
    legacy_bytes: bool = False  # return bytes, as pynvml before nvidia-ml-py 11.5 did
    init_count: int = 0
    session: int = 0
    calls: list[str] = field(default_factory=list)

    def _text(self, text: str) -> str | bytes:
        return text.encode() if self.legacy_bytes else text

    def _check(self) -> None:
        if self.init_count == 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: Handle) -> Device:
        self._check()
        if not isinstance(handle, Handle) or handle.session != self.session:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # a stale handle from an earlier session
        return self._usable(self.devices[handle.index])

    @staticmethod
    def _usable(device: Device) -> Device:
        if device.denied:
            raise NVMLError(NVML_ERROR_NO_PERMISSION)
        if device.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return device

    # -- the pynvml functions -----------------------------------------------------------

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        if self.init_count == 0:
            self.session += 1
        self.init_count += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("nvmlShutdown")
        self._check()
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._check()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:  # noqa: N802
        self._check()
        if not isinstance(index, int) or not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        self._usable(self.devices[index])
        return Handle(index, self.session)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Handle:  # noqa: N802
        self._check()
        if isinstance(uuid, str):
            if self.legacy_bytes:  # ctypes.c_char_p refuses str
                raise TypeError("bytes or integer address expected instead of str instance")
            uuid = uuid.encode()
        for index, device in enumerate(self.devices):
            if device.uuid.encode() == uuid:
                self._usable(device)
                return Handle(index, self.session)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, handle: Handle) -> str | bytes:  # noqa: N802
        return self._text(self._device(handle).uuid)

    def nvmlDeviceGetName(self, handle: Handle) -> str | bytes:  # noqa: N802
        return self._text(self._device(handle).name)

    def nvmlDeviceGetMemoryInfo(self, handle: Handle) -> MemoryInfo:  # noqa: N802
        device = self._device(handle)
        return MemoryInfo(total=device.total, free=device.total - device.used, used=device.used)

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> PciInfo:  # noqa: N802
        return PciInfo(busId=self._text(self._device(handle).bus_id))

    def nvmlDeviceGetMinorNumber(self, handle: Handle) -> int:  # noqa: N802
        device = self._device(handle)
        return self.devices.index(device) if device.minor is None else device.minor

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list[ProcessInfo]:  # noqa: N802
        return [ProcessInfo(pid, used) for pid, used in self._device(handle).processes.items()]

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> Utilization:  # noqa: N802
        device = self._device(handle)
        return Utilization(gpu=device.utilization, memory=device.memory_utilization)


FUNCTIONS = ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
             "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
             "nvmlDeviceGetPciInfo", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetUtilizationRates",
             "nvmlDeviceGetMinorNumber")


def make_nvml(devices: list[Device] | int = 2, *, init_error: int | None = None,
              legacy_bytes: bool = False) -> types.ModuleType:
    """A module playing pynvml over a driver with `devices` (or that many A100s)."""
    if isinstance(devices, int):
        devices = [Device(uuid=f"GPU-a100{i:04d}-0000-0000-0000-00000000000{i}", bus_id=f"00000000:{7 + i:02X}:00.0")
                   for i in range(devices)]
    driver = Driver(list(devices), init_error=init_error, legacy_bytes=legacy_bytes)
    module = types.ModuleType("fake_pynvml", "A fake pynvml playing an NVIDIA driver (tests/fake_nvml.py).")
    for name in FUNCTIONS:
        setattr(module, name, getattr(driver, name))
    module.NVMLError = NVMLError
    module.driver = driver
    for name, value in globals().items():
        if name.startswith("NVML_"):
            setattr(module, name, value)
    return module
