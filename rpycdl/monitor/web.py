"""The monitor's HTTP side: /metrics (Prometheus text format), /healthz and the dashboard's routes
(rpycdl.monitor.pages), a Starlette app served by uvicorn, bounded against slow and greedy clients."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import resource
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from rpycdl.monitor.host import SNAPSHOTS
from rpycdl.security.auth import Identity
from rpycdl.security.tls import peer_user

SCRAPE_REUSE = 1.0
"""Seconds a collection is served again: a burst of scrapes costs one collection a second, not one each."""

REQUEST_DEADLINE = 5.0
"""Seconds a connection has to send each request's headers (uvicorn has no such limit: a client sending
a byte at a time would hold its connection for ever)."""

KEEP_ALIVE = 5
"""Seconds an idle HTTP connection is kept open."""

MAX_HEADERS = 16 * 1024
"""Bytes of a request's headers: more gets 431."""

MAX_BUFFERED = 64 * 1024
"""Bytes of a request that h11 keeps while its headers are not yet whole: more gets 400 and the
connection closed. Headers between MAX_HEADERS and this get 431 however TCP cuts them up (with one
limit for both, a request that came in one read got 431 and the same request in two reads got 400);
larger ones get 431 or 400 as they arrive. A connection costs at most this and one asyncio read
(256 KiB), whatever it sends."""


PEER = "rpycdl.peer"
"""The key of a request's scope["state"] that holds the Identity its client certificate proves (absent without one)."""


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection that does not send a request's headers within
    REQUEST_DEADLINE of connecting or of its previous response; over TLS with client certificates, putting
    the user a connection's certificate proves in each of its requests' scope["state"] (PEER). It relies on
    H11Protocol's `cycle` (a new one per request), its hooks and its `app_state` (copied into each request's
    scope); tests/test_monitor.py's slow clients and tests/test_visibility.py's monitor fail if they change."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        user, admin = peer_user(transport.get_extra_info("peercert"))  # the handshake is done: verified
        if user:
            self.app_state = {**self.app_state, PEER: Identity(user, verified=True, admin=admin)}
        self._deadline = self.loop.call_later(REQUEST_DEADLINE, self._expired)

    def _expired(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers came in time
            self._deadline.cancel()

    def on_response_complete(self) -> None:
        self._deadline.cancel()  # the next request on this connection has a deadline of its own
        self._deadline = self.loop.call_later(REQUEST_DEADLINE, self._expired)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.cancel()
        super().connection_lost(exc)


def create_app(collector: Collector, dashboard: Sequence[BaseRoute] = ()) -> ASGIApp:
    """The monitor's web application over `collector`, with the `dashboard`'s routes (pages.routes)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    latest: dict[str, Any] = {"at": -SCRAPE_REUSE, "body": b""}
    collecting = asyncio.Lock()

    def collect() -> bytes:
        with SNAPSHOTS:  # the dashboard's readings take snapshots too, in other threads
            return generate_latest(registry)

    async def metrics(request: Request) -> Response:
        async with collecting:  # one collection at a time; those who waited for it get it too
            if time.monotonic() - latest["at"] >= SCRAPE_REUSE:
                began = time.monotonic()  # a collection's age counts from when it began to read
                latest.update(body=await run_in_threadpool(collect), at=began)  # reads files: off the loop
        return Response(latest["body"], media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    routes = Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz), *dashboard])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(key) + len(value) for key, value in scope["headers"]) > MAX_HEADERS:
            await PlainTextResponse("request headers too large\n", status_code=431)(scope, receive, send)
        else:
            await routes(scope, receive, send)

    return app


def import_ahead() -> None:
    """Import now what serving would import on first use (uvicorn's protocols, lifespan and event loop, anyio's
    backend, package resources): a monitor gives up root before it serves (monitor.reader), and its new account
    may not read where its Python lies (an interpreter under /root)."""
    _config(Starlette()).load()
    for module in ("anyio._backends._asyncio", "importlib.readers", "importlib.resources.readers",
                   "email.utils", "json.decoder"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def _config(app: ASGIApp, tls: ssl.SSLContext | None = None) -> uvicorn.Config:
    return uvicorn.Config(app, http=DeadlineProtocol, log_level="warning", timeout_keep_alive=KEEP_ALIVE,
                          h11_max_incomplete_event_size=MAX_BUFFERED, access_log=False, ws="none", lifespan="off",
                          ssl_context_factory=None if tls is None else lambda config, default: tls)


def serve(app: ASGIApp, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
    """Serve `app` on the bound socket `sock` until interrupted, with as many descriptors as the system
    allows this process (a burst of connections then meets REQUEST_DEADLINE, not the descriptor limit).
    A TCP socket gets TCP_NODELAY, which its connections inherit: asyncio sets it only on sockets made
    with IPPROTO_TCP, and without it a response's second write waits for the client's delayed ACK
    (40 ms for each request on a kept-alive connection). With `tls` (security.tls.web_server_context),
    HTTPS only."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 65536 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    uvicorn.Server(_config(app, tls)).run(sockets=[sock])
