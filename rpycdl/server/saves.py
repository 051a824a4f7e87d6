"""What a job saves while it runs (rpycdl.save_artifact), uploaded by the process that owns the job (its
connection process, or a detached job's supervisor): the job puts the file under its name in its output
directory and asks on a socket of this process (rpycdl.artifacts.saving), which the job's flow watches
with the job's other descriptors (take()); a thread, started at the first save, checks that a process of
the job asks, opens the file without following a link, uploads it with the server's credentials, lists
it in the ledger, and answers. The job's end waits for an upload under way (once its GPUs are released);
its end-of-job upload then skips what was saved and is unchanged."""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import socket
import struct
import threading
from typing import Any

from rpycdl.artifacts.files import Identity
from rpycdl.artifacts.saving import MAX_MESSAGE
from rpycdl.errors import ArtifactStoreError, InvalidRequestError, NotAllowedError, RpycdlError
from rpycdl.scheduler import procs
from rpycdl.scheduler.ledger import JobRecord
from rpycdl.server.context import ServerContext

BACKLOG = 8
"""Requests that may wait while one is served (a job saving from several threads)."""

REQUEST_TIMEOUT = 10.0
"""Seconds a process that connected has to send its request."""

_PEER = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


class Saver:
    """The saves of the job whose process `leader` leads its session: a socket in the abstract namespace
    (`variable` names it to the job), made after the last fork of this process for the job, so that no
    process inherits it. `saved`: the identity of each file uploaded, by name."""

    def __init__(self, context: ServerContext, record: JobRecord, leader: int) -> None:
        self._context, self._record, self._leader = context, record, leader
        name = f"rpycdl-save-{record.job_id}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind("\0" + name)
        self._listener.listen(BACKLOG)
        self._listener.setblocking(False)
        self.variable = "@" + name
        self.saved: dict[str, Identity] = {}
        self._waiting: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def fileno(self) -> int:
        """The socket to watch: readable when a request came (then call take())."""
        return self._listener.fileno()

    def take(self) -> None:
        """Hand the requests that came to the thread that serves them (started now if need be); served here
        if no thread can be started."""
        while True:
            try:
                channel, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            channel.setblocking(True)
            if self._thread is None:
                thread = threading.Thread(target=self._serve, name="rpycdl-saves", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:  # no thread to spare: the job's flow waits for this one
                    self._answer(channel)
                    continue
            self._waiting.put(channel)

    def close(self) -> dict[str, Identity]:
        """Take no more requests; wait for those handed to the thread; returns `saved`."""
        self._listener.close()
        if self._thread is not None:
            self._waiting.put(None)
            self._thread.join()
        return self.saved

    def _serve(self) -> None:
        while (channel := self._waiting.get()) is not None:
            self._answer(channel)

    def _answer(self, channel: socket.socket) -> None:
        with channel:
            answer = self._outcome(channel)
            with contextlib.suppress(OSError):
                channel.sendall(json.dumps(answer).encode())

    def _outcome(self, channel: socket.socket) -> dict[str, Any]:
        try:
            return self._save(channel)
        except ArtifactStoreError as exc:
            return {"error": f"{exc}; the file stays in the job's output directory, which goes up when the job "
                             "ends", "type": type(exc).__name__}
        except RpycdlError as exc:
            return {"error": str(exc), "type": type(exc).__name__}
        except Exception as exc:  # noqa: BLE001 - the ledger, a bug: the job is told, the thread serves on
            return {"error": f"the server could not save it ({type(exc).__name__}: {exc}); the file stays in the "
                             "job's output directory, which goes up when the job ends", "type": "ArtifactStoreError"}

    def _save(self, channel: socket.socket) -> dict[str, Any]:
        record = self._record
        channel.settimeout(REQUEST_TIMEOUT)
        try:
            request = channel.recv(MAX_MESSAGE + 1)  # read first: a socket closed unread would lose the answer
        except OSError:
            raise InvalidRequestError("no request to save an artifact came") from None
        pid = _PEER.unpack(channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))[0]
        if not self._of_the_job(pid):
            raise NotAllowedError(f"process {pid} is not one of job {record.job_id}'s: it cannot save its artifacts")
        try:
            name = json.loads(request)["name"]
        except (ValueError, TypeError, KeyError):
            raise InvalidRequestError("not a request to save an artifact") from None
        artifact = self._context.store.upload_file(record.user, record.job_id,
                                                   self._context.files.output_dir(record.job_id), name)
        self.saved[artifact.name] = artifact.source  # type: ignore[assignment]
        self._context.ledger.set_artifacts(record.job_id, "uploaded", [artifact.listed()])
        return artifact.listed()

    def _of_the_job(self, pid: int) -> bool:
        """Whether `pid` is the job's process, in its session, or below it."""
        found = procs.stat(pid)
        return found is not None and (pid == self._leader or found.session == self._leader
                                      or pid in procs.subtree(self._leader))
