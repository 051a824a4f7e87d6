"""A real S3 endpoint for tests: moto in server mode, in a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""What the tests' S3 clients present (moto takes any, unless iam_checks() is on)."""


def free_port() -> int:
    """A loopback port nothing listens on (as long as nobody takes it meanwhile)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def moto_server(timeout: float = 30.0) -> Iterator[str]:
    """Start `python -m moto.server` on a free port; yield its endpoint URL; stop it at the end."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start on {endpoint}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        process.kill()
        process.wait(10)


@contextlib.contextmanager
def iam_checks(endpoint: str) -> Iterator[None]:
    """Within, the moto server at `endpoint` checks credentials like AWS: it knows none, so refuses all."""
    def reset_auth(free_requests: str) -> None:
        request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=free_requests.encode(),
                                         headers={"Content-Type": "text/plain"}, method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    reset_auth("0")
    try:
        yield
    finally:
        reset_auth("inf")
