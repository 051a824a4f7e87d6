"""What a request asks for, checked and rounded to the server's unit (rpycdl.scheduler.shares)."""

from __future__ import annotations

import math

import pytest

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.shares import GPURequest, ShareRules, parse_request
from rpycdl.units import GiB, MiB

SIZES = [16 * GiB, 16 * GiB, 8 * GiB]


def ask(ngpus=None, gpus=None, gpu_memory=None, rules: ShareRules | None = None) -> GPURequest:
    return parse_request(ngpus, gpus, gpu_memory, SIZES, rules or ShareRules())


def test_whole_gpus_default_to_one_and_minus_one_means_all():
    assert ask() == GPURequest(1)
    assert ask(ngpus=2) == GPURequest(2)
    assert ask(ngpus=-1) == GPURequest(3)
    assert ask(gpus=2) == GPURequest(2)  # a whole number of GPUs, as Ray's num_gpus


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ngpus": 4}, "asked for 4 GPUs but this server has 3"),
    ({"ngpus": 0}, "at least 1"),
    ({"ngpus": 1.5}, "must be an integer"),
    ({"ngpus": True}, "must be an integer"),
    ({"gpus": 1.5}, "neither a share"),
    ({"gpus": -0.5}, "positive number"),
    ({"gpus": math.nan}, "positive number"),
    ({"gpu_memory": "17GiB"}, "largest GPU here has 16 GiB"),
    ({"gpu_memory": 0}, "must be positive"),
    ({"gpu_memory": 1.5}, "a size like"),
    ({"gpus": 0.5, "gpu_memory": "1GiB"}, "not both"),
    ({"ngpus": 1, "gpus": 0.5}, "without ngpus"),
])
def test_impossible_requests_say_what_is_wrong(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        ask(**kwargs)


def test_a_share_is_rounded_up_to_the_unit_and_a_fraction_counts_on_the_smallest_gpu():
    assert ask(gpu_memory="1000MiB") == GPURequest(1, 1024 * MiB)  # the default unit is 256 MiB
    assert ask(gpus=0.25) == GPURequest(1, 2 * GiB)  # a quarter of the smallest, 8 GiB
    assert ask(gpu_memory="1GiB", rules=ShareRules(unit="1/4")) == GPURequest(1, 2 * GiB)
    assert ask(gpu_memory="16GiB") == GPURequest(1, 16 * GiB)  # up to the largest GPU, never past it


@pytest.mark.parametrize(("unit", "message"), [("1/0", "1 to 1024 parts"), ("512KiB", "smallest unit is 1MiB"),
                                               ("lots", "not a memory size")])
def test_bad_units_are_refused(unit, message):
    with pytest.raises(InvalidRequestError, match=message):
        ShareRules(unit=unit)
