"""Impossible requests fail at once with InvalidRequestError and a clear message, and leave the server well."""

from __future__ import annotations

import math
import os
import sys

import dill
import pytest
from helpers import Background, gate_job, idle, open_gate, refusal, wait_idle

import rpycdl
from rpycdl.wire import codec

BAD_NGPUS = [
    (0, ["ngpus", "at least 1", "-1"]),
    (-2, ["ngpus", "at least 1", "-2"]),
    (5, ["5", "4"]),
    (1.5, ["ngpus", "integer", "1.5"]),
    ("2", ["ngpus", "integer", "'2'"]),
    (True, ["ngpus", "integer", "True"]),
]
BAD_SECONDS = [-1, -0.5, 0, math.nan, math.inf, "3", "soon"]


@pytest.fixture
def busy(server, connect, tmp_path):
    """A fake:4 server whose four GPUs are all held by a running job until the test opens the gate.

    An invalid request that were queued instead of refused would wait here, and the test would say so."""
    port = server("pytorch", "fake:4")
    gate = str(tmp_path / "gate")
    holder = Background(connect(port), gate_job(gate), "held", ngpus=4)
    holder.wait_state("running")
    yield connect(port), holder, gate
    open_gate(gate)
    holder.join()


def test_bad_ngpus_fail_at_once_with_a_clear_message(busy):
    conn, holder, gate = busy
    problems = []
    for ngpus, words in BAD_NGPUS:
        error = refusal(lambda n=ngpus: conn.root.run_code(lambda x: x, 1, ngpus=n, queue_timeout=30))
        if not isinstance(error, rpycdl.InvalidRequestError):
            problems.append(f"ngpus={ngpus!r}: raised {error!r}, not InvalidRequestError")
        elif missing := [w for w in words if w not in str(error)]:
            problems.append(f"ngpus={ngpus!r}: message {str(error)!r} lacks {missing}")
    assert not problems, "\n".join(problems)
    assert not holder.done  # the holder was never disturbed


@pytest.mark.parametrize("name", ["timeout", "queue_timeout"])
def test_bad_timeouts_fail_at_once_with_a_clear_message(busy, name):
    conn, _, _ = busy
    problems = []
    for value in BAD_SECONDS:
        error = refusal(lambda v=value: conn.root.run_code(lambda x: x, 1, ngpus=1, **{name: v}))
        if not isinstance(error, rpycdl.InvalidRequestError):
            problems.append(f"{name}={value!r}: raised {error!r}, not InvalidRequestError")
        elif name not in str(error) or repr(value) not in str(error):
            problems.append(f"{name}={value!r}: message {str(error)!r} names neither the setting nor the value")
    assert not problems, "\n".join(problems)


def test_fn_that_is_not_callable_is_refused(busy):
    conn, _, _ = busy
    for fn in (42, "print('hi')", None, [lambda x: x], {"fn": len}):
        error = refusal(lambda f=fn: conn.root.run_code(f, 1))
        assert isinstance(error, rpycdl.InvalidRequestError), f"{fn!r}: {error!r}"
        assert "callable" in str(error) and type(fn).__name__ in str(error)


