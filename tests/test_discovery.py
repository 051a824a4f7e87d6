"""Asking the servers the registry lists, as a hostile local user may fill it: listeners that accept and
never speak, registered under another user's service, cost connect(service), rpycdl.job and `rpycdl status`
about a second at most in all; a server that fails TLS verification is skipped with a line in the log; a live
server slower than that second is still found."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import Team, wait_until

import rpycdl
from rpycdl import cli, registry
from rpycdl.client.discovery import ASK_LIMIT, ASK_SETTLE

SILENT = 6
"""Silent entries registered beside the real server (issue 34: six of them cost a connect 30 s)."""


class Silent:
    """A listener on loopback that accepts connections and never says a byte, as a hostile user can leave
    one; it keeps every connection it accepted until closed, and counts those the client closed."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def hung_up(self) -> bool:
        """Whether every connection it accepted was closed by the other end (it reads the end of them)."""
        for conn in self.held:
            conn.settimeout(0)
            try:
                while conn.recv(1 << 16):  # what the client sent before it gave up
                    pass
            except BlockingIOError:
                return False
            except OSError:  # reset: closed too
                pass
        return bool(self.held)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent(cluster) -> Iterator[Callable[..., list[Silent]]]:
    """silent(service, count) -> `count` silent listeners, each announced to the cluster's registry under
    `service` the way any local user can (RPyC's registry client, as `rpycdl serve` announces itself)."""
    made: list[Silent] = []

    def register(service: str = "pytorch", count: int = SILENT) -> list[Silent]:
        client = registry.registry_client(cluster.registry_address)
        listeners = [Silent() for _ in range(count)]
        made.extend(listeners)
        for listener in listeners:
            assert client.register((service.upper(),), listener.port)
        listed = set(registry.discover(service, cluster.registry_address))
        assert {("127.0.0.1", listener.port) for listener in listeners} <= listed
        return listeners

    yield register
    for listener in made:
        listener.close()


class SlowRelay:
    """A live server behind a relay on loopback that holds each connection `delay` seconds before passing
    anything on: a server that answers later than the client's short wait, as one on a loaded machine may."""

    def __init__(self, port: int, delay: float) -> None:
        self.target, self.delay = port, delay
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.opened: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client = self.sock.accept()[0]
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        time.sleep(self.delay)
        upstream = socket.create_connection(("127.0.0.1", self.target))
        self.opened += [client, upstream]
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for sock in self.opened:
            sock.close()


def _asking() -> list[threading.Thread]:
    """The client's threads still asking a server (rpycdl.client.discovery.ask_servers)."""
    return [thread for thread in threading.enumerate() if thread.name.startswith("rpycdl-ask-")]


@pytest.mark.parametrize("auth", ["none", "tls"])
def test_six_silent_registry_entries_cost_a_connect_less_than_two_seconds(cluster, server, silent, team, auth):
    credentials = team.user("alice") if auth == "tls" else {}
    port = server("pytorch", "fake:1", *(team.server_args() if auth == "tls" else []))
    listeners = silent("pytorch")
    where = {"registry_address": cluster.registry_address, **credentials}
    for _ in range(2):
        start = time.monotonic()
        with rpycdl.connect("pytorch", **where) as conn:
            took = time.monotonic() - start
            assert conn.address == ("127.0.0.1", port)
            assert conn.root.run_code(lambda x: x * 2, 21) == 42
        assert took < 2.0, f"connect took {took:.2f} s beside {SILENT} silent entries"
    assert all(listener.held for listener in listeners)  # each was asked, at once
    wait_until(lambda: not _asking(), 5, "the client to stop asking the silent listeners")
    wait_until(lambda: all(listener.hung_up() for listener in listeners), 5, "the client to hang up on each")


def test_a_server_slower_than_the_short_wait_is_still_found(cluster, server, silent):
    port = server("slow", "fake:1")  # reached only through the relay, registered under pytorch
    relay = SlowRelay(port, delay=2 * ASK_SETTLE)
    try:
        assert registry.registry_client(cluster.registry_address).register(("PYTORCH",), relay.port)
        silent("pytorch")
        start = time.monotonic()
        with rpycdl.connect("pytorch", registry_address=cluster.registry_address) as conn:
            took = time.monotonic() - start
            assert conn.address == ("127.0.0.1", relay.port)
            assert conn.root.run_code(lambda x: x + 1, 1) == 2
        assert relay.delay <= took < ASK_LIMIT  # waited for the first live answer, past the short wait
    finally:
        relay.close()


def test_a_server_that_fails_tls_verification_is_skipped_with_a_log_line(cluster, server, team, tmp_path, caplog):
    other = str(tmp_path / "other-ca")  # another CA: its server's certificate is not the team's
    for argv in (["ca", other], ["server", other, "--name", "localhost", "--ip", "127.0.0.1"]):
        assert cli.main(["certs", *argv]) == 0
    impostor = server("pytorch", "fake:8", *Team(other).server_args())  # more free GPUs: it would win on load
    port = server("pytorch", "fake:1", *team.server_args())
    caplog.set_level(logging.WARNING, logger="rpycdl.client.discovery")
    for _ in range(3):
        with rpycdl.connect("pytorch", registry_address=cluster.registry_address, **team.user("alice")) as conn:
            assert conn.address == ("127.0.0.1", port)
    skipped = [record for record in caplog.records if record.name == "rpycdl.client.discovery"]
    assert len(skipped) == 3 and all(record.levelno == logging.WARNING for record in skipped)
    for record in skipped:
        message = record.getMessage()
        assert f"skipped the server at 127.0.0.1:{impostor}" in message and "failed the certificate check" in message


def test_jobs_and_status_that_ask_every_server_are_not_stalled_by_silent_entries(cluster, server, silent, capsys):
    port = server("pytorch", "fake:1")
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        submitted = conn.root.submit_command(["true"], name="quiet-neighbours")
        assert submitted.wait(30).finished
    silent("pytorch")
    where = {"registry_address": cluster.registry_address}
    for ref in (submitted.id, "quiet-neighbours"):  # an id: the first that knows it; a name: every server
        start = time.monotonic()
        found = rpycdl.job(ref, **where)
        took = time.monotonic() - start
        assert found.id == submitted.id
        assert took < 5.0, f"rpycdl.job({ref!r}) took {took:.2f} s beside {SILENT} silent entries"
    start = time.monotonic()
    assert cli.main(["status", "--registry", cluster.registry_address]) == 1  # the silent ones were not reached
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert f"127.0.0.1:{port}" in out and f"{SILENT} of {SILENT + 1} server(s) could not be reached" in err
    assert took < 5.0, f"rpycdl status took {took:.2f} s beside {SILENT} silent entries"
