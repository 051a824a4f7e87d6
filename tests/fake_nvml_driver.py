"""The fake NVML driver of fake_nvml.py for other processes: with RPYCDL_NVML_MODULE=fake_nvml_driver (and
this directory on PYTHONPATH), a server or a monitor uses it instead of pynvml. Its GPUs are read from
the JSON file $FAKE_NVML_STATE (a list of fake_nvml.Device fields) at every nvmlInit, so a test changes
what the driver reports while the processes run."""

from __future__ import annotations

import json
import os

from fake_nvml import FUNCTIONS, Device, make_nvml

_nvml = make_nvml([])


def nvmlInit() -> None:  # noqa: N802 - pynvml's name
    with open(os.environ["FAKE_NVML_STATE"]) as state:
        _nvml.driver.devices[:] = [Device(**fields) for fields in json.load(state)]
    _nvml.nvmlInit()


globals().update({name: getattr(_nvml, name) for name in FUNCTIONS if name != "nvmlInit"})
globals().update({name: getattr(_nvml, name) for name in dir(_nvml) if name.startswith("NVML")})