def test_unreadable_dill_bytes_as_fn_are_refused_before_waiting(busy):
    conn, _, _ = busy
    good = dill.dumps(lambda x: x, recurse=True)
    for fn in (good[: len(good) // 2], b"not dill at all", b""):
        error = refusal(lambda f=fn: conn.root.run_code(f, 1, queue_timeout=30))
        assert isinstance(error, rpycdl.InvalidRequestError), f"{fn[:20]!r}: {error!r}"
        assert "fn" in str(error) and "dill" in str(error)


def test_a_callable_the_server_cannot_load_is_refused_while_waiting(busy, tmp_path, monkeypatch):
    # A function of a module only the client has travels by name: the server finds out it cannot
    # load it while the request waits for GPUs, not after.
    (tmp_path / "client_only_module.py").write_text("def work(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from client_only_module import work

    conn, holder, _ = busy
    error = refusal(lambda: conn.root.run_code(work, 1, queue_timeout=30))
    assert isinstance(error, rpycdl.InvalidRequestError), repr(error)
    assert "cannot be loaded on this server" in str(error) and "client_only_module" in str(error)
    assert not holder.done
    assert conn.root.gpu_status()["queue"] == []


def test_a_callable_the_server_cannot_load_gives_the_same_error_granted_at_once_or_after_waiting(
        busy, server, connect, tmp_path, monkeypatch):
    (tmp_path / "client_only_module2.py").write_text("def work(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from client_only_module2 import work

    waited = refusal(lambda: busy[0].root.run_code(work, 1, queue_timeout=30))
    at_once = refusal(lambda: connect(server("pytorch", "fake:1")).root.run_code(work, 1))
    assert type(waited) is type(at_once) is rpycdl.InvalidRequestError, (waited, at_once)
    assert str(waited) == str(at_once), (str(waited), str(at_once))
    assert "cannot be loaded on this server: ModuleNotFoundError" in str(at_once)


def test_dill_bytes_of_something_not_callable_give_invalid_request(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    with pytest.raises(rpycdl.InvalidRequestError, match="int, not a callable"):
        conn.root.run_code(dill.dumps(42), None, queue_timeout=10)


def test_server_keeps_serving_and_holds_no_lock_after_invalid_requests(server, connect):
    port = server("pytorch", "fake:4")
    conn = connect(port)
    for ngpus, _ in BAD_NGPUS:
        with pytest.raises(rpycdl.InvalidRequestError):
            conn.root.run_code(lambda x: x, 1, ngpus=ngpus)
    for value in BAD_SECONDS:
        with pytest.raises(rpycdl.InvalidRequestError):
            conn.root.run_code(lambda x: x, 1, timeout=value)
        with pytest.raises(rpycdl.InvalidRequestError):
            conn.root.run_code(lambda x: x, 1, queue_timeout=value)
    with pytest.raises(rpycdl.InvalidRequestError):
        _raw(conn, b"garbage")
    assert idle(conn)
    assert not [job for job in conn.root.jobs() if job["state"] in ("pending", "running")]
    # the same connection, and a new one, still run jobs on every GPU (a leaked lock would time out)
    assert conn.root.run_code(lambda x: x + 1, 1, ngpus=-1, queue_timeout=5) == 2
    assert connect(port).root.run_code(lambda x: x * 3, 2, ngpus=4, queue_timeout=5) == 6
    # the reply goes out before the job process is reaped and its GPUs released (promise 3: within a second)
    wait_idle(conn)


def test_ngpus_minus_one_gets_every_gpu(server, connect):
    conn = connect(server("pytorch", "fake:4"))

    def job(_):
        import os

        return os.environ["CUDA_VISIBLE_DEVICES"], os.environ["RPYCDL_GPU_UUIDS"].split(",")

    visible, uuids = conn.root.run_code(job, None, ngpus=-1)
    assert visible == "0,1,2,3"
    assert uuids == [gpu["uuid"] for gpu in conn.root.gpu_status()["gpus"]]
    assert len(set(uuids)) == 4


def _raw(conn: rpycdl.Connection, payload, ngpus=1):
    """Send a payload straight to the server's exposed run, as a hand-made client would, and decode it."""
    return codec.decode_outcome(conn._conn.root.run(payload, ngpus, None, None, None, 30))


def test_corrupt_and_truncated_payloads_give_invalid_request(busy):
    conn, _, _ = busy
    header = codec.MAGIC + bytes(codec.PYTHON)
    good = codec.encode_payload(lambda x: x, 1)
    payloads = {
        "truncated": good[: len(good) // 2],
        "cut before the end": good[:-1],
        "header only": header,
        "corrupt body": header + b"\x80\x04\x95garbage that is not a pickle",
        "random body": header + os.urandom(64).replace(b".", b"-"),
        "no magic": b"hello, server" + good[len(codec.MAGIC):],
        "magic only": codec.MAGIC,
        "empty": b"",
        "a string": "RPYCDL1 but a str",
        "an int": 12345,
    }
    problems = []
    for what, payload in payloads.items():
        error = refusal(lambda p=payload: _raw(conn, p))
        if not isinstance(error, rpycdl.InvalidRequestError):
            problems.append(f"{what}: {error!r}")
    assert not problems, "\n".join(problems)
    # the well-formed payload is accepted (it waits for the busy GPUs, so give it one that is never free)
    error = refusal(lambda: _raw(conn, good, ngpus=5))
    assert isinstance(error, rpycdl.InvalidRequestError) and "4" in str(error)


def test_payload_of_the_wrong_shape_gives_invalid_request(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    header = codec.MAGIC + bytes(codec.PYTHON)
    for body in (dill.dumps(42), dill.dumps((1, 2)), dill.dumps((b"\x80\x04garbage", None, True))):
        error = refusal(lambda b=body: _raw(conn, header + b))
        assert isinstance(error, rpycdl.InvalidRequestError), f"{body!r}: {error!r}"
    assert _raw(conn, header + dill.dumps((lambda x: x * 2, 21, False), recurse=True)) == 42


class _MakesDirectoryWhenUnpickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_payload_from_another_python_gives_version_mismatch_before_unpickling(busy, tmp_path):
    conn, holder, gate = busy
    marker = tmp_path / "unpickled"
    body = dill.dumps((_MakesDirectoryWhenUnpickled(str(marker)), None, False))
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    for payload in (codec.MAGIC + bytes((3, 7)) + body, codec.MAGIC + bytes((3, 7)) + b"garbage"):
        error = refusal(lambda p=payload: _raw(conn, p))
        assert isinstance(error, rpycdl.VersionMismatchError), repr(error)
        assert "3.7" in str(error) and mine in str(error), str(error)
    assert not marker.exists(), "the server unpickled a payload from another Python"
    # with this Python's version the same body is unpickled (in the job), so the marker does tell; once
    # the GPUs are free, so that it is granted at once (a request that waits is test-loaded first)
    open_gate(gate)
    holder.join()
    wait_idle(conn)
    with pytest.raises(rpycdl.InvalidRequestError, match="not a callable"):
        _raw(conn, codec.MAGIC + bytes(codec.PYTHON) + body)
    assert marker.is_dir()


def test_a_second_job_on_a_busy_connection_is_refused_and_the_first_goes_on(server, connect, tmp_path):
    # The second call would be served inside the first one's wait, so it must be refused, not nested.
    port = server("pytorch", "fake:4")
    conn = connect(port)
    gate = str(tmp_path / "gate")
    first = Background(conn, gate_job(gate), "first", ngpus=1)
    first.wait_state("running")
    second = Background(conn, lambda x: x, "second", ngpus=1)
    second.join()
    assert isinstance(second.error, rpycdl.InvalidRequestError), second.error
    assert "one connection per" in str(second.error)
    open_gate(gate)
    assert first.result() == "first"
    assert conn.root.run_code(lambda x: x + 1, 1) == 2  # the connection serves jobs again
