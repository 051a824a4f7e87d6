"""What comes back: values by value, remote exceptions with their remote traceback, big payloads."""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import hashlib
import os
import sys
import traceback

import pytest

import rpycdl


class ModuleLevelError(Exception):
    """Defined at module level in this test module, which the server cannot import."""


SAMPLE = {
    "list": [1, 2.5, "three", None, True],
    "tuple": (1, (2, 3)),
    "set": {1, 2, 3},
    "bytes": bytes(range(256)),
    "nested": {"a": [{"b": {"c": [1, 2]}}]},
    "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
    "when": datetime.datetime(2024, 2, 29, 12, 30),
    "decimal": decimal.Decimal("1.10"),
    "fraction": fractions.Fraction(1, 3),
    "big": 2**100,
    "text": "ünïcødé ✓",
}


def test_return_values_come_back_by_value(conn):
    def job(args):
        import os

        return {**args, "pid": os.getpid()}  # a new dict, built on the server

    value = conn.root.run_code(job, SAMPLE)
    assert type(value) is dict  # a real dict, not an RPyC proxy of the server's
    assert value.pop("pid") != os.getpid()
    assert value == SAMPLE
    assert type(value["list"]) is list and type(value["tuple"]) is tuple and type(value["ordered"]) is \
        collections.OrderedDict
    value["list"].append("mine")  # local: changing it costs no round trip and touches nothing remote
    assert conn.root.run_code(lambda x: x, None) is None


def test_a_local_class_instance_comes_back_as_one(conn):
    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

    def job(n):
        return [Point(i, i * i) for i in range(n)]

    points = conn.root.run_code(job, 3)
    assert [(p.x, p.y) for p in points] == [(0, 0), (1, 1), (2, 4)]
    assert type(points[0]).__name__ == "Point"


@pytest.mark.parametrize("kind", [ValueError, KeyError, ZeroDivisionError])
def test_builtin_exception_is_raised_as_the_same_type_with_the_remote_traceback(conn, kind):
    def failing_job(args):
        import os

        pid = os.getpid()
        if args is ZeroDivisionError:
            return pid / 0
        raise args(f"remote failure in {pid}")

    with pytest.raises(kind) as info:
        conn.root.run_code(failing_job, kind)
    exc = info.value
    assert type(exc) is kind
    tb = exc.remote_traceback
    assert "Traceback (most recent call last)" in tb
    assert __file__ in tb and "in failing_job" in tb  # the remote frame
    if kind is ZeroDivisionError:
        assert "return pid / 0" in tb
    else:
        assert "raise args(f\"remote failure in {pid}\")" in tb
        remote_pid = int(str(exc).strip("'\"").rsplit(" ", 1)[1])
        assert remote_pid != os.getpid()
    last = traceback.extract_tb(exc.__traceback__)[-1]  # raised from the job's own frame, with its source line
    assert (last.filename, last.name) == (__file__, "failing_job") and last.line in tb
    if sys.version_info >= (3, 11):  # 3.10 has no notes
        assert any("raised in the job on the rpycdl server" in text for text in exc.__notes__)


def test_exception_class_local_to_the_test_comes_back_rebuilt_by_value(conn):
    class LocalError(Exception):
        pass

    def job(args):
        raise LocalError("local", args)

    with pytest.raises(Exception) as info:
        conn.root.run_code(job, 7)
    exc = info.value
    # dill carries the class by value: the client gets a rebuilt class of the same name, not RemoteError
    # (and not the very same class object, so `except LocalError` would not catch it)
    assert not isinstance(exc, rpycdl.RemoteError)
    assert type(exc).__qualname__ == LocalError.__qualname__
    assert exc.args == ("local", 7)
    assert "raise LocalError(\"local\", args)" in exc.remote_traceback


