"""What travels (rpycdl.wire.codec): payloads checked without being run, outcomes, out-of-band buffers."""

from __future__ import annotations

import pickle
import sys

import dill
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpycdl.errors import InvalidRequestError, RemoteError, VersionMismatchError
from rpycdl.wire import codec, function_bytes


def test_a_call_round_trips_with_its_large_buffers_beside_it():
    blob = bytes(range(256)) * 8192  # 2 MiB: out of band
    payload, buffers = codec.encode_call(lambda args: len(args["blob"]), {"blob": blob, "n": 3})
    assert codec.layout(buffers) == ((len(blob), True),)
    body = codec.check_payload(payload, len(buffers))
    fn, args = codec.load_call(body, [buffer.raw() for buffer in buffers])
    assert fn(args) == len(blob) and args["n"] == 3


def test_a_payload_from_another_python_is_refused_before_unpickling():
    payload = codec.encode_payload(len, None)
    other = codec.MAGIC + bytes([3, sys.version_info[1] + 1]) + payload[len(codec.MAGIC) + 2:]
    with pytest.raises(VersionMismatchError, match=r"client runs Python 3\.\d+ but this server"):
        codec.check_payload(other)


def test_the_buffers_a_payload_refers_to_must_all_come():
    payload, buffers = codec.encode_call(len, bytes(2 << 20))
    with pytest.raises(InvalidRequestError, match="refers to 1 out-of-band buffers, and 0 come"):
        codec.check_payload(payload, 0)


@given(st.binary(max_size=200))
def test_any_bytes_are_a_payload_or_a_clear_refusal(junk):
    try:
        codec.check_payload(codec.MAGIC + bytes(codec.PYTHON) + junk)
    except InvalidRequestError:
        pass


@pytest.mark.parametrize("layout", [[(1, True)], ((0, True),), ((1, "yes"),), tuple([(1, True)] * 257),
                                    ((True, True),)])
def test_bad_layouts_are_refused(layout):
    with pytest.raises(InvalidRequestError, match="layout"):
        codec.check_layout(layout)


def test_an_exception_whose_type_cannot_be_rebuilt_comes_back_as_remote_error():
    outcome = codec.FAILED + dill.dumps((None, "server_only.Error", "boom", "Traceback: ..."))
    with pytest.raises(RemoteError, match="server_only.Error: boom") as info:
        codec.decode_outcome(outcome)
    assert info.value.remote_traceback == "Traceback: ..."


def test_a_value_that_cannot_be_pickled_becomes_an_error_outcome():
    outcome, buffers = codec.encode_value(x for x in range(3))  # a generator
    assert not codec.succeeded(outcome) and not buffers
    with pytest.raises(TypeError, match="could not be serialised"):
        codec.decode_outcome(outcome)


def test_plain_data_a_server_answers_with_decodes_like_any_value():
    rows = [{"job_id": "abc", "state": "RUNNING", "request": {"timeout": 1.5, "command": ["a"]}, "result_bytes": None,
             "raw": b"\x00\xff", "ok": True}]
    assert codec.decode_outcome(codec.encode_data(rows)) == rows
    assert codec.succeeded(codec.encode_data(rows))


def test_an_imported_module_travels_by_name_wherever_its_file_lies(tmp_path, monkeypatch):
    """dill copies the namespace of a module whose file lies outside the interpreter's prefix (an editable
    install's); a namespace holding what cannot be pickled then made the call fail. Named, it is the
    receiver's own module."""
    (tmp_path / "editable_thing.py").write_text("import ctypes\nPROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int)\n"
                                                "def answer():\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import editable_thing

    payload = codec.encode_payload(lambda args: editable_thing.answer() + args, 0)
    assert b"PROTOTYPE" not in payload
    fn, args = codec.load_call(codec.check_payload(payload))
    assert fn(args) == 42 and fn.__closure__[0].cell_contents is editable_thing


def _sqlite_user():
    import sqlite3

    db = sqlite3.connect(":memory:")

    def query(args):
        return db.execute(args).fetchone()

    return query


@pytest.mark.parametrize(("fn", "args", "refusal"), [
    (_sqlite_user(), "SELECT 1", r"^query's variable 'db' \(Connection\) cannot be sent: cannot pickle "
                                 r"'sqlite3.Connection' object; create or import it inside the function"),
    (lambda args: args, (n for n in range(2)), r"^the argument \(generator\) cannot be sent: .*; pass plain data"),
])
def test_a_call_that_cannot_be_pickled_is_refused_in_one_line_naming_the_culprit(fn, args, refusal):
    with pytest.raises(InvalidRequestError, match=refusal) as refused:
        codec.encode_call(fn, args)
    assert "\n" not in str(refused.value) and refused.value.__cause__ is None


PLAIN_DATA = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
                          | st.binary(), lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner)
                          | st.dictionaries(st.text(max_size=5), inner, max_size=5), max_leaves=40)


@given(PLAIN_DATA)
def test_small_plain_data_is_pickled_by_the_standard_pickler_into_the_bytes_dill_writes(value):
    assert codec.plain(value)
    outcome, buffers = codec.encode_value(value, out_of_band=True)
    assert outcome == codec.OK + pickle.dumps(value, protocol=5) == codec.OK + codec.dumps(value, True)[0]
    assert buffers == [] and codec.decode_outcome(outcome) == value


def _double(x):
    return 2 * x


@given(PLAIN_DATA)
def test_a_call_of_plain_arguments_is_pickled_by_the_standard_pickler_into_the_bytes_dill_writes(args):
    payload, buffers = codec.encode_call(_double, args)
    body = codec.check_payload(payload)
    sent = function_bytes.kept(_double, lambda fn: codec.dumps(fn)[0])
    assert buffers == [] and body == codec.dumps((sent, args, True), True)[0]
    fn, loaded = codec.load_call(body)
    assert loaded == args and fn(3) == 6


class Pair(tuple):  # a tuple subclass, as a named tuple of the job's script is
    pass


@pytest.mark.parametrize("value", [Pair((1, 2)), [0] * (codec.PLAIN_MAX + 1), bytes(codec.OUT_OF_BAND_MIN),
                                   {"nested": [[0] * 200, [0] * 200]}, {1, 2, len}, object()],
                         ids=["subclass", "too many items", "large bytes", "too many items nested", "a function",
                              "an object"])
def test_anything_else_stays_with_dill(value):
    assert not codec.plain(value)


def test_a_list_holding_itself_is_not_plain_and_still_travels():
    value: list[object] = [1]
    value.append(value)
    assert not codec.plain(value)
    back = codec.decode_outcome(codec.encode_value(value)[0])
    assert back[0] == 1 and back[1] is back
