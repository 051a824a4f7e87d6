"""Arguments that original clients pass by reference (plain RPyC: lists, dicts and sets arrive as
netrefs) are copied by value within bounds: items, bytes, depth and time. What cannot be copied, or
is over a bound, is refused by name before the request reaches the GPU queue, and the server goes on
serving."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import dill
import pytest
import rpyc

from rpycdl.defaults import ARGUMENT_DEPTH, ARGUMENT_ITEMS, ARGUMENT_TIMEOUT

SHOW = dill.dumps(lambda args: repr(args), recurse=True)
"""A job that returns the repr of its arguments, dill bytes as original clients send it."""


@pytest.fixture
def plain(shared_port) -> Iterator[rpyc.Connection]:
    """A plain RPyC connection configured as the original clients were."""
    conn = rpyc.connect("127.0.0.1", shared_port, config={"allow_public_attrs": True})
    yield conn
    conn.close()


def _refusal(conn: rpyc.Connection, args, kind: str, **kwargs) -> str:
    """Call run_code with `args`; check that the server refused them with rpycdl's `kind` of error
    (a plain client sees it as a GenericException of that name) and return its message."""
    with pytest.raises(Exception) as info:  # noqa: PT011 - checked below by the remote type's name
        conn.root.run_code(SHOW, args, ngpus=1, **kwargs)
    assert type(info.value).__name__ == f"rpycdl.errors.{kind}", repr(info.value)
    return str(info.value.args[0])


def _nothing_queued_and_still_serving(port: int, jobs_before: int) -> None:
    """No request of a refused call reached the queue or left a job record, and the server serves."""
    import rpycdl

    with rpycdl.connect(host="127.0.0.1", port=port) as check:
        assert check.root.gpu_status()["queue"] == []
        assert len(check.root.jobs()) == jobs_before
        assert check.root.run_code(lambda x: x, "still serving") == "still serving"


def _jobs(port: int) -> int:
    import rpycdl

    with rpycdl.connect(host="127.0.0.1", port=port) as check:
        return len(check.root.jobs())


def test_nested_containers_of_plain_values_arrive_by_value(plain):
    args = ["ok", [1, 2.5, None, True], {"lr": 0.1, "layers": [64, 32], (1, "a"): {3}},
            (4, [5, {"deep": [6]}]), {7, 8}, frozenset({9}), b"raw", "text", []]
    assert plain.root.run_code(SHOW, args, ngpus=1) == repr(args)


def _generator():
    yield 1


class Anything:
    pass


class Endless(list):
    """A list whose iteration never ends."""

    def __iter__(self):
        return itertools.count()


@pytest.mark.parametrize(("make", "pickle"), [
    (_generator, False), (lambda: itertools.count(), False), (Anything, False), (lambda: Endless([1]), False),
    (lambda: [1, (2, _generator())], False), (_generator, True), (lambda: [1, (2, _generator())], True),
], ids=["generator", "endless iterator", "object", "endless list", "nested generator", "generator, allow_pickle",
        "nested generator, allow_pickle"])
def test_what_cannot_be_copied_by_value_is_refused_by_name(shared_port, make, pickle):
    jobs = _jobs(shared_port)
    conn = rpyc.connect("127.0.0.1", shared_port, config={"allow_public_attrs": True, "allow_pickle": pickle})
    try:
        message = _refusal(conn, make(), "InvalidRequestError")
        assert "cannot be copied by value" in message
    finally:
        conn.close()
    _nothing_queued_and_still_serving(shared_port, jobs)


def test_objects_a_client_lets_pickle_still_arrive_by_value(shared_port):
    np = pytest.importorskip("numpy")
    conn = rpyc.connect("127.0.0.1", shared_port, config={"allow_pickle": True})
    try:
        args = [np.arange(5), {"buffer": bytearray(b"ab")}]
        assert conn.root.run_code(SHOW, args, ngpus=1) == repr(args)
    finally:
        conn.close()


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def _itself() -> list:
    value: list = [1]
    value.append(value)
    return value


@pytest.mark.parametrize(("make", "named"), [
    (lambda: list(range(ARGUMENT_ITEMS + 1)), f"more than {ARGUMENT_ITEMS} items"),
    (lambda: [list(range(1000)) for _ in range(ARGUMENT_ITEMS // 1000 + 1)], f"more than {ARGUMENT_ITEMS} items"),
    (lambda: _nested(ARGUMENT_DEPTH + 1), f"more than {ARGUMENT_DEPTH} levels"),
    (_itself, f"more than {ARGUMENT_DEPTH} levels"),
], ids=["long list", "many lists", "deep", "contains itself"])
def test_arguments_over_a_bound_are_refused_by_name(plain, shared_port, make, named):
    jobs = _jobs(shared_port)
    message = _refusal(plain, make(), "LimitError")
    assert named in message and "rpycdl.defaults" in message
    _nothing_queued_and_still_serving(shared_port, jobs)


def test_arguments_over_the_payload_limit_are_refused_by_name(server):
    port = server("pytorch", "fake:1", "--max-payload", "1MiB")
    conn = rpyc.connect("127.0.0.1", port, config={"allow_public_attrs": True})
    try:
        message = _refusal(conn, ["x" * 600_000, {"more": b"y" * 600_000}], "LimitError")
        assert "--max-payload" in message
        assert conn.root.run_code(SHOW, ["x" * 1000], ngpus=1) == repr(["x" * 1000])
    finally:
        conn.close()
    _nothing_queued_and_still_serving(port, 1)  # the job just above


class _SlowConnection(rpyc.Connection):
    """A plain client's connection that answers the server's requests only once `answer` is set,
    as a client would that is stuck (or whose object blocks in its iteration)."""

    answer = threading.Event()

    def _dispatch_request(self, seq, raw_args):
        self.answer.wait(60)
        super()._dispatch_request(seq, raw_args)


class _SlowService(rpyc.VoidService):
    _protocol = _SlowConnection


def test_a_client_that_does_not_answer_is_refused_after_the_deadline(shared_port):
    jobs = _jobs(shared_port)
    conn = rpyc.connect("127.0.0.1", shared_port, service=_SlowService, config={"allow_public_attrs": True})
    _SlowConnection.answer.clear()
    outcome: dict[str, BaseException] = {}

    def call() -> None:
        try:
            conn.root.run_code(SHOW, [1, 2, 3], ngpus=1)
        except Exception as exc:  # noqa: BLE001 - checked below
            outcome["error"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        _nothing_queued_and_still_serving(shared_port, jobs)  # meanwhile the server serves others
        threading.Timer(ARGUMENT_TIMEOUT + 2, _SlowConnection.answer.set).start()  # a late answer, ignored
        caller.join(ARGUMENT_TIMEOUT + 30)
        assert not caller.is_alive()
        error = outcome.get("error")
        assert type(error).__name__ == "rpycdl.errors.LimitError", repr(error)
        assert f"over {ARGUMENT_TIMEOUT:g} s" in str(error.args[0]) and "rpycdl.defaults" in str(error.args[0])
        assert conn.root.run_code(SHOW, [4], ngpus=1) == "[4]"  # the connection goes on
    finally:
        _SlowConnection.answer.set()
        conn.close()
    _nothing_queued_and_still_serving(shared_port, jobs + 2)