def test_exception_class_at_module_level_of_the_test_cannot_travel_to_the_server(conn):
    def job(args):
        raise ModuleLevelError(args)

    # dill sends module-level classes by reference; this test module is not importable on the server,
    # so the callable itself cannot be loaded there, and that is what the client is told (the same
    # words as when a waiting request finds it out: tests/test_requests.py)
    with pytest.raises(rpycdl.InvalidRequestError,
                       match=f"cannot be loaded on this server: ModuleNotFoundError: .*{__name__}") as info:
        conn.root.run_code(job, 7)
    assert info.value.remote_traceback == ""  # dill's frames, and nothing of the job's: the message says it all


def test_exception_whose_type_exists_only_on_the_server_comes_back_as_remote_error(conn, tmp_path):
    def job(directory):
        import sys
        from pathlib import Path

        Path(directory, "server_only_pkg.py").write_text("class ServerOnlyError(Exception):\n    pass\n")
        sys.path.insert(0, directory)
        import server_only_pkg

        raise server_only_pkg.ServerOnlyError("out of memory on the card")

    with pytest.raises(rpycdl.RemoteError) as info:
        conn.root.run_code(job, str(tmp_path))
    exc = info.value
    assert exc.type_name == "server_only_pkg.ServerOnlyError"
    assert "out of memory on the card" in str(exc)
    assert "raise server_only_pkg.ServerOnlyError" in exc.remote_traceback


def test_exception_that_cannot_be_rebuilt_keeps_its_name_message_and_traceback(conn):
    def job(args):
        class NeedsTwo(Exception):
            def __init__(self, first, second):
                super().__init__(f"{first} and {second}")

        raise NeedsTwo("one", "two")

    with pytest.raises(rpycdl.RemoteError) as info:
        conn.root.run_code(job, None)
    exc = info.value
    assert exc.type_name.endswith("NeedsTwo")
    assert "one and two" in str(exc)
    assert "raise NeedsTwo(\"one\", \"two\")" in exc.remote_traceback


def test_unpicklable_return_value_gives_a_clear_error(conn):
    def job(_):
        return (i for i in range(3))

    with pytest.raises(TypeError, match="return value could not be serialised.*generator"):
        conn.root.run_code(job, None)
    status = conn.root.gpu_status()
    assert all(not gpu["holders"] for gpu in status["gpus"])
    assert conn.root.run_code(lambda x: x, "still serving") == "still serving"


def test_return_value_the_client_cannot_load_gives_a_clear_error(conn, tmp_path):
    def job(directory):
        import sys
        from pathlib import Path

        Path(directory, "server_only_values.py").write_text("class Tensor:\n    pass\n")
        sys.path.insert(0, directory)
        import server_only_values

        return server_only_values.Tensor()

    with pytest.raises(rpycdl.RemoteError, match="could not be loaded here.*server_only_values"):
        conn.root.run_code(job, str(tmp_path))


def test_20_mb_of_bytes_round_trip_intact_as_argument_and_return_value(conn):
    data = os.urandom(20 * 2**20)

    def job(blob):
        import hashlib

        return len(blob), hashlib.sha256(blob).hexdigest(), blob

    size, digest, same = conn.root.run_code(job, data, timeout=60)
    assert size == len(data)
    assert digest == hashlib.sha256(data).hexdigest()  # the argument arrived intact
    assert same == data  # and the value came back intact


@pytest.mark.slow
def test_a_job_longer_than_rpycs_30_second_default_comes_back(conn):
    def job(seconds):
        import time

        time.sleep(seconds)
        return seconds

    assert conn.root.run_code(job, 31) == 31


def test_a_result_over_the_servers_payload_limit_is_refused_and_not_held(server, connect):
    # A value is read into the connection process's memory (all of it, where it does not travel out
    # of band): what it may hold there is bounded by --max-payload, as a call is.
    conn = connect(server("pytorch", "fake:1", "--max-payload", "1MiB"))
    with pytest.raises(rpycdl.LimitError, match=r"result is over this server's limit of 1048576 bytes"):
        conn.root.run_code(lambda n: list(range(n)), 1_000_000)  # about 5 MB of pickle, in band
    assert conn.root.run_code(lambda n: len(list(range(n))), 1_000_000) == 1_000_000
    assert [job["state"] for job in conn.root.jobs()] == ["SUCCEEDED", "FAILED"]  # newest first
