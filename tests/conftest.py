"""Fixtures: a real registry and real servers on loopback, in subprocesses."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import rpycdl
from rpycdl.local import LocalCluster


@pytest.fixture
def lock_dir(tmp_path) -> str:
    """A lock directory of the test's own (servers sharing it share GPUs)."""
    path = tmp_path / "locks"
    path.mkdir()
    return str(path)


@pytest.fixture
def cluster(lock_dir) -> Iterator[LocalCluster]:
    """A registry on a free loopback port; add servers with cluster.add_server(service, gpus)."""
    with LocalCluster(lock_dir) as local:
        yield local


@pytest.fixture
def server(cluster) -> Callable[..., int]:
    """Start a server: server("pytorch", "fake:2", *extra_args) -> its port."""

    def start(service: str = "pytorch", gpus: str = "fake:2", *extra: str) -> int:
        return cluster.add_server(service, gpus, *extra)[1]

    return start


@pytest.fixture
def connect() -> Iterator[Callable[[int], rpycdl.Connection]]:
    """connect(port) -> an rpycdl connection to 127.0.0.1:port, closed after the test."""
    conns: list[rpycdl.Connection] = []

    def open_(port: int) -> rpycdl.Connection:
        conn = rpycdl.connect(host="127.0.0.1", port=port)
        conns.append(conn)
        return conn

    yield open_
    for conn in conns:
        conn.close()
