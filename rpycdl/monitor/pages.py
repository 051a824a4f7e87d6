"""The monitor's dashboard: the host's page (/) and a job's (/jobs/<id>), their static files (/static/...),
the JSON they poll (/api/host, /api/jobs/<id>) and a detached job's log (/api/jobs/<id>/log), which only its
owner or an admin reads.

The pages are static HTML, CSS and JavaScript of rpycdl/monitor/static/ (nothing from elsewhere); they
fetch the data as JSON and put it in the DOM as text (every user name, command, error and log line is
untrusted), under a Content-Security-Policy that runs no script but theirs. /api/host is computed at
most once a HOST_REUSE, whatever the number of browsers polling it, and sent gzipped to those that take it.

Who asks (`viewer`) is who the servers would take them for, and sees what the servers would show them
(rpycdl.security.visibility): the user of a client certificate of the team's CA (--tls-ca; web.PEER), or,
with the site's shared secret (--secret-file) as the password of HTTP Basic auth, the user name given with
it, declared and so unverified as on the servers (`Authorization: Bearer <secret>`: a client that names
nobody). A declared name never opens a verified user's job. Nobody authenticated sees every job reduced;
a wrong secret gets 403, a log asked for by nobody 401 (403 where the monitor can tell nobody).
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
from rpycdl.errors import InvalidRequestError, NotAllowedError
from rpycdl.monitor.host import HostView, for_viewer
from rpycdl.monitor.web import PEER
from rpycdl.security import auth

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

VIEWERS_KEPT = 64
"""Viewers whose answer of /api/host is kept for HOST_REUSE (others' is made again for each request)."""

NO_LOGS = ("this monitor cannot tell who you are, so it shows no logs: start it with --tls-ca (the team's client "
           "certificates) or --secret-file (the site's shared secret), or read them with `rpycdl logs JOB`\n")

NOBODY = ("a job's log is shown to its owner or an admin: give the site's shared secret as the password of HTTP "
          "Basic auth and your user name as its user (for a job sent with the secret), or use a client certificate "
          "of the team's CA; or read it with `rpycdl logs JOB`\n")


def static_files() -> dict[str, tuple[bytes, str]]:
    """The dashboard's static files by name: (content, content type)."""
    folder = resources.files("rpycdl.monitor").joinpath("static")
    return {entry.name: (entry.read_bytes(), TYPES[suffix]) for entry in folder.iterdir()
            for suffix in TYPES if entry.name.endswith(suffix)}


def routes(view: HostView, secret: bytes | None) -> list[BaseRoute]:
    """The dashboard's routes over `view`; `secret` (None: none) lets users of the shared secret say who they are."""
    pages = _Pages(view, secret)
    return [Route("/", pages.host_page), Route("/jobs/{job_id}", pages.job_page), Route("/static/{name}", pages.static),
            Route("/api/host", pages.api_host), Route("/api/jobs/{job_id}", pages.api_job),
            Route("/api/jobs/{job_id}/log", pages.api_log)]


class _Pages:
    """The handlers of routes(): the static pages, and the JSON and logs they fetch."""

    def __init__(self, view: HostView, secret: bytes | None) -> None:
        self.view, self.secret = view, secret
        self.files = static_files()
        self.latest: dict[str, Any] = {"at": -HOST_REUSE, "host": None, "bodies": {}}
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

    async def api_host(self, request: Request) -> Response:
        viewer = viewer_of(request, self.secret)
        if isinstance(viewer, Response):
            return viewer
        latest = self.latest
        async with self.reading:  # one reading at a time; those who waited for it get it too
            if time.monotonic() - latest["at"] >= HOST_REUSE:  # files, SQLite: read off the loop
                latest.update(host=await run_in_threadpool(self.view.host), at=time.monotonic(), bodies={})
            body, gzipped = latest["bodies"].get(viewer) or await run_in_threadpool(
                _encode, {**for_viewer(latest["host"], viewer), **self.who(viewer)})
            if len(latest["bodies"]) < VIEWERS_KEPT:
                latest["bodies"][viewer] = body, gzipped
        headers = {**HEADERS, "Vary": "Accept-Encoding"}
        if gzipped and "gzip" in request.headers.get("accept-encoding", ""):
            return Response(gzipped, media_type="application/json", headers={**headers, "Content-Encoding": "gzip"})
        return Response(body, media_type="application/json", headers=headers)

    async def api_job(self, request: Request) -> Response:
        viewer = viewer_of(request, self.secret)
        if isinstance(viewer, Response):
            return viewer
        job_id = request.path_params["job_id"]
        found = await run_in_threadpool(self.view.job, job_id, viewer)
        if found is None:
            return _text(f"no job {job_id} on this host (or it was deleted)\n", 404)
        return Response(_json({**found, **self.who(viewer)}), media_type="application/json", headers=HEADERS)

    def who(self, viewer: auth.Identity | None) -> dict[str, Any]:
        """What the pages are told of who looks: "viewer" (their label, None: nobody authenticated), and
        "secret": whether this monitor takes the site's secret (with a user name) to tell."""
        return {"viewer": viewer and viewer.label, "secret": self.secret is not None}

    async def api_log(self, request: Request) -> Response:
        viewer = viewer_of(request, self.secret)
        if isinstance(viewer, Response):
            return viewer
        if viewer is None:
            return _text(NO_LOGS, 403) if self.secret is None else _text(NOBODY, 401, CHALLENGE)
        try:
            offset = int(request.query_params.get("offset", "0"))
            size = int(request.query_params.get("size", str(LOG_CHUNK)))
        except ValueError:
            return _text("offset and size are numbers of bytes\n", 400)
        if not 0 <= offset <= MAX_OFFSET or size < 0:
            return _text(f"offset must be 0 to {MAX_OFFSET}, size positive\n", 400)
        job_id = request.path_params["job_id"]
        try:
            piece = await run_in_threadpool(self.view.log, job_id, offset, size, viewer)
        except NotAllowedError as exc:
            return _text(f"{exc}\n", 403)
        if piece is None:
            return _text(f"no detached job {job_id} on this host (an attached job's output went to its client)\n",
                         404)
        return Response(piece["data"], media_type="text/plain; charset=utf-8",
                        headers={**HEADERS, "Cache-Control": "no-store", "X-Next-Offset": str(piece["next"]),
                                 "X-Log-Size": str(piece["size"]), "X-Job-State": piece["state"]})


CHALLENGE = {"WWW-Authenticate": 'Basic realm="rpycdl monitor: your user name and the shared secret", charset="UTF-8"'}
"""The header of a 401: a browser asks for a user name and password (the site's shared secret)."""


def _encode(data: dict[str, Any]) -> tuple[bytes, bytes]:
    """`data` as JSON, and gzipped if it is long ("" if not)."""
    body = _json(data)
    return body, gzip.compress(body, 5) if len(body) > GZIP_OVER else b""


def viewer_of(request: Request, secret: bytes | None) -> auth.Identity | None | Response:
    """Who asks: the user of their client certificate (verified; an admin by its unit), else the user they name
    with the shared secret (unverified), else None (nobody authenticated); or the answer that refuses them (a
    wrong secret, a credential this monitor cannot check)."""
    peer = request.scope.get("state", {}).get(PEER)
    if peer is not None:
        return peer  # a certificate says who it is, whatever else the request says
    header = request.headers.get("authorization", "")
    if not header:
        return None
    given = credential(header)
    if given is None:
        return _text("an Authorization header gives your user name and the site's shared secret as HTTP Basic auth, "
                     "or `Bearer <secret>`\n", 401, CHALLENGE if secret else None)
    user, password = given
    if secret is None:
        return _text(NO_LOGS, 403)
    if not hmac.compare_digest(password.strip(), secret):
        return _text("wrong secret\n", 403)
    try:
        return auth.declared(user) if user else auth.ANONYMOUS
    except InvalidRequestError as exc:
        return _text(f"{exc}\n", 401, CHALLENGE)


def credential(header: str) -> tuple[str, bytes] | None:
    """The user name and secret an Authorization header gives: a Basic user and password, or a Bearer token
    (no user name); None: neither."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return "", value.strip().encode("latin-1")  # Starlette decoded the header's bytes as latin-1
    if scheme.lower() == "basic":
        try:
            user, colon, password = base64.b64decode(value.strip(), validate=True).partition(b":")
            return (user.decode(), password) if colon else None
        except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
            return None
    return None


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def _text(text: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return PlainTextResponse(text, status_code=status, headers={**HEADERS, **(headers or {})})
