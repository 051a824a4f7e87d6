"""The monitor's dashboard: the host's page (/) and a job's (/jobs/<id>), their static files (/static/...),
the JSON they poll (/api/host, /api/jobs/<id>) and a detached job's log (/api/jobs/<id>/log), which only
whoever gives the site's shared secret reads.

The pages are static HTML, CSS and JavaScript of rpycdl/monitor/static/ (nothing from elsewhere); they
fetch the data as JSON and put it in the DOM as text (every user name, command, error and log line is
untrusted), under a Content-Security-Policy that runs no script but theirs. /api/host is computed at
most once a HOST_REUSE, whatever the number of browsers polling it, and sent gzipped to those that take it.
The log's secret comes as an HTTP Basic password (any user name) or `Authorization: Bearer <secret>`:
401 without one, 403 with a wrong one, 403 always where the monitor has no --secret-file.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gzip
import hmac
import json
import time
from importlib import resources
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from rpycdl.defaults import LOG_CHUNK
from rpycdl.monitor.host import HostView

HOST_REUSE = 1.0
"""Seconds an answer of /api/host is served again: a room full of dashboards costs one reading a second."""

GZIP_OVER = 1024
"""Bytes of JSON past which it is sent gzipped (to a browser that takes it)."""

MAX_OFFSET = 2**53
"""Largest log offset asked for that is not refused (a log is at most --max-log, 1 GiB by default)."""

TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
"""The static files served, by suffix, and their content types."""

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
"""Headers of every answer of the dashboard: only its own scripts run, nothing is sniffed, nothing framed."""

NO_LOGS = ("this monitor shows no logs: start it with --secret-file (the site's shared secret), or read them with "
           "`rpycdl logs JOB`\n")


def static_files() -> dict[str, tuple[bytes, str]]:
    """The dashboard's static files by name: (content, content type)."""
    folder = resources.files("rpycdl.monitor").joinpath("static")
    return {entry.name: (entry.read_bytes(), TYPES[suffix]) for entry in folder.iterdir()
            for suffix in TYPES if entry.name.endswith(suffix)}


def routes(view: HostView, secret: bytes | None) -> list[BaseRoute]:
    """The dashboard's routes over `view`; `secret` (None: none) opens the logs."""
    pages = _Pages(view, secret)
    return [Route("/", pages.host_page), Route("/jobs/{job_id}", pages.job_page), Route("/static/{name}", pages.static),
            Route("/api/host", pages.api_host), Route("/api/jobs/{job_id}", pages.api_job),
            Route("/api/jobs/{job_id}/log", pages.api_log)]


class _Pages:
    """The handlers of routes(): the static pages, and the JSON and logs they fetch."""

    def __init__(self, view: HostView, secret: bytes | None) -> None:
        self.view, self.secret = view, secret
        self.files = static_files()
        self.latest: dict[str, Any] = {"at": -HOST_REUSE, "body": b"", "gzipped": b""}
        self.reading = asyncio.Lock()

    def page(self, name: str) -> Response:
        content, media_type = self.files[name]
        return Response(content, media_type=media_type, headers=HEADERS)

    async def host_page(self, request: Request) -> Response:
        return self.page("index.html")

    async def job_page(self, request: Request) -> Response:
        return self.page("job.html")

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        return self.page(name) if name in self.files else _text("no such file\n", 404)

    def encode_host(self) -> tuple[bytes, bytes]:
        body = _json(self.view.host())
        return body, gzip.compress(body, 5) if len(body) > GZIP_OVER else b""

    async def api_host(self, request: Request) -> Response:
        latest = self.latest
        async with self.reading:  # one reading at a time; those who waited for it get it too
            if time.monotonic() - latest["at"] >= HOST_REUSE:  # files, SQLite: read off the loop
                latest["body"], latest["gzipped"] = await run_in_threadpool(self.encode_host)
                latest["at"] = time.monotonic()
        headers = {**HEADERS, "Vary": "Accept-Encoding"}
        if latest["gzipped"] and "gzip" in request.headers.get("accept-encoding", ""):
            return Response(latest["gzipped"], media_type="application/json",
                            headers={**headers, "Content-Encoding": "gzip"})
        return Response(latest["body"], media_type="application/json", headers=headers)

    async def api_job(self, request: Request) -> Response:
        job_id = request.path_params["job_id"]
        found = await run_in_threadpool(self.view.job, job_id)
        if found is None:
            return _text(f"no job {job_id} on this host (or it was deleted)\n", 404)
        return Response(_json({**found, "logs": self.secret is not None}), media_type="application/json",
                        headers=HEADERS)

    async def api_log(self, request: Request) -> Response:
        refusal = _refusal(request, self.secret)
        if refusal is not None:
            return refusal
        try:
            offset = int(request.query_params.get("offset", "0"))
            size = int(request.query_params.get("size", str(LOG_CHUNK)))
        except ValueError:
            return _text("offset and size are numbers of bytes\n", 400)
        if not 0 <= offset <= MAX_OFFSET or size < 0:
            return _text(f"offset must be 0 to {MAX_OFFSET}, size positive\n", 400)
        job_id = request.path_params["job_id"]
        piece = await run_in_threadpool(self.view.log, job_id, offset, size)
        if piece is None:
            return _text(f"no detached job {job_id} on this host (an attached job's output went to its client)\n",
                         404)
        return Response(piece["data"], media_type="text/plain; charset=utf-8",
                        headers={**HEADERS, "Cache-Control": "no-store", "X-Next-Offset": str(piece["next"]),
                                 "X-Log-Size": str(piece["size"]), "X-Job-State": piece["state"]})


def _refusal(request: Request, secret: bytes | None) -> Response | None:
    """Why the request may not read logs (None: it may)."""
    if secret is None:
        return _text(NO_LOGS, 403)
    given = credential(request.headers.get("authorization", ""))
    if given is None:
        return _text("the log needs the site's shared secret: as the password of HTTP Basic auth, or "
                     "`Authorization: Bearer <secret>`\n", 401,
                     {"WWW-Authenticate": 'Basic realm="rpycdl monitor: the shared secret", charset="UTF-8"'})
    if not hmac.compare_digest(given.strip(), secret):
        return _text("wrong secret\n", 403)
    return None


def credential(header: str) -> bytes | None:
    """The secret an Authorization header gives: a Bearer token, or a Basic password (None: neither)."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip().encode("latin-1")  # Starlette decoded the header's bytes as latin-1
    if scheme.lower() == "basic":
        try:
            _, colon, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return None
        return password if colon else None
    return None


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _text(text: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return PlainTextResponse(text, status_code=status, headers={**HEADERS, **(headers or {})})
