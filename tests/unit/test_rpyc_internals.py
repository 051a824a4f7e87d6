"""What rpycdl relies on in rpyc beyond its public API (setup.py pins rpyc's minor version for this):
the private methods and attributes it overrides or uses must still be there, with the parameters it
passes. A new rpyc that changes one fails here, by name, before any server misbehaves."""

from __future__ import annotations

import inspect
import socket

import pytest
import rpyc
from rpyc.core import netref
from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream
from rpyc.utils.server import ForkingServer

METHODS = [
    (ForkingServer, "_authenticate_and_serve_client", ["self", "sock"]),  # called by server.forking
    (ForkingServer, "_serve_client", ["self", "sock", "credentials"]),  # overridden: rpycdl's stream
    (ForkingServer, "_handle_connection", ["self", "conn"]),  # overridden: idle timeout, after_reply
    (ForkingServer, "accept", ["self"]),  # overridden: spares forked ahead
    (ForkingServer, "_handle_sigchld", ["signum", "unused"]),  # overridden: reaping, the sweeper's wake-up
    (rpyc.Service, "_connect", ["channel", "config"]),  # the connection of a served client (a classmethod)
    (rpyc.Connection, "_netref_factory", ["self", "id_pack"]),  # overridden: the client's root without INSPECT
    (SocketStream, "_connect", ["host", "port", "family", "socktype", "proto", "timeout", "nodelay", "keepalive",
                                "attempts"]),  # the client's socket, authenticated before RPyC
    (netref, "class_factory", ["id_pack", "methods"]),
    (rpyc.Connection, "_dispatch", ["self", "data"]),  # serves what comes before a bulk frame (wire.bulk)
]


@pytest.mark.parametrize(("owner", "name", "parameters"), METHODS,
                         ids=[f"{owner.__name__}.{name}" for owner, name, _ in METHODS])
def test_the_private_methods_rpycdl_uses_are_there(owner, name, parameters):
    method = getattr(owner, name, None)
    assert method is not None, f"rpyc {rpyc.__version__} has no {owner.__name__}.{name}: rpycdl needs it"
    found = list(inspect.signature(method).parameters)
    assert found == parameters, (f"rpyc {rpyc.__version__} changed {owner.__name__}.{name}{tuple(found)}; rpycdl "
                                 f"was written for {tuple(parameters)}")


def test_the_private_attributes_rpycdl_uses_are_there():
    server = ForkingServer(rpyc.Service, hostname="127.0.0.1", port=0)
    left, right = socket.socketpair()
    try:
        assert hasattr(server, "_prevhandler"), "ForkingServer._prevhandler (the SIGCHLD handler it replaced)"
        conn = rpyc.Connection(rpyc.VoidService(), Channel(SocketStream(left)), config={"credentials": None})
        for attribute in ("_config", "_channel", "_remote_root",  # and wire.bulk's, which keep bulk frames whole:
                          "_sendlock", "_send_queue", "_recvlock", "_recv_event"):
            assert hasattr(conn, attribute), f"rpyc {rpyc.__version__}'s Connection has no {attribute}"
        assert conn._channel.stream.sock is left and "sync_request_timeout" in conn._config
        assert hasattr(rpyc.AsyncResult(conn), "_is_ready"), "AsyncResult._is_ready (wire.bulk.receiving)"
        assert Channel.FRAME_HEADER.size == 5 and Channel.FLUSHER == b"\n", "RPyC's frame (wire.stream.BULK_FLAG)"
    finally:
        server.close()
        left.close()
        right.close()
