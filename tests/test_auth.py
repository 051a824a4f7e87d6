"""Shared-secret authentication: only clients that know the secret run code, the client checks
the server too, and failed attempts never hurt the server."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

import rpycdl
from rpycdl.errors import ConnectionDroppedError
from rpycdl.security import auth
from rpycdl.site.local import one_account, start


def _secret(path: Path, text: str = "correct horse battery staple") -> str:
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture
def secret(tmp_path) -> str:
    return _secret(tmp_path / "secret")


@pytest.fixture
def secured(server, secret) -> int:
    """A server that requires the secret."""
    return server("pytorch", "fake:2", "--secret-file", secret)


def test_a_client_with_the_secret_runs_code(secured, secret):
    with rpycdl.connect(host="127.0.0.1", port=secured, secret_file=secret) as conn:
        assert conn.root.run_code(lambda x: x * 2, 21) == 42


def test_discovery_with_the_secret_from_the_environment(secured, secret, cluster, monkeypatch):
    monkeypatch.setenv("RPYCDL_SECRET_FILE", secret)
    with rpycdl.connect("pytorch", registry_address=cluster.registry_address) as conn:
        assert conn.address[1] == secured
        assert conn.root.run_code(lambda x: x + 1, 1) == 2


def test_a_wrong_secret_is_refused_and_the_server_keeps_serving(secured, secret, tmp_path):
    wrong = _secret(tmp_path / "wrong", "not the team's secret at all")
    for _ in range(3):
        with pytest.raises(rpycdl.AuthFailedError, match="wrong shared secret"):
            rpycdl.connect(host="127.0.0.1", port=secured, secret_file=wrong)
    with rpycdl.connect(host="127.0.0.1", port=secured, secret_file=secret) as conn:
        assert conn.root.run_code(lambda x: x, "still serving") == "still serving"


def test_a_client_without_the_secret_gets_nothing_done(secured, secret):
    with pytest.raises(rpycdl.AuthFailedError, match=r"requires authentication \(secret\)"):
        rpycdl.connect(host="127.0.0.1", port=secured)
    with rpycdl.connect(host="127.0.0.1", port=secured, secret_file=secret) as conn:
        assert conn.root.gpu_status()["queue"] == []


def test_a_silent_client_does_not_block_others(secured, secret):
    idle = socket.create_connection(("127.0.0.1", secured))  # connects and says nothing
    try:
        started = time.monotonic()
        with rpycdl.connect(host="127.0.0.1", port=secured, secret_file=secret) as conn:
            assert conn.root.run_code(lambda x: x, 1) == 1
        assert time.monotonic() - started < 3
    finally:
        idle.close()


def test_a_hello_that_comes_in_pieces_is_taken_and_a_false_one_refused(secured, secret):
    key = auth.load_secret(secret)
    assert key is not None
    sock = socket.create_connection(("127.0.0.1", secured))
    sock.sendall(auth.HELLO[:4])
    time.sleep(0.2)  # (the gate may look before the rest comes, or after: both are taken)
    sock.sendall(auth.HELLO[4:])
    assert auth.read_banner(sock) == {"secret"}
    auth.client_handshake(sock, key)  # the server read the hello, not the proof, in those bytes
    sock.close()
    false = socket.create_connection(("127.0.0.1", secured))
    false.sendall(auth.HELLO[:4])
    time.sleep(0.2)
    false.sendall(b"X" * 60)
    assert auth.read_banner(false) == {"secret"}
    with pytest.raises((rpycdl.AuthFailedError, ConnectionDroppedError)):  # closed (with unread bytes: reset)
        auth.client_handshake(false, key)
    false.close()
    with rpycdl.connect(host="127.0.0.1", port=secured, secret_file=secret) as conn:  # and it serves on
        assert conn.root.run_code(lambda x: x, 1) == 1


def test_the_client_refuses_a_server_that_does_not_know_the_secret(server, secret, tmp_path):
    rogue = server("pytorch", "fake:2", "--secret-file", _secret(tmp_path / "rogue", "a rogue server's own secret"))
    with pytest.raises(rpycdl.AuthFailedError):
        rpycdl.connect(host="127.0.0.1", port=rogue, secret_file=secret)
    open_server = server("pytorch", "fake:2")  # no authentication at all: it must not get our job either
    with pytest.raises(rpycdl.AuthFailedError, match="does it require authentication"):
        rpycdl.connect(host="127.0.0.1", port=open_server, secret_file=secret)


def test_a_secret_lets_a_server_listen_beyond_loopback_without_insecure(secret):
    process = start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--host", "0.0.0.0", "--port", "0",
                     "--registry", "none", "--lock-dir", os.path.dirname(secret) + "/locks", "--secret-file", secret,
                     *one_account()])
    try:
        line = process.wait_for(r"on 0\.0\.0\.0:\d+ as .*authentication: secret").group(0)
        assert "WARNING" not in "\n".join(process.lines), line
    finally:
        process.stop()


@pytest.mark.parametrize("text, mode, message", [
    ("short", 0o600, "too short"),
    ("long enough to be a secret", 0o644, "readable by others"),
])
def test_weak_secret_files_are_refused(tmp_path, text, mode, message):
    path = tmp_path / "secret"
    path.write_text(text)
    os.chmod(path, mode)
    with pytest.raises(rpycdl.InvalidRequestError, match=message):
        rpycdl.connect(host="127.0.0.1", port=1, secret_file=str(path))
