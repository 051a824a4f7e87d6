"""The idle watch of --idle-reclaim (rpycdl.gpu.idle) over a fake NVML driver and a clock the test moves, the
limits file's keep_idle key, and the flag's check."""

from __future__ import annotations

import argparse

import pytest
from fake_nvml import Device, make_nvml

from rpycdl.cli import reclaiming
from rpycdl.errors import InvalidRequestError
from rpycdl.gpu.idle import IdleWatch
from rpycdl.gpu.inventory import NvmlInventory
from rpycdl.scheduler import limits
from rpycdl.scheduler.attempts import RECLAIMED, cause
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.states import JobState

UUIDS = ["GPU-a1000000-0000-0000-0000-000000000000", "GPU-a1000001-0000-0000-0000-000000000001"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watch(nvml, uuids=UUIDS) -> tuple[IdleWatch, Clock]:
    clock = Clock()
    return IdleWatch(NvmlInventory(nvml=nvml, environ={}), uuids, interval=1.0, clock=clock), clock


def test_idle_time_counts_from_the_grant_and_starts_over_when_a_gpu_is_used():
    nvml = make_nvml([Device(UUIDS[0]), Device(UUIDS[1], bus_id="00000000:08:00.0")])
    watch, clock = _watch(nvml)
    assert watch.idle_for() == 0
    clock.now += 5
    assert watch.idle_for() == 5
    nvml.driver.devices[1].utilization = 3  # one of its GPUs used: not idle
    clock.now += 1
    assert watch.idle_for() == 0
    nvml.driver.devices[1].utilization = 0
    clock.now += 2
    assert watch.idle_for() == 2


def test_only_the_jobs_gpus_count_and_an_unknown_utilization_counts_as_busy():
    nvml = make_nvml([Device(UUIDS[0], utilization=90), Device(UUIDS[1], bus_id="00000000:08:00.0")])
    watch, clock = _watch(nvml, [UUIDS[1]])
    clock.now += 4
    assert watch.idle_for() == 4  # GPU 0 is someone else's
    nvml.driver.devices[1].lost = True  # the driver cannot say: nothing is reclaimed on a guess
    clock.now += 1
    assert watch.idle_for() == 0


def test_it_asks_the_driver_once_per_interval():
    nvml = make_nvml([Device(UUIDS[0])])
    watch, clock = _watch(nvml, [UUIDS[0]])
    watch.idle_for()
    asked = nvml.driver.calls.count("nvmlInit")
    clock.now += 0.5
    watch.idle_for()
    assert nvml.driver.calls.count("nvmlInit") == asked
    assert nvml.driver.init_count == 0  # shut down after each look


def test_keep_idle_is_a_whole_number_in_any_table():
    read = limits.load({"default": {"keep_idle": 1}, "users": {"dana": {"keep_idle": 3}}}, "limits.toml")
    assert [bound.value for bound in read.bounds("dana", "keep_idle")] == [3]
    assert [bound.where for bound in read.bounds("fay", "keep_idle")] == ["default.keep_idle"]
    with pytest.raises(InvalidRequestError, match="default.keep_idle must be a whole number"):
        limits.load({"default": {"keep_idle": 1.5}}, "limits.toml")


def test_a_reclaimed_attempt_is_a_cause_to_requeue():
    record = JobRecord("j", "s", "c", 1, state=JobState.FAILED, error_type="IdleReclaimedError",
                       request={"retries": 1})
    assert cause(record, crashed=False, signaled=False) == RECLAIMED


@pytest.mark.parametrize(("given", "seconds"), [("off", 0.0), ("30m", 1800.0), ("90", 90.0)])
def test_the_flag_takes_a_duration_or_off(given, seconds):
    assert reclaiming.limits(argparse.Namespace(idle_reclaim=given)) == {"idle_reclaim": seconds}


def test_the_flag_refuses_what_is_not_a_duration():
    with pytest.raises(InvalidRequestError):
        reclaiming.limits(argparse.Namespace(idle_reclaim="soon"))
