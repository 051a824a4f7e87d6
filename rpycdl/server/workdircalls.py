"""The service's calls that bring a working directory into the server's cache by content, before a job
names it (rpycdl.artifacts.workdir)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import rpyc

from rpycdl.artifacts import workdir, workdircache
from rpycdl.errors import InvalidRequestError, LimitError, RpycdlError
from rpycdl.security.auth import Identity
from rpycdl.server.context import ServerContext
from rpycdl.server.jobcalls import refused
from rpycdl.wire import bulk, codec


class WorkdirCalls:
    """The exposed working-directory calls, mixed into the service (rpycdl.server.service.GPUService),
    whose `context`, `_conn` and `_identity` they use. A working directory serves only the users who sent it
    (rpycdl.artifacts.workdircache): a digest is not a key to another user's files."""

    context: ServerContext
    _conn: rpyc.Connection
    _identity: Identity

    def exposed_has_working_dir(self, digest: Any) -> bool:
        """Whether the working directory of content hash `digest` is in this server's cache, sent by the caller
        (a job of theirs may then name it without sending it again)."""
        return isinstance(digest, str) and self.context.working_dirs.has(digest, self._identity.label)

    def exposed_put_working_dir(self, digest: Any, size: Any, send: Callable[[], None]) -> bytes:
        """Receive a working directory's archive (rpycdl.artifacts.workdir) of `size` bytes, which the
        client's `send()` writes raw on the connection (bulk.pull_pieces), and cache it unpacked under its
        content hash, computed as it comes (checked against `digest` if one is given). Returns outcome bytes: the
        digest, or the error (over --max-working-dir, damaged on the way, no room on the server)."""
        try:
            most = workdircache.archive_limit(self.context.limits.max_working_dir)
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise InvalidRequestError(f"a working directory's size must be a number of bytes, not {size!r}")
            if size > most:
                raise LimitError(f"the working directory's archive is {size} bytes, over this server's limit of "
                                 f"{most} (--max-working-dir): leave files out with {workdir.IGNORE_FILE}")
            try:
                received = self.context.working_dirs.receive(
                    lambda sink: bulk.pull_pieces(self._conn, send, size, sink), self.context.limits.max_working_dir,
                    digest, sender=self._identity.label)
            except OSError as exc:  # the cache's disk
                raise LimitError(f"this server could not keep the working directory: {exc.strerror or exc}") from None
            return codec.encode_ok(received)
        except RpycdlError as exc:
            return codec.encode_error(refused(self.context, exc), tb="")
