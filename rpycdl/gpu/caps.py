"""Holds a job on a share of one GPU to its memory grant from inside the job process.

The server puts the variables of `cap_environment()` into the job process's environment and
calls `install_caps()` there before the payload is unpickled, so before the job imports any
framework. Each cap is the framework's own limit, so it covers only the memory that framework
allocates through its own allocator:

- PyTorch: `torch.cuda.set_per_process_memory_fraction(grant / total, device)`, applied by an
  import hook the first time the job imports torch and queued with `torch.cuda._lazy_call`, so it
  runs when PyTorch initialises CUDA; importing torch still initialises nothing. `total` is the
  device total PyTorch itself reads (`get_device_properties().total_memory`), so the cap is the
  grant in bytes. It limits what the caching allocator reserves from CUDA (what
  `torch.cuda.memory_reserved()` reports, cached blocks included); an allocation past it raises
  `torch.cuda.OutOfMemoryError`. Recent PyTorch versions give cuBLAS its workspaces from this
  allocator, so they count (older ones let cuBLAS allocate its own); the libraries' handles and
  the kernels they load do not.
- TensorFlow: one logical device per physical GPU with `memory_limit` = the grant in MiB (rounded
  down), set by the import hook right after `import tensorflow`, before TensorFlow starts its
  runtime (it refuses later). It limits TensorFlow's GPU allocator (BFC): tensors and the scratch
  memory TensorFlow asks it for. TF_FORCE_GPU_ALLOW_GROWTH=true makes TensorFlow grow into the
  limit instead of taking all of it at start-up. TensorFlow refuses
  `tf.config.experimental.set_memory_growth` on a GPU with a logical device configuration, so the
  hook makes that call a no-op on the capped GPUs (growth is already on): jobs written with it
  still run.
- JAX: XLA_PYTHON_CLIENT_MEM_FRACTION = grant / total and XLA_PYTHON_CLIENT_PREALLOCATE=false.
  The fraction is of the GPU's total memory, not of the memory free; it caps XLA's BFC allocator
  with or without preallocation, and without it JAX takes memory as it needs it, up to the cap,
  instead of all of it at its first operation. Newer jaxlib calls the variable
  XLA_CLIENT_MEM_FRACTION and refuses both names at once, so where the job inherits that one,
  `install_caps` sets it to the fraction and drops the old name. Not covered: the `platform`
  allocator (XLA_PYTHON_CLIENT_ALLOCATOR=platform has no pool and no cap) and XLA's separate
  pool for collective memory.
- CuPy: CUPY_GPU_MEMORY_LIMIT = the grant in bytes, a limit on CuPy's default memory pool; an
  allocation past it raises `cupy.cuda.memory.OutOfMemoryError`. Not covered: memory CuPy takes
  outside the pool (cuFFT plans, library handles) and any allocator the job installs instead.

No cap covers:
- the CUDA context of each process on the GPU (typically 300-500 MiB) and what CUDA libraries
  allocate for themselves (cuBLAS, cuDNN and cuFFT handles, NCCL's buffers);
- memory allocated outside the framework's allocator: cudaMalloc from C extensions or ctypes,
  another library or framework in the same process;
- child processes started by exec (subprocess, multiprocessing's spawn and forkserver): the import
  hook does not survive exec, so PyTorch and TensorFlow there run uncapped, and the environment
  caps (JAX, CuPy) hold each process separately, so together they can exceed the grant;
- a job that changes the settings itself (its own memory fraction or logical devices, or the
  variables above changed before it imports JAX or CuPy).
The server's watchdog holds every job to its grant whatever it uses: it reads each job
process's GPU memory from the driver (NVML) and stops a job past its grant plus an allowance for
the CUDA context.

The fraction in the variables is of the GPU total the server passes (NVML's figure); JAX
multiplies it by the total CUDA reports, which can be slightly smaller, so JAX's cap can be
slightly below the grant. It is written rounded down, never above the grant.

Sources checked:
- PyTorch: torch/cuda/__init__.py (`_lazy_call` queues a call until CUDA initialises; `_lazy_init`
  runs the queue behind a re-entrancy guard, so a queued call may call `_lazy_init` again, and
  turns an exception in one into DeferredCudaCallError, failing CUDA's initialisation);
  torch/cuda/memory.py (`set_per_process_memory_fraction` wants a float in [0, 1]);
  c10/cuda/CUDACachingAllocator.cpp (the cap is checked against the allocator's total reserved
  memory before it asks CUDA for more); aten/src/ATen/cuda/CublasHandlePool.cpp (workspaces).
- TensorFlow: tensorflow/python/eager/context.py (`set_logical_device_configuration` refuses once
  the runtime started; `set_memory_growth` refuses on a configured device); gpu_bfc_allocator.cc
  (TF_FORCE_GPU_ALLOW_GROWTH overrides growth; the limit stays the allocator's total); the virtual
  device setup (memory_limit_mb counts units of 2**20 bytes).
- JAX: jaxlib's xla_client.py (the two names of the fraction, PREALLOCATE parsing); XLA's
  xla/pjrt/gpu/gpu_helpers.cc (`CreateBFCAllocator`: total * fraction with or without
  preallocation; the collective-memory pool is separate); the JAX page "GPU memory allocation".
- CuPy: cupy/cuda/memory.pyx (`_parse_limit_string`: bytes, or a percentage) and its
  environment-variable reference.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from rpycdl.errors import InvalidRequestError

MEMORY_VAR = "RPYCDL_GPU_MEMORY"
TOTAL_VAR = "RPYCDL_GPU_MEMORY_TOTAL"
FRACTION_VAR = "RPYCDL_GPU_MEMORY_FRACTION"
JAX_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_NEW_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"  # newer jaxlib; it refuses both names together
FRACTION_DIGITS = 9
MiB = 1 << 20

Hook = Callable[[ModuleType, int], None]


def cap_environment(memory: int, total: int) -> dict[str, str]:
    """Variables for a job granted `memory` bytes of a GPU with `total` bytes (fractional grant, one GPU).

    Args:
        memory: the grant, in bytes.
        total: the GPU's total memory, in bytes.

    Returns:
        The variables to set in the job process before `install_caps()`.

    Raises:
        InvalidRequestError: not whole numbers of bytes, or not 0 < memory <= total.
    """
    for name, value in (("grant", memory), ("total", total)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequestError(f"the GPU memory {name} must be a whole number of bytes, not {value!r}")
    if not 0 < memory <= total:
        raise InvalidRequestError(f"a GPU memory grant must be more than 0 and at most the GPU's {total} bytes, "
                                  f"not {memory}")
    fraction = _fraction(memory, total)
    return {
        MEMORY_VAR: str(memory),
        TOTAL_VAR: str(total),
        FRACTION_VAR: fraction,
        JAX_FRACTION_VAR: fraction,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "CUPY_GPU_MEMORY_LIMIT": str(memory),
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }


def _fraction(memory: int, total: int) -> str:
    """memory / total in decimal, rounded down to FRACTION_DIGITS places: never above the grant."""
    scale = 10**FRACTION_DIGITS
    scaled = memory * scale // total
    if scaled == 0:
        raise InvalidRequestError(f"a grant of {memory} bytes is too small a share of {total} bytes")
    whole, part = divmod(scaled, scale)
    return f"{whole}.{part:0{FRACTION_DIGITS}d}".rstrip("0").rstrip(".")


def install_caps() -> None:
    """Called in the job process after the environment is set and before the payload is unpickled.
    Does nothing unless RPYCDL_GPU_MEMORY is set; then arranges that PyTorch and TensorFlow, if and
    when the job imports them, respect the grant. Never imports a framework itself."""
    value = os.environ.get(MEMORY_VAR)
    if not value:
        return
    try:
        memory = int(value)
    except ValueError:
        _warn("any framework", ValueError(f"{MEMORY_VAR}={value!r} is not a number of bytes"))
        return
    if JAX_NEW_FRACTION_VAR in os.environ and JAX_FRACTION_VAR in os.environ:
        os.environ[JAX_NEW_FRACTION_VAR] = os.environ.pop(JAX_FRACTION_VAR)
    if any(isinstance(finder, _PostImportHooks) for finder in sys.meta_path):
        return
    pending: dict[str, Hook] = {}
    for name, hook in _HOOKS.items():
        if name in sys.modules:  # imported already: too late to wait for the import
            _run_hook(name, hook, sys.modules[name], memory)
        else:
            pending[name] = hook
    sys.meta_path.insert(0, _PostImportHooks(pending, memory))


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """For the top-level names in `hooks` only: finds the real spec through the other finders and
    wraps its loader so that the hook runs right after the module executes. Any other name is
    left to the other finders, untouched."""

    def __init__(self, hooks: dict[str, Hook], memory: int) -> None:
        self.hooks = hooks
        self.memory = memory

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and not isinstance(spec.loader, _HookedLoader):
            spec.loader = _HookedLoader(spec.loader, self)
        return spec

    def executed(self, module: ModuleType) -> None:
        hook = self.hooks.pop(module.__name__, None)
        if hook is not None:
            _run_hook(module.__name__, hook, module, self.memory)


class _HookedLoader:
    """A module's own loader, plus a call to the finder once the module has executed. Afterwards
    the module refers to its own loader again."""

    def __init__(self, loader: Any, finder: _PostImportHooks) -> None:
        self.loader = loader
        self.finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.finder.executed(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_source ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


def _cap_torch(torch: ModuleType, memory: int) -> None:
    cuda = torch.cuda

    def apply() -> None:
        # In a queued call, an exception would fail CUDA's initialisation (DeferredCudaCallError):
        # report it and let the job go on, under the watchdog.
        try:
            for device in reversed(range(cuda.device_count())):  # ends on device 0, the default
                total = cuda.get_device_properties(device).total_memory
                cuda.set_per_process_memory_fraction(min(1.0, memory / total), device)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the job to the watchdog
            _warn("PyTorch", exc)

    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:
        apply()  # initialises CUDA now; only PyTorch versions without _lazy_call get here
    else:
        lazy_call(apply)


def _cap_tensorflow(tf: ModuleType, memory: int) -> None:
    config = tf.config
    gpus = config.list_physical_devices("GPU")
    limit = max(1, memory // MiB)
    for gpu in gpus:
        config.set_logical_device_configuration(gpu, [config.LogicalDeviceConfiguration(memory_limit=limit)])
    experimental = getattr(config, "experimental", None)
    original = getattr(experimental, "set_memory_growth", None)
    if original is None or not gpus:
        return

    def set_memory_growth(device: Any, enable: bool) -> None:
        """rpycdl: on a GPU capped to this job's grant, growth is on already (TF_FORCE_GPU_ALLOW_GROWTH)."""
        if device in gpus:
            return None
        return original(device, enable)

    experimental.set_memory_growth = set_memory_growth


_HOOKS: dict[str, Hook] = {"torch": _cap_torch, "tensorflow": _cap_tensorflow}
_NAMES = {"torch": "PyTorch", "tensorflow": "TensorFlow"}


def _run_hook(name: str, hook: Hook, module: ModuleType, memory: int) -> None:
    try:
        hook(module, memory)
    except Exception as exc:  # noqa: BLE001 - the import must succeed; the watchdog still holds the job
        _warn(_NAMES.get(name, name), exc)


def _warn(framework: str, exc: BaseException) -> None:
    detail = " ".join(f"{type(exc).__name__}: {exc}".split())
    print(f"rpycdl: warning: could not hold {framework} to this job's GPU memory grant ({detail}); "
          "the server's watchdog still stops the job if it uses more than its grant", file=sys.stderr, flush=True)
