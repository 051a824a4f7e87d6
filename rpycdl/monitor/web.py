"""The monitor's HTTP side: /metrics (Prometheus text format) and /healthz, a Starlette app served by
uvicorn, bounded against slow and greedy clients."""

from __future__ import annotations

import socket

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

MAX_CONCURRENCY = 64
"""Requests served at once; more get 503 at once rather than queueing behind a slow scrape."""

KEEP_ALIVE = 5
"""Seconds an idle HTTP connection is kept open."""


def create_app(collector: Collector) -> Starlette:
    """The monitor's web application over `collector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    async def metrics(request: Request) -> Response:
        body = await run_in_threadpool(generate_latest, registry)  # reads files: off the event loop
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz)])


def serve(app: Starlette, sock: socket.socket) -> None:
    """Serve `app` on the bound socket `sock` until interrupted."""
    config = uvicorn.Config(app, log_level="warning", limit_concurrency=MAX_CONCURRENCY,
                            timeout_keep_alive=KEEP_ALIVE, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
