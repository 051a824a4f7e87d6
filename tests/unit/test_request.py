"""A request checked at the service's edge (rpycdl.server.request)."""

from __future__ import annotations

import math
import re

import pytest

from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.gpu.inventory import FakeInventory
from rpycdl.scheduler.shares import GPURequest
from rpycdl.security.auth import ANONYMOUS
from rpycdl.server import request
from rpycdl.server.context import ServerContext


@pytest.fixture
def context(tmp_path) -> ServerContext:
    return ServerContext(name="pytorch", aliases=("PYTORCH",), inventory=FakeInventory("fake:2"),
                         lock_dir=str(tmp_path), state_dir=str(tmp_path / "state"), server_id="test")


@pytest.mark.parametrize("value", [-1, 0, math.nan, math.inf, "3", True, 367 * 24 * 3600])
def test_bad_timeouts_are_refused_by_name(value):
    with pytest.raises(InvalidRequestError, match=re.escape(f"timeout={value!r}: must be a positive number")):
        request.check_seconds(value, "timeout")


def test_options_come_positionally_or_by_name_never_both():
    names = ("ngpus", "timeout")
    assert request.named(names, (2,), {"timeout": 5}) == {"ngpus": 2, "timeout": 5}
    with pytest.raises(InvalidRequestError, match="ngpus given twice"):
        request.named(names, (2,), {"ngpus": 1})
    with pytest.raises(InvalidRequestError, match="unknown option colour="):
        request.named(names, (), {"colour": "blue"})
    with pytest.raises(InvalidRequestError, match="too many arguments"):
        request.named(names, (1, 2, 3), {})


def test_a_request_is_checked_once_against_the_server(context):
    checked = request.build(context, ANONYMOUS, "127.0.0.1:1", ngpus=-1, timeout=5, body=b"x")
    assert checked.gpu_request == GPURequest(2) and checked.timeout == 5.0 and checked.queue_timeout is None
    with pytest.raises(InvalidRequestError, match="this server has 2"):
        request.build(context, ANONYMOUS, "127.0.0.1:1", ngpus=3)


def test_a_payload_over_the_limit_is_refused_by_the_option_that_sets_it():
    with pytest.raises(LimitError, match="--max-payload"):
        request.check_size(b"x" * 10, "payload", 8, beside=0)
    request.check_size(b"x" * 4, "payload", 8, beside=4)
