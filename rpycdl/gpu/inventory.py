"""GPU inventory: real GPUs through NVML (pynvml), or a simulated inventory for machines without one."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from rpycdl.defaults import ENV_CUDA_VISIBLE, ENV_GPUS, ENV_NVIDIA_VISIBLE, ENV_NVML_MODULE, ENV_SIMULATED_GPUS
from rpycdl.errors import InvalidRequestError, NoInventoryError
from rpycdl.scheduler import procs
from rpycdl.scheduler.lockdir import shared_dir, shared_file, writable
from rpycdl.units import GiB, parse_size

_T = TypeVar("_T")

FAKE_DEFAULT_MEMORY = 16 * GiB

NVML_ERROR_NO_PERMISSION = 4
"""NVML's answer for a GPU this process may not open (a cgroup's device rules keep it out, as in a Slurm job
with ConstrainDevices): NVML counts it, CUDA here does not."""

_MIG = re.compile(r"MIG-|\d+:\d+$", re.I)  # CUDA's MIG-<uuid> (MIG-GPU-<uuid>/GI/CI before 11.1), the runtime's GPU:MIG


@dataclass(frozen=True)
class GPU:
    """One GPU as the server sees it. `index` is CUDA's index of the GPU in the server's processes, its jobs
    included, with CUDA_DEVICE_ORDER=PCI_BUS_ID: its place in PCI bus order among the GPUs they may open
    (NVML's index, unless a cgroup keeps some GPUs of the host out); `uuid` is the same everywhere on the host."""

    index: int
    uuid: str
    name: str
    memory_total: int
    pci_bus_id: str = ""
    minor: int = -1  # its device node's minor number (/dev/nvidia<minor>, major 195); -1: unknown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Inventory:
    """The GPUs of one server, and what they are doing now."""

    spec = "none"
    simulated = False

    def gpus(self) -> list[GPU]:
        raise NotImplementedError

    def memory_used(self) -> dict[str, int | None]:
        """Bytes in use per GPU UUID right now; None where the query failed."""
        raise NotImplementedError

    def process_memory(self, uuid: str) -> dict[int, int] | None:
        """Bytes each process uses on the GPU right now, by pid; None where the query failed."""
        raise NotImplementedError

    def processes(self) -> dict[str, dict[int, int]]:
        """Every GPU the host's driver shows (this process's own or not: a job may open what its server does
        not use), by UUID: the bytes each process uses on it, by pid; a GPU whose query failed is left out."""
        return {gpu.uuid: used for gpu in self.gpus() if (used := self.process_memory(gpu.uuid)) is not None}

    def utilization(self) -> dict[str, float | None]:
        """The share of the last sample period each GPU's kernels ran (0 to 1) by UUID; None where
        unknown (a simulated GPU, a failed query)."""
        return {gpu.uuid: None for gpu in self.gpus()}

    def load(self) -> dict[str, float | None]:
        """How busy each GPU was over the last sample period, by UUID: the larger of the share of it its
        kernels ran and the share its memory was read or written (0 to 1); None where unknown."""
        return {gpu.uuid: None for gpu in self.gpus()}

    def use_lock_dir(self, lock_dir: str | os.PathLike[str]) -> None:
        """Read what the jobs of the host's lock directory do on these GPUs (simulated GPUs keep their
        memory use there; a driver needs nothing)."""


def _minor(nvml: ModuleType, handle: Any) -> int:
    """The GPU's device node minor number (NVML's), -1 where the driver does not say (a MIG instance)."""
    try:
        return int(nvml.nvmlDeviceGetMinorNumber(handle))
    except Exception:
        return -1


class FakeInventory(Inventory):
    """A simulated inventory: `fake:4` or `fake:2x16GiB`.

    UUIDs are fixed by index, so every server given the same spec on one host (one lock
    directory) shares the same simulated GPUs, like containers sharing real ones. Jobs on
    simulated GPUs "allocate" memory with simulate_memory(), which records it under
    `state_dir` (<lock dir>/simulated-gpus: use_lock_dir): the per-process figures
    a driver would report."""

    simulated = True
    state_dir: Path | None = None

    def __init__(self, spec: str) -> None:
        match = re.fullmatch(r"fake:(\d+)(?:x(.+))?", spec.strip())
        if not match:
            raise InvalidRequestError(f"bad simulated inventory {spec!r}: use fake:N or fake:NxSIZE (fake:2x16GiB)")
        count = int(match.group(1))
        if not 1 <= count <= 64:
            raise InvalidRequestError(f"bad simulated inventory {spec!r}: between 1 and 64 GPUs")
        memory = parse_size(match.group(2)) if match.group(2) else FAKE_DEFAULT_MEMORY
        if memory < 1:
            raise InvalidRequestError(f"bad simulated inventory {spec!r}: a GPU needs some memory")
        self.spec = spec.strip()
        self._gpus = [
            GPU(i, f"GPU-00000000-0000-4000-8000-{i:012d}", "Simulated GPU", memory, f"00000000:{i + 1:02X}:00.0", i)
            for i in range(count)
        ]

    def gpus(self) -> list[GPU]:
        return list(self._gpus)

    def use_lock_dir(self, lock_dir: str | os.PathLike[str]) -> None:
        """Keep the simulated driver's state in the lock directory's simulated-gpus/, a folder per GPU in
        which every user's jobs write (no sticky bit: a job whose pid a dead one had replaces its record), made here
        if this process may."""
        self.state_dir = Path(lock_dir) / "simulated-gpus"
        for folder in (self.state_dir, *(self.state_dir / gpu.uuid for gpu in self._gpus)) if writable() else ():
            with contextlib.suppress(OSError):  # a monitor of another user: the servers make them
                folder.mkdir(exist_ok=True)
                if folder.stat().st_uid == os.geteuid():
                    os.chmod(folder, SIMULATED_DIR_MODE)

    def memory_used(self) -> dict[str, int | None]:
        return {gpu.uuid: sum(self.process_memory(gpu.uuid).values()) for gpu in self._gpus}

    def processes(self) -> dict[str, dict[int, int]]:
        """Every simulated GPU with records, this inventory's or not (another fake:N of the host)."""
        folders = self.state_dir.iterdir() if self.state_dir and self.state_dir.is_dir() else ()
        return {folder.name: self.process_memory(folder.name) for folder in folders if folder.is_dir()}

    def process_memory(self, uuid: str) -> dict[int, int]:
        used = {}
        folder = self.state_dir / uuid if self.state_dir else None
        for entry in folder.iterdir() if folder and folder.is_dir() else ():
            with contextlib.suppress(ValueError, OSError):
                pid, size = int(entry.name), int(entry.read_text() or 0)
                if procs.alive(pid):
                    used[pid] = size
        return used


class NvmlInventory(Inventory):
    """Real GPUs through NVML. `nvml` is the pynvml module, or a stand-in that plays a driver.

    Only the GPUs this process may use: those it may open, and of those the ones its environment
    (`environ`, default os.environ) leaves it (see confine). NVML is initialised and shut down around each
    query, so a forking server parent keeps no NVML state (and never touches CUDA)."""

    spec = "nvml"

    def __init__(self, nvml: ModuleType | None = None, environ: Mapping[str, str] | None = None) -> None:
        if nvml is None:
            try:  # nvidia-ml-py, or what $RPYCDL_NVML_MODULE names (a stand-in playing a driver, for tests)
                nvml = importlib.import_module(os.environ.get(ENV_NVML_MODULE) or "pynvml")
            except ImportError as exc:  # a client-only install
                raise NoInventoryError(f"pynvml is not installed ({exc}): pip install 'rpycdl[server]'") from exc
        self._nvml = nvml
        self._gpus = confine(self._query(), os.environ if environ is None else environ)

    def _query(self) -> list[tuple[int, GPU]]:
        """Every GPU this process may open, in NVML's order, with NVML's index."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise NoInventoryError(
                f"NVML could not start ({exc}). On a machine without NVIDIA GPUs, choose a "
                f"simulated inventory: --gpus fake:2 (or {ENV_GPUS}=fake:2)"
            ) from exc
        gpus: list[tuple[int, GPU]] = []
        what = "the GPU count"
        try:
            for number in range(nvml.nvmlDeviceGetCount()):
                what = f"GPU {number}"
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(number)
                except Exception as exc:
                    if getattr(exc, "value", None) == NVML_ERROR_NO_PERMISSION:
                        continue  # not this process's: CUDA here does not count it either
                    raise
                gpus.append((number, GPU(len(gpus), _text(nvml.nvmlDeviceGetUUID(handle)),
                                         _text(nvml.nvmlDeviceGetName(handle)),
                                         int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                                         _text(nvml.nvmlDeviceGetPciInfo(handle).busId), _minor(nvml, handle))))
            return gpus
        except Exception as exc:  # a GPU that fails to answer is not served: say which one, and why
            raise NoInventoryError(f"NVML could not query {what} ({exc}); check it with nvidia-smi, "
                                   "or choose a simulated inventory: --gpus fake:2") from exc
        finally:
            nvml.nvmlShutdown()

    def gpus(self) -> list[GPU]:
        return list(self._gpus)

    def memory_used(self) -> dict[str, int | None]:
        def query(nvml: ModuleType) -> dict[str, int | None]:
            used: dict[str, int | None] = {}
            for gpu in self._gpus:
                try:  # one broken GPU yields an unknown entry, not a failed listing
                    handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())
                    used[gpu.uuid] = int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
                except Exception:
                    used[gpu.uuid] = None
            return used

        return self._ask(query, {gpu.uuid: None for gpu in self._gpus})

    def utilization(self) -> dict[str, float | None]:
        return {uuid: None if rates is None else rates[0] for uuid, rates in self._rates().items()}

    def load(self) -> dict[str, float | None]:
        return {uuid: None if rates is None else max(rates) for uuid, rates in self._rates().items()}

    def _rates(self) -> dict[str, tuple[float, float] | None]:
        """Each GPU's (SM, memory bandwidth) utilisation over the driver's last sample period, 0 to 1."""
        def query(nvml: ModuleType) -> dict[str, tuple[float, float] | None]:
            rates: dict[str, tuple[float, float] | None] = {}
            for gpu in self._gpus:
                try:
                    handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())
                    rate = nvml.nvmlDeviceGetUtilizationRates(handle)
                    rates[gpu.uuid] = (rate.gpu / 100, rate.memory / 100)
                except Exception:
                    rates[gpu.uuid] = None
            return rates

        return self._ask(query, {gpu.uuid: None for gpu in self._gpus})

    def processes(self) -> dict[str, dict[int, int]]:
        def query(nvml: ModuleType) -> dict[str, dict[int, int]]:
            found: dict[str, dict[int, int]] = {}
            for number in range(nvml.nvmlDeviceGetCount()):
                try:  # one GPU that does not answer (or is not ours to ask) is left out
                    handle = nvml.nvmlDeviceGetHandleByIndex(number)
                    running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                    found[_text(nvml.nvmlDeviceGetUUID(handle))] = {int(p.pid): int(p.usedGpuMemory or 0)
                                                                    for p in running}
                except Exception:
                    continue
            return found

        return self._ask(query, {})

    def process_memory(self, uuid: str) -> dict[int, int] | None:
        def query(nvml: ModuleType) -> dict[int, int]:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
            return {int(p.pid): int(p.usedGpuMemory or 0) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}

        return self._ask(query, None)

    def _ask(self, query: Callable[[ModuleType], _T], failed: _T) -> _T:
        """query(nvml) between nvmlInit and nvmlShutdown; `failed` if NVML cannot start or the query raises."""
        try:
            self._nvml.nvmlInit()
        except Exception:
            return failed
        try:
            return query(self._nvml)
        except Exception:
            return failed
        finally:
            self._nvml.nvmlShutdown()


def confine(devices: Sequence[tuple[int, GPU]], environ: Mapping[str, str]) -> list[GPU]:
    """The GPUs of `devices` that the environment leaves this process: all, unless NVIDIA_VISIBLE_DEVICES
    or CUDA_VISIBLE_DEVICES is set; then those that both leave, in NVML's order.

    `devices` are the GPUs this process may open, in NVML's (PCI bus) order, each with NVML's index; a
    GPU's `index` is its place among them, CUDA's index here. Each variable names GPUs by index or UUID
    (CUDA also takes a unique prefix of one); an empty CUDA_VISIBLE_DEVICES and the runtime's `none` name
    none. CUDA counts indices among the GPUs this process may open (so a Slurm job's 0,1 are its own two
    GPUs); the runtime counts the host's, and what it has applied inside its container leaves every GPU
    NVML shows there (see _applied). The GPUs keep their `index`: a job's CUDA_VISIBLE_DEVICES, which
    replaces the server's, counts as CUDA in the server does.

    Raises:
        NoInventoryError: an entry names no GPU here, or one twice, or a MIG device; or no GPU is left.
    """
    left = [gpu for _, gpu in devices]
    said = []
    for variable in (ENV_NVIDIA_VISIBLE, ENV_CUDA_VISIBLE):
        value = environ.get(variable)
        if value is not None:
            said.append(f"{variable}={value!r}")
            named = _named(variable, value, devices)
            left = [gpu for gpu in left if named is None or gpu.uuid in named]
    if said and not left:
        raise NoInventoryError(f"{' and '.join(said)} leave no GPU here ({_listing(devices)}): name some, or unset "
                               "the variable for every GPU")
    return left


def _named(variable: str, value: str, devices: Sequence[tuple[int, GPU]]) -> set[str] | None:
    """The UUIDs of the GPUs `variable`=`value` names; None for every GPU here."""
    words = [word.strip() for word in value.split(",")] if value.strip() else []
    runtime = variable == ENV_NVIDIA_VISIBLE
    if runtime and [word.lower() for word in words] == ["none"]:
        return set()
    if runtime and _applied(words, devices):
        return None
    named: set[str] = set()
    for word in words:
        if _MIG.match(word):
            raise NoInventoryError(f"{variable}={value!r} names the MIG device {word!r}: rpycdl grants whole GPUs "
                                   "and shares of them by memory, not MIG instances; give the server whole GPUs "
                                   f"(indices or UUIDs), or unset {variable}")
        if re.fullmatch(r"-?\d+", word):  # the runtime counts the host's GPUs (NVML's index), CUDA its own
            found = [gpu for number, gpu in devices if (number if runtime else gpu.index) == int(word)]
        else:
            found = [gpu for _, gpu in devices if word.upper().startswith("GPU-")
                     and gpu.uuid.lower().startswith(word.lower())]
        if len(found) != 1 or found[0].uuid in named:
            why = "twice" if found and found[0].uuid in named else "more than one GPU" if found else "no GPU here"
            raise NoInventoryError(f"{variable}={value!r}: {word!r} names {why} ({_listing(devices)})")
        named.add(found[0].uuid)
    return named


def _applied(words: list[str], devices: Sequence[tuple[int, GPU]]) -> bool:
    """Whether NVIDIA_VISIBLE_DEVICES leaves every GPU NVML shows: `all`; `void` or empty (the runtime then
    adds no GPU itself: CDI injects them, and its specs set `void`); the runtime's own references, which it
    has applied (device list files under /var/run/nvidia-container-devices, the device plugin's volume-mounts
    strategy; CDI names such as nvidia.com/gpu=0); or the host's indices of exactly as many GPUs as NVML shows,
    which it has applied inside its container."""
    lowered = [word.lower() for word in words]
    return (lowered in (["all"], ["void"], []) or all(word.startswith("/") or "=" in word for word in words)
            or all(word.isdigit() for word in words) and len(set(words)) == len(devices))


SIMULATED_DIR_MODE = 0o777
"""simulated-gpus/ and its folders: every user's jobs record their "allocations" there (simulate_memory)."""


def _listing(devices: Sequence[tuple[int, GPU]]) -> str:
    """The GPUs this process may use, in words: `this process may use 2 GPU(s): 0 GPU-..., 1 GPU-...`."""
    gpus = ", ".join(f"{gpu.index} {gpu.uuid}" for _, gpu in devices)
    return f"this process may use {len(devices)} GPU(s): {gpus}" if devices else "this process may use no GPU"


def simulate_memory(size: int, device: int = 0) -> None:
    """In a job on simulated GPUs: say this process now uses `size` bytes of its `device`-th GPU,
    as if it had allocated them (what the server's watchdog and `rpycdl status` then see).

    Raises:
        RuntimeError: not in a job on simulated GPUs.
    """
    state, uuids = os.environ.get(ENV_SIMULATED_GPUS), os.environ.get("RPYCDL_GPU_UUIDS", "").split(",")
    if not state or not 0 <= device < len(uuids) or not uuids[device]:
        raise RuntimeError(f"simulate_memory works in jobs on simulated GPUs ({ENV_SIMULATED_GPUS} is not set "
                           f"or there is no GPU {device})")
    folder = Path(state) / uuids[device]
    for directory in (folder.parent, folder):  # shared like the lock directory: every user's jobs write here
        shared_dir(directory)
    shared_file(folder / str(os.getpid()), str(int(size)).encode())


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load_inventory(spec: str | None = None) -> Inventory:
    """Load the inventory named by `spec`, else by $RPYCDL_GPUS, else NVML.

    Args:
        spec: `fake:N`, `fake:NxSIZE`, `nvml`, or None/`auto` for the environment or NVML.

    Raises:
        NoInventoryError: NVML could not start and no simulated inventory was asked for;
            the message says how to ask for one. No GPU count is ever assumed.
    """
    spec = (spec or os.environ.get(ENV_GPUS) or "auto").strip()
    if spec.startswith("fake:"):
        return FakeInventory(spec)
    if spec in ("auto", "nvml"):
        inventory = NvmlInventory()
        if not inventory.gpus():
            raise NoInventoryError(f"NVML found no GPUs. To simulate some, use --gpus fake:2 (or {ENV_GPUS}=fake:2)")
        return inventory
    raise InvalidRequestError(f"unknown GPU inventory {spec!r}: use nvml, fake:N or fake:NxSIZE")
