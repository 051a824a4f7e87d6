"""In-process caps for fractional grants (rpycdl.gpu.caps): the variables, and the import hooks that
hold PyTorch and TensorFlow to the grant, played against fake frameworks in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest

from rpycdl.errors import InvalidRequestError
from rpycdl.gpu import caps

MiB = 1 << 20
GiB = 1 << 30
TOTAL = 16 * GiB  # the GPU's total as the server (NVML) reports it
CUDA_TOTAL = 15 * GiB + 512 * MiB  # the total the fake PyTorch reports: a little less, as CUDA's can be
GRANT = 3 * GiB + 512 * 1024  # not a whole number of MiB
REPO = str(Path(__file__).resolve().parents[1])

FAKE_TORCH_CUDA = '''
"""A fake torch.cuda: records what it is asked, and initialises CUDA only when _lazy_init() is called."""
import os

calls = []
_queued = []
_initialized = False


class DeferredCudaCallError(Exception):
    pass


class _Properties:
    total_memory = int(os.environ.get("FAKE_TORCH_TOTAL", str(16 << 30)))


def device_count():
    calls.append(["device_count"])
    return int(os.environ.get("FAKE_TORCH_DEVICES", "1"))


def get_device_properties(device):
    return _Properties()


def set_per_process_memory_fraction(fraction, device=None):
    if os.environ.get("FAKE_TORCH_FAIL"):
        raise RuntimeError("this fake refuses")
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    calls.append(["fraction", fraction, device])


def _lazy_call(callable, **kwargs):
    if _initialized:
        callable()
    else:
        _queued.append(callable)


def _lazy_init():
    """As torch's: runs the queued calls, and an exception in one fails the initialisation."""
    global _initialized
    if _initialized:
        return
    calls.append(["init"])
    for queued in _queued:
        try:
            queued()
        except Exception as exc:
            raise DeferredCudaCallError(f"CUDA call failed lazily at initialization with error: {exc}") from exc
    _initialized = True


if os.environ.get("FAKE_TORCH_NO_LAZY_CALL"):
    del _lazy_call
'''

FAKE_TF_CONFIG = '''
"""A fake tf.config: physical devices, logical device configurations, refused once "started"."""
import os
from collections import namedtuple

from . import experimental  # noqa: F401

PhysicalDevice = namedtuple("PhysicalDevice", "name device_type")
LogicalDeviceConfiguration = namedtuple("LogicalDeviceConfiguration", "memory_limit")
calls = []
configured = {}
_devices = [PhysicalDevice("/physical_device:CPU:0", "CPU")] + [
    PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(int(os.environ.get("FAKE_TF_GPUS", "1")))]


def list_physical_devices(device_type=None):
    return [d for d in _devices if device_type in (None, d.device_type)]


def set_logical_device_configuration(device, logical_devices):
    if os.environ.get("FAKE_TF_STARTED"):
        raise RuntimeError("Virtual devices cannot be modified after being initialized")
    configured[device] = logical_devices
    calls.append(["logical", device.name, [d.memory_limit for d in logical_devices]])
'''

FAKE_TF_EXPERIMENTAL = '''
def set_memory_growth(device, enable):
    """As TensorFlow's: refused on a device with a logical device configuration."""
    from tensorflow import config

    if device in config.configured:
        raise ValueError("Cannot set memory growth on device when virtual devices configured")
    config.calls.append(["growth", device.name, enable])
'''

PRELUDE = '''
import json, os, sys
from rpycdl.gpu import caps
grant = json.loads(os.environ.pop("TEST_GRANT"))
if grant:
    os.environ.update(caps.cap_environment(*grant))
