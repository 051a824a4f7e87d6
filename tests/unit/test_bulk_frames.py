"""Large buffers beside RPyC stay in step with RPyC's messages (rpycdl.wire.bulk): a message the peer sent
before the buffers is served, not read as their bytes, and one another thread sends while they go waits for
them. Two real RPyC connections over loopback, one served by a thread."""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import rpyc

from rpycdl.wire import bulk, stream
from rpycdl.wire.stream import BulkSocketStream, FramedChannel

SIZE = 3 << 20


class Peer(rpyc.Service):
    """The side whose callback sends the buffers, telling `note` something before, or while, it does."""

    def on_connect(self, conn: rpyc.Connection) -> None:
        self.conn = conn

    def exposed_sender(self, data: bytes, note: Callable[[str], None], when: str) -> Callable[[bool], None]:
        def send(framed: bool) -> None:
            if when == "before":  # like the reply to a release of a proxy, on its way as the buffers are asked for
                rpyc.async_(note)("before")
            with bulk.sending(self.conn, framed) as sock, memoryview(data) as view:
                bulk.send_buffers(sock, [pickle.PickleBuffer(view[:SIZE // 2])])
                if when == "meanwhile":  # another thread's message, made while the bytes go
                    thread = threading.Thread(target=rpyc.async_(note), args=("meanwhile",))
                    thread.start()
                    thread.join()
                bulk.send_buffers(sock, [pickle.PickleBuffer(view[SIZE // 2:])])

        return send


@pytest.fixture
def pair() -> Iterator[tuple[rpyc.Connection, rpyc.Connection]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname())
        right, _ = listener.accept()
    config = {"sync_request_timeout": 30}
    ours = rpyc.connect_channel(stream.channel(left, 1 << 30, stall=30), config=config)  # a stall fails, not hangs
    theirs = rpyc.connect_channel(FramedChannel(BulkSocketStream(right), compress=False), service=Peer, config=config)
    serving = rpyc.BgServingThread(theirs)
    yield ours, theirs
    serving.stop()
    stream.close_now(ours)
    stream.close_now(theirs)


@pytest.mark.parametrize("when", ["before", "meanwhile"])
def test_an_rpyc_message_sent_before_or_while_buffers_go_is_served_and_the_buffers_arrive_whole(pair, when):
    ours, _ = pair
    data, notes = os.urandom(SIZE), []
    send = ours.root.sender(data, notes.append, when)
    buffers: list[Any] = bulk.pull(ours, send, [(SIZE // 2, True), (SIZE - SIZE // 2, True)])
    assert b"".join(buffers) == data and notes == [when]
    assert ours.root.sender(b"", notes.append, "") is not None  # the stream is still in step
