"""A job's side of saving an artifact while it runs (`rpycdl.save_artifact`): the file is put under its
name in the job's output directory (hard-linked, else copied), and the process that owns the job (its
connection process, or a detached job's supervisor: rpycdl.server.saves) is asked, over a socket whose
address the job's environment names, to upload it. The job never holds the store or its credentials.

One request a connection, one datagram each way (SOCK_SEQPACKET): {"name": NAME} asks; the answer is
{"name", "size"} once the file is in the store, or {"error", "type"} (the exception to raise here)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket

from rpycdl.artifacts.files import check_name, copy_range, open_beneath
from rpycdl.defaults import OUTPUT_DIR_VARIABLE, SAVE_SOCKET_VARIABLE, WORKING_DIR_VARIABLE
from rpycdl.errors import ArtifactStoreError, InvalidRequestError, LimitError, NotAllowedError, RpycdlError

MAX_MESSAGE = 64 * 1024
"""Most bytes of a request or an answer: a name, or a reason."""

ERRORS = {error.__name__: error for error in (ArtifactStoreError, InvalidRequestError, LimitError, NotAllowedError)}
"""The exceptions an answer may name."""


def address(variable: str) -> str:
    """A socket's address as the job's environment names it: an abstract one (Linux) written with an '@'."""
    return "\0" + variable[1:] if variable.startswith("@") else variable


def save_artifact(path: str | os.PathLike[str], name: str | None = None) -> str:
    """See rpycdl.save_artifact."""
    where, output = os.environ.get(SAVE_SOCKET_VARIABLE), os.environ.get(OUTPUT_DIR_VARIABLE)
    if not where or not output:
        raise RuntimeError("rpycdl.save_artifact() is for code running as an rpycdl job, and not in a container "
                           f"(${SAVE_SOCKET_VARIABLE} is not set)")
    source = os.path.abspath(path)
    bases = [base for base in (output, os.environ.get(WORKING_DIR_VARIABLE)) if base]
    base = next((base for base in bases if os.path.commonpath([source, base]) == base and source != base), None)
    if base is None:
        raise InvalidRequestError(f"{source} is outside the job's own directories ({' and '.join(bases)}): not "
                                  "saved (write it to rpycdl.output_dir())")
    relative = os.path.relpath(source, base)
    name = check_name(relative if name is None else name)
    try:
        fd = open_beneath(base, relative)
    except OSError as exc:
        raise InvalidRequestError(f"{source} is not a regular file, or a symbolic link is on its way (not followed): "
                                  f"not saved ({exc.strerror})") from None
    try:
        if base != output or relative != name:
            _place(fd, output, name)
    finally:
        os.close(fd)
    return _ask(address(where), name)


def _place(fd: int, output: str, name: str) -> None:
    """Put the open file `fd` in `output` as `name`, replacing what had that name: a hard link to it if the
    filesystem can, else a copy."""
    target = os.path.join(output, name)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    aside = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{secrets.token_hex(4)}.saving")
    try:
        try:
            os.link(f"/proc/self/fd/{fd}", aside, follow_symlinks=True)  # the very file opened, not a name
        except OSError:
            out = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                copy_range(fd, out, os.fstat(fd).st_size)
            finally:
                os.close(out)
        os.replace(aside, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


def _ask(where: str, name: str) -> str:
    """Ask the job's owner to upload `name`; wait for its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as channel:
        try:
            channel.connect(where)
            channel.sendall(json.dumps({"name": name}).encode())
            answer = json.loads(channel.recv(MAX_MESSAGE) or b"{}")
        except (OSError, ValueError) as exc:
            raise ArtifactStoreError(f"{name} was not saved: the server of this job did not answer ({exc}); it stays "
                                     "in the job's output directory") from None
    if "error" in answer:
        raise ERRORS.get(answer.get("type"), RpycdlError)(answer["error"])
    return answer["name"]
