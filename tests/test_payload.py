"""Large payloads: bytes, bytearrays and NumPy arrays travel beside the RPyC call (out of band),
arrive intact as the same types, respect --max-payload, and a client that dies in the middle of
a transfer leaves nothing behind. Real servers on loopback; no timing checks (see bench/)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import Background, connection_processes, gate_job, open_gate, server_pid, wait_idle, wait_until

import rpycdl
from rpycdl.wire import codec

MiB = 1 << 20


@pytest.fixture
def np():
    return pytest.importorskip("numpy")


@pytest.mark.parametrize("mib", [64, 300])
def test_bytes_arrive_and_come_back_intact_as_bytes(conn, mib):
    data = os.urandom(mib * MiB)

    def job(blob):
        import hashlib

        return type(blob).__name__, hashlib.sha256(blob).hexdigest(), blob

    kind, digest, same = conn.root.run_code(job, data, timeout=120)
    assert (kind, digest) == ("bytes", hashlib.sha256(data).hexdigest())
    assert type(same) is bytes and same == data
    assert hash(same) == hash(data)  # a real bytes object, hashable like any other


def test_numpy_arrays_arrive_and_come_back_with_dtype_shape_order_and_flags(conn, np):
    rng = np.random.default_rng(7)
    arrays = {"c": rng.random((1024, 8 * 1024)),  # 64 MiB of float64
              "fortran": np.asfortranarray(rng.integers(0, 255, (2048, 4096), dtype=np.uint8)),
              "strided": rng.random((2048, 1024))[:, ::2],  # not contiguous: copied once by NumPy's pickling
              "read_only": np.frombuffer(os.urandom(8 * MiB), dtype=np.int32)}

    def job(given):
        return {name: (a.dtype.str, a.shape, a.flags.f_contiguous, a.flags.writeable, float(a.sum()))
                for name, a in given.items()}, given

    seen, back = conn.root.run_code(job, arrays, timeout=120)
    for name, array in arrays.items():
        assert seen[name] == (array.dtype.str, array.shape, array.flags.f_contiguous, array.flags.writeable,
                              float(array.sum())), name
        assert type(back[name]) is np.ndarray and back[name].dtype == array.dtype
        assert np.array_equal(back[name], array) and back[name].flags.f_contiguous == array.flags.f_contiguous
    assert not back["read_only"].flags.writeable and back["c"].flags.writeable
    back["c"][0, 0] = -1.0  # a writable result is the client's own memory


def test_a_job_may_change_its_argument_array_in_place(conn, np):
    array = np.arange(16 * MiB // 8, dtype=np.float64)

    def job(a):
        a *= 2
        return a

    assert np.array_equal(conn.root.run_code(job, array), array * 2)


def test_an_array_over_the_spool_size_arrives_in_a_file_of_the_state_directory(server, cluster, connect, np):
    from rpycdl.defaults import SPOOL_MIN

    port = server()
    array = np.arange((SPOOL_MIN + MiB) // 8, dtype=np.float64)

    def job(a):
        address = a.__array_interface__["data"][0]
        for line in open("/proc/self/maps"):
            span, _, _, _, _, *path = line.split(maxsplit=5)
            start, end = (int(bound, 16) for bound in span.split("-"))
            if start <= address < end:
                a *= 2  # writable, as any argument array
                return " ".join(path).strip(), float(a[-1])
        return None, None

    where, last = connect(port).root.run_code(job, array, timeout=120)
    assert last == 2 * array[-1]
    state = os.path.realpath(os.path.join(cluster.lock_dir, "state"))
    assert where.startswith(state) and where.endswith("(deleted)"), where  # a file without a name: nothing is left


def test_large_buffers_nested_in_containers_arrive_intact_and_shared_ones_once(conn, np):
    blob = os.urandom(5 * MiB)
    array = np.random.default_rng(1).random(MiB)  # 8 MiB
    value = {"list": [blob, array, bytearray(blob), b"small", np.arange(3)],
             "again": blob,  # the same object twice: one buffer, one object on arrival
             "tuple": ("text", [array[::2].copy(), {"deep": blob[:2 * MiB]}]),
             "arrays": [np.full(MiB // 8 * 3, i, dtype=np.int64) for i in range(5)]}

    def job(v):
        return v, v["list"][0] is v["again"], type(v["list"][2]).__name__

    back, shared, kind = conn.root.run_code(job, value, timeout=120)
    assert shared and kind == "bytearray"
    assert back["list"][0] == blob and back["list"][0] is back["again"]
    assert np.array_equal(back["list"][1], array) and back["list"][2] == bytearray(blob)
    assert back["list"][3] == b"small" and np.array_equal(back["list"][4], np.arange(3))
    assert back["tuple"][0] == "text" and np.array_equal(back["tuple"][1][0], array[::2])
    assert back["tuple"][1][1]["deep"] == blob[:2 * MiB]
    assert all(np.array_equal(a, np.full(MiB // 8 * 3, i, dtype=np.int64)) for i, a in enumerate(back["arrays"]))


def test_a_large_argument_with_an_exception_and_output_behaves_as_before(conn, capsys):
    data = os.urandom(32 * MiB)

    def job(blob):
        print("got", len(blob), flush=True)
        raise ValueError(f"no thanks, {len(blob)}")

    with pytest.raises(ValueError, match=f"no thanks, {len(data)}") as info:
        conn.root.run_code(job, data)
    assert "raise ValueError" in info.value.remote_traceback
    assert f"got {len(data)}" in capsys.readouterr().out

    def printer(n):
        print("before the result", flush=True)
        return bytes(n)

    assert conn.root.run_code(printer, 16 * MiB) == bytes(16 * MiB)
    assert "before the result" in capsys.readouterr().out


def test_over_tls_large_buffers_arrive_intact(server, team, np):
    port = server("pytorch", "fake:1", *team.server_args())
    data, array = os.urandom(64 * MiB), np.random.default_rng(3).random(4 * MiB)
    with rpycdl.connect(host="127.0.0.1", port=port, **team.user("alice")) as conn:
        blob, back = conn.root.run_code(lambda v: v, (data, array), timeout=120)
    assert blob == data and np.array_equal(back, array)


def test_the_in_band_path_of_servers_before_out_of_band_buffers_still_carries_them(conn, np):
    conn.root._buffers_beside = False  # as if the server had no run_buffers: everything in the pickle
    data, array = os.urandom(8 * MiB), np.random.default_rng(5).random(MiB)
    blob, back = conn.root.run_code(lambda v: v, (data, array))
    assert blob == data and np.array_equal(back, array)


def test_a_job_dying_while_it_sends_its_result_is_a_crash_and_the_connection_goes_on(conn, np, tmp_path):
    def job(directory):
        import mmap
        import os

        import numpy

        path = os.path.join(directory, "shrinking")
        with open(path, "wb") as file:
            file.truncate(64 << 20)
        with open(path, "r+b") as file:
            memory = mmap.mmap(file.fileno(), 64 << 20)
        os.truncate(path, 16 << 20)  # the pages past 16 MiB are gone: writing them out fails half-way
        return numpy.frombuffer(memory, dtype=numpy.uint8)

    with pytest.raises(rpycdl.JobCrashedError, match="while sending its result"):
        conn.root.run_code(job, str(tmp_path))
    assert conn.root.run_code(lambda v: v, "still serving") == "still serving"


def test_buffers_of_a_request_that_waits_are_test_loaded_and_then_run(server, connect, np, tmp_path, monkeypatch):
    (tmp_path / "client_only_work.py").write_text("def work(a):\n    return a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from client_only_work import work  # travels by name: the server cannot load it

    port = server("pytorch", "fake:1")
    gate = str(tmp_path / "gate")
    holder = Background(connect(port), gate_job(gate), "held")
    holder.wait_state("running")
    array = np.random.default_rng(9).random(2 * MiB)  # 16 MiB
    waiter = Background(connect(port), lambda a: (float(a.sum()), a), array)
    waiter.wait_state("pending")
    with pytest.raises(rpycdl.InvalidRequestError, match="cannot be loaded on this server.*client_only_work"):
        connect(port).root.run_code(work, array, queue_timeout=30)  # refused while it waits
    open_gate(gate)
    total, back = waiter.result()
    assert holder.result() == "held" and total == float(array.sum()) and np.array_equal(back, array)


# -- limits ----------------------------------------------------------------------------------


def test_a_call_whose_buffers_are_over_the_limit_is_refused_by_name_before_sending(server, connect, np):
    conn = connect(server("pytorch", "fake:1", "--max-payload", "4MiB"))
    for too_big in (os.urandom(5 * MiB), np.zeros(5 * MiB // 8), [os.urandom(3 * MiB), np.zeros(3 * MiB // 8)]):
        with pytest.raises(rpycdl.LimitError, match="--max-payload"):
            conn.root.run_code(lambda v: 0, too_big)
    assert conn.root.run_code(lambda v: len(v), os.urandom(3 * MiB)) == 3 * MiB


def test_the_server_refuses_buffers_over_the_limit_without_asking_for_them(server, connect):
    """What a client that does not check sends: the server refuses by name and never calls `send`,
    so no byte of the buffers is read (or memory allocated for them) and the connection goes on."""
    conn = connect(server("pytorch", "fake:1", "--max-payload", "4MiB"))
    payload, buffers = codec.encode_call(lambda v: len(v), os.urandom(8 * MiB))
    asked = []
    outcome = conn._conn.root.run_buffers(payload, codec.layout(buffers), lambda: asked.append("send"),
                                          lambda layout: asked.append("receive"))
    with pytest.raises(rpycdl.LimitError, match=r"over this server's limit .*--max-payload"):
        codec.decode_outcome(outcome)
    assert asked == []
    assert conn.root.run_code(lambda v: len(v), os.urandom(2 * MiB)) == 2 * MiB


@pytest.mark.parametrize("layout", [((MiB, True), (MiB, True)), ((0, True),), [(MiB, True)], ((MiB, 1),),
                                    ((MiB, True),) * (codec.MAX_BUFFERS + 1)])
def test_a_layout_that_does_not_match_or_make_sense_is_refused_before_any_transfer(conn, layout):
    payload, buffers = codec.encode_call(lambda v: len(v), os.urandom(MiB))
    asked = []
    outcome = conn._conn.root.run_buffers(payload, layout, lambda: asked.append("send"),
                                          lambda layout: asked.append("receive"))
    with pytest.raises(rpycdl.InvalidRequestError, match="layout|out-of-band buffers"):
        codec.decode_outcome(outcome)
    assert asked == []
    assert conn.root.run_code(lambda v: v, "still serving") == "still serving"


# -- a client that dies in the middle of a transfer ---------------------------------------------

DYING_CLIENT = textwrap.dedent('''
    import os
    import sys

    import rpycdl
    from rpycdl.wire import bulk, stream

    port, way, directory, size = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])


    def send_half_then_die(sock, buffers):
        with buffers[0].raw() as view:
            stream.send_view(sock, view[:size // 2])
        print("half sent", flush=True)
        os._exit(3)


    def receive_half_then_die(sock, layout):
        stream.receive_view(sock, memoryview(bytearray(size // 2)))
        print("half received", flush=True)
        os._exit(3)


    def receive_half_then_interrupt(sock, layout):
        stream.receive_view(sock, memoryview(bytearray(size // 2)))
        print("half received", flush=True)
        raise KeyboardInterrupt  # Ctrl-C in the middle of a result


    def job(args):
        import os

        with open(os.path.join(args["dir"], "job.pid"), "w") as f:
            f.write(str(os.getpid()))
        return b"\\x01" * args["size"]


    bulk.send_buffers, bulk.receive_buffers = send_half_then_die, receive_half_then_die
    conn = rpycdl.connect(host="127.0.0.1", port=port)
    if way == "argument":
        conn.root.run_code(lambda blob: len(blob), os.urandom(size))
    elif way == "result":
        conn.root.run_code(job, {"dir": directory, "size": size})
    else:  # interrupted
        bulk.receive_buffers = receive_half_then_interrupt
        try:
            conn.root.run_code(job, {"dir": directory, "size": size})
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(4)
''')


def _ours_in_dev_shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "rpycdl" in name}


@pytest.mark.parametrize("way", ["argument", "result"])
def test_a_client_dying_mid_transfer_leaves_nothing_behind_and_the_server_goes_on(way, cluster, server, connect,
                                                                                   lock_dir, tmp_path):
    port = server("pytorch", "fake:1")
    pid = server_pid(cluster, port)
    status = connect(port)
    before, shm_before = set(connection_processes(pid)), _ours_in_dev_shm()
    size = 256 * MiB
    client = subprocess.run([sys.executable, "-c", DYING_CLIENT, str(port), way, str(tmp_path), str(size)],
                            capture_output=True, text=True, timeout=120)
    assert client.returncode == 3 and f"half {'sent' if way == 'argument' else 'received'}" in client.stdout, \
        client.stdout + client.stderr

    wait_until(lambda: set(connection_processes(pid)) == before, what="the dead client's connection process to exit")
    if way == "result":
        job_pid = int((tmp_path / "job.pid").read_text())
        wait_until(lambda: not Path(f"/proc/{job_pid}").exists(), what="the job process to be gone")
        assert [job["state"] for job in status.root.jobs()] == ["CANCELLED"]
    else:
        assert status.root.jobs() == []  # it never got as far as a job
    wait_idle(status)
    left = [str(p.relative_to(lock_dir)) for p in Path(lock_dir).rglob("*")
            if p.parent.name in ("queue", "held") or p.name.endswith(".tmp")]
    assert left == []
    assert _ours_in_dev_shm() == shm_before

    data = os.urandom(64 * MiB)
    digest = connect(port).root.run_code(lambda blob: __import__("hashlib").sha256(blob).hexdigest(), data)
    assert digest == hashlib.sha256(data).hexdigest()


def test_ctrl_c_in_the_middle_of_a_large_result_ends_the_call_at_once(cluster, server, connect, tmp_path):
    port = server("pytorch", "fake:1")
    status = connect(port)
    client = subprocess.run([sys.executable, "-c", DYING_CLIENT, str(port), "interrupted", str(tmp_path),
                             str(256 * MiB)], capture_output=True, text=True, timeout=30)
    assert client.returncode == 4 and "half received" in client.stdout and "interrupted" in client.stdout, \
        client.stdout + client.stderr
    wait_until(lambda: [job["state"] for job in status.root.jobs()] == ["CANCELLED"], what="the job to be cancelled")
    wait_idle(status)
    assert connect(port).root.run_code(lambda x: x, "still serving") == "still serving"


FRESH_SINKS_CLIENT = textwrap.dedent('''
    import io
    import sys

    import numpy as np

    import rpycdl

    port, calls = int(sys.argv[1]), int(sys.argv[2])
    conn = rpycdl.connect(host="127.0.0.1", port=port)
    rng = np.random.default_rng(3)
    for call in range(calls):
        array = rng.random((2 + call % 2) * 2**17)  # 2 or 3 MiB of float64
        out = io.StringIO()  # a new stream each call: the server lets go of the one before's proxy

        def job(values):
            print("sum", float(values.sum()))
            return values * 2

        doubled = conn.root.run_code(job, array, stdout=out)
        assert (doubled == array * 2).all() and out.getvalue().split() == ["sum", str(float(array.sum()))], call
        print("call", call, flush=True)
    print("done", calls, flush=True)
''')


def test_multi_mib_arguments_with_a_new_stdout_each_call_never_interleave_with_rpyc(server, np):
    """Large arguments while the server drops the sink of the call before: RPyC's messages (its request to let
    go of a proxy, and the client's reply) used to land between the request for the buffers and their raw bytes,
    which put the stream out of step (a hang or a dropped connection)."""
    port = server("pytorch", "fake:1")
    calls = 40
    client = subprocess.run([sys.executable, "-c", FRESH_SINKS_CLIENT, str(port), str(calls)],
                            capture_output=True, text=True, timeout=120)  # a hang fails here, naming the last call
    assert client.returncode == 0 and f"done {calls}" in client.stdout, client.stdout + client.stderr
