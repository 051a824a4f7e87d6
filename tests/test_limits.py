"""Server limits: each refusal is a clear error naming the limit, and the server goes on serving."""

from __future__ import annotations

import time

import pytest
from helpers import Background, gate_job, open_gate

import rpycdl


def test_a_payload_over_the_limit_is_refused_by_name(server, connect):
    conn = connect(server("pytorch", "fake:1", "--max-payload", "1MiB"))
    with pytest.raises(rpycdl.LimitError, match="--max-payload"):
        conn.root.run_code(lambda blob: len(blob), b"x" * (2 << 20))
    assert conn.root.run_code(lambda blob: len(blob), b"x" * 1000) == 1000


def test_a_frame_over_the_limit_drops_only_that_connection(server, connect):
    port = server("pytorch", "fake:1", "--max-payload", "1MiB")
    raw = connect(port)
    with pytest.raises(EOFError):
        raw._conn.root.run(b"x" * (3 << 20), 1)  # what a client that does not check would send
    assert connect(port).root.run_code(lambda x: x, "still serving") == "still serving"


def test_a_full_queue_refuses_by_name(server, connect, tmp_path):
    port = server("pytorch", "fake:1", "--max-queued", "1")
    gate = str(tmp_path / "gate")
    holder = Background(connect(port), gate_job(gate), "held")
    holder.wait_state("running")
    waiter = Background(connect(port), lambda x: x, "waited")
    waiter.wait_state("pending")
    with pytest.raises(rpycdl.LimitError, match=r"queue is full.*--max-queued"):
        connect(port).root.run_code(lambda x: x, "refused")
    open_gate(gate)
    assert holder.result() == "held" and waiter.result() == "waited"


def test_an_idle_connection_is_closed_and_others_are_served(server, connect):
    port = server("pytorch", "fake:1", "--idle-timeout", "1")
    idle = connect(port)
    time.sleep(3)
    with pytest.raises(EOFError):
        idle.root.run_code(lambda x: x, 1)
    busy = connect(port)
    assert busy.root.run_code(lambda seconds: __import__("time").sleep(seconds) or "long job", 2) == "long job"
