"""The client's callbacks that stay the same from call to call (rpycdl.client.session): a stream's sink, and a
connection's receiver of a result's buffers, which one call at a time holds."""

from __future__ import annotations

import io

import pytest

from rpycdl.client.session import Receiver, sink
from rpycdl.errors import InvalidRequestError


def test_a_stream_gets_the_same_sink_each_call_and_a_sink_writes_and_flushes():
    out = io.StringIO()
    assert sink(out) is sink(out) and sink(out) is not sink(io.StringIO())
    sink(out)("epoch 1\n")
    assert out.getvalue() == "epoch 1\n"


def test_a_receiver_puts_buffers_into_the_list_of_the_call_holding_it_and_a_second_call_gets_its_own():
    receiver = Receiver(lambda layout, framed: [f"buffer of {size} bytes" for size, _ in layout])
    first, second = [], []
    with receiver.taken(first) as receive:
        # a bound method, which RPyC proxies without asking the client for its class's methods
        assert type(receive).__name__ == "method" and receive.__self__ is receiver
        held = receive
        with receiver.taken(second) as other:  # a call while another holds it (the server refuses it)
            assert other is not held
            other(((5, True),))
        receive(((3, True), (4, False)))
    assert first == ["buffer of 3 bytes", "buffer of 4 bytes"] and second == ["buffer of 5 bytes"]
    with pytest.raises(InvalidRequestError, match="no call of this connection waits for a result"):
        receiver(((1, True),))
    with receiver.taken(second) as receive:  # free again, and the same object (the server keeps its proxy)
        assert receive is held