caps.install_caps()
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A site directory with fake `torch` and `tensorflow` packages and a plain package."""
    root = tmp_path / "site"
    files = {
        "torch/__init__.py": "from . import cuda  # noqa: F401\n",
        "torch/cuda/__init__.py": FAKE_TORCH_CUDA,
        "tensorflow/__init__.py": "from . import config  # noqa: F401\n",
        "tensorflow/config/__init__.py": FAKE_TF_CONFIG,
        "tensorflow/config/experimental.py": FAKE_TF_EXPERIMENTAL,
        "plainpkg/__init__.py": "",
        "plainpkg/sub.py": "VALUE = 42\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _job(site: Path, code: str, grant: tuple[int, int] | None = (GRANT, TOTAL), **env: str) -> tuple[object, str]:
    """Run PRELUDE (the job process's environment and install_caps) then `code` in a fresh Python;
    returns the JSON of the last line it printed, and its stderr."""
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith(("RPYCDL_", "XLA_", "CUPY_", "TF_", "FAKE_"))}
    environ.update(PYTHONPATH=os.pathsep.join([str(site), REPO]), TEST_GRANT=json.dumps(grant), **env)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the job failed:\n{done.stderr}"
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


def _fractions(calls: list[list[object]]) -> dict[object, float]:
    return {call[2]: call[1] for call in calls if call[0] == "fraction"}


# --- the variables ---------------------------------------------------------------------------


def test_the_environment_names_the_grant_for_every_framework():
    assert caps.cap_environment(GiB, 4 * GiB) == {
        "RPYCDL_GPU_MEMORY": str(GiB),
        "RPYCDL_GPU_MEMORY_TOTAL": str(4 * GiB),
        "RPYCDL_GPU_MEMORY_FRACTION": "0.25",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "CUPY_GPU_MEMORY_LIMIT": str(GiB),
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    assert caps.cap_environment(TOTAL, TOTAL)["RPYCDL_GPU_MEMORY_FRACTION"] == "1"


@pytest.mark.parametrize(("memory", "total"), [(1, 3), (2, 3), (GRANT, TOTAL), (GiB, 80 * 10**9),
                                               (7 * GiB + 1, 81559 * MiB), (TOTAL - 1, TOTAL), (1, 10**9)])
def test_the_fraction_is_rounded_down_never_above_the_grant(memory, total):
    env = caps.cap_environment(memory, total)
    fraction = env["RPYCDL_GPU_MEMORY_FRACTION"]
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == fraction
    assert Fraction(fraction) <= Fraction(memory, total) < Fraction(fraction) + Fraction(1, 10**caps.FRACTION_DIGITS)
    assert int(float(fraction) * total) <= memory  # as XLA computes its cap: total * fraction, truncated


@pytest.mark.parametrize(("memory", "total"), [(0, TOTAL), (-1, TOTAL), (TOTAL + 1, TOTAL), (0.5, TOTAL),
                                               (True, TOTAL), ("1", TOTAL), (GiB, float(TOTAL)), (1, 10**10)])
def test_a_grant_that_is_not_a_share_of_the_gpu_is_refused(memory, total):
    with pytest.raises(InvalidRequestError):
        caps.cap_environment(memory, total)


# --- PyTorch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [1, 2])
def test_the_torch_fraction_waits_for_cuda_to_initialise_then_caps_each_device_at_the_grant(site, devices):
    result, stderr = _job(site, """
        import torch
        before = list(torch.cuda.calls)
        torch.cuda._lazy_init()
        print(json.dumps({"before": before, "after": torch.cuda.calls}))
    """, FAKE_TORCH_TOTAL=str(CUDA_TOTAL), FAKE_TORCH_DEVICES=str(devices))
    assert result["before"] == [], "importing torch touched CUDA"
    assert result["after"][0] == ["init"]
    fractions = _fractions(result["after"])
    assert sorted(fractions) == list(range(devices))
    for fraction in fractions.values():
        assert abs(fraction * CUDA_TOTAL - GRANT) < 1  # of PyTorch's own total: the grant, to the byte
    assert "warning" not in stderr


def test_a_torch_without_lazy_call_is_capped_when_imported(site):
    result, _ = _job(site, """
        import torch
        print(json.dumps(torch.cuda.calls))
    """, FAKE_TORCH_NO_LAZY_CALL="1")
    assert list(_fractions(result)) == [0]


def test_a_torch_imported_before_install_caps_is_capped_too(site):
    result, _ = _job(site, f"""
        import torch
        os.environ.update(caps.cap_environment({GRANT}, {TOTAL}))
        caps.install_caps()
        torch.cuda._lazy_init()
        print(json.dumps(torch.cuda.calls))
    """, grant=None)
    assert list(_fractions(result)) == [0]


def test_installing_twice_hooks_once(site):
    result, _ = _job(site, """
        caps.install_caps()
        import torch
        torch.cuda._lazy_init()
        print(json.dumps({"hooks": [type(f).__name__ for f in sys.meta_path].count("_PostImportHooks"),
                          "calls": torch.cuda.calls}))
    """)
    assert result["hooks"] == 1
    assert len([call for call in result["calls"] if call[0] == "fraction"]) == 1


# --- TensorFlow ------------------------------------------------------------------------------


def test_tensorflow_gets_a_logical_device_of_the_grant_in_mib_on_each_gpu(site):
    result, stderr = _job(site, """
        import tensorflow as tf
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)  # the usual idiom, refused by TF once configured
        print(json.dumps({"calls": tf.config.calls, "growth": os.environ["TF_FORCE_GPU_ALLOW_GROWTH"]}))
    """, FAKE_TF_GPUS="2")
    assert result["calls"] == [["logical", f"/physical_device:GPU:{i}", [GRANT // MiB]] for i in range(2)]
    assert GRANT // MiB == 3072
    assert result["growth"] == "true"
    assert "warning" not in stderr


# --- failures, and everything else -----------------------------------------------------------


@pytest.mark.parametrize(("framework", "code", "env"), [
    ("PyTorch", "import torch\ntorch.cuda._lazy_init()\nprint(json.dumps(torch.cuda._initialized))",
     {"FAKE_TORCH_FAIL": "1"}),
    ("TensorFlow", "import tensorflow as tf\nprint(json.dumps(tf.config.calls == []))", {"FAKE_TF_STARTED": "1"}),
])
def test_a_failing_hook_warns_in_one_line_and_the_job_goes_on(site, framework, code, env):
    result, stderr = _job(site, code, **env)
    assert result is True  # CUDA initialised / tensorflow imported, in spite of the failure
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, stderr
    assert warnings[0].startswith("rpycdl: warning:") and framework in warnings[0] and "watchdog" in warnings[0]


def test_a_job_that_imports_no_framework_loads_none(site):
    result, _ = _job(site, """
        import email.message
        import plainpkg.sub
        print(json.dumps({
            "hooked": [type(f).__name__ for f in sys.meta_path],
            "loaded": sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "tensorflow", "jax", "cupy")),
            "plain": plainpkg.sub.VALUE,
        }))
    """)
    assert "_PostImportHooks" in result["hooked"]
    assert result["loaded"] == []
    assert result["plain"] == 42


def test_without_a_grant_nothing_is_hooked(site):
    result, _ = _job(site, """
        import torch
        torch.cuda._lazy_init()
        print(json.dumps({"hooked": [type(f).__name__ for f in sys.meta_path], "calls": torch.cuda.calls}))
    """, grant=None)
    assert "_PostImportHooks" not in result["hooked"]
    assert result["calls"] == [["init"]]


def test_other_imports_and_lookups_work_and_torch_keeps_its_own_loader(site):
    result, _ = _job(site, """
        import importlib.util
        import plainpkg.sub
        found = importlib.util.find_spec("torch")
        looked_only = "torch" not in sys.modules
        import torch
        from torch.cuda import device_count  # noqa: F401
        try:
            import no_such_module  # noqa: F401
        except ModuleNotFoundError:
            missing = True
        print(json.dumps({
            "plain": plainpkg.sub.VALUE, "found": found.name, "looked_only": looked_only, "missing": missing,
            "loader": type(torch.__loader__).__name__, "spec_loader": type(torch.__spec__.loader).__name__,
        }))
    """)
    assert result == {"plain": 42, "found": "torch", "looked_only": True, "missing": True,
                      "loader": "SourceFileLoader", "spec_loader": "SourceFileLoader"}


def test_an_inherited_new_name_of_the_jax_fraction_takes_the_grant(site):
    result, _ = _job(site, """
        print(json.dumps({k: os.environ.get(k) for k in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}))
    """, XLA_CLIENT_MEM_FRACTION="0.9")
    fraction = caps.cap_environment(GRANT, TOTAL)["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert result == {"XLA_CLIENT_MEM_FRACTION": fraction, "XLA_PYTHON_CLIENT_MEM_FRACTION": None}
