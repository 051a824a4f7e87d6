"""What the `rpycdl` subcommands share: exit codes, the flags of the commands that talk to servers,
finding those servers (registry or --host) with the command's credentials, servers' refusals in the
words of flags, and tables."""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from rpycdl.client import Connection, channel, connect_to, credentials
from rpycdl.client.discovery import ASK_PATIENCE, ask_servers, server_addresses
from rpycdl.defaults import (
    CONFIG_FILE,
    ENV_CONFIG,
    ENV_REGISTRY,
    ENV_SECRET_FILE,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    SERVER_PORT,
)
from rpycdl.errors import (
    AuthFailedError,
    InvalidRequestError,
    JobNotFinishedError,
    JobTimeoutError,
    LimitError,
    QueueTimeoutError,
    RpycdlError,
    UploadTimeoutError,
)

Command = Callable[..., argparse.ArgumentParser]
"""Makes a subcommand's parser: command(name, help, description, **options) -> its parser."""

EXIT_FAILED = 1
"""The command failed: a job's failure or crash, an unreachable server, no registry, a refusal."""
EXIT_USAGE = 2
"""Bad arguments, or a request no server can ever serve (InvalidRequestError); argparse's own code."""
EXIT_QUEUE_TIMEOUT = 75
"""The GPUs were not granted within --queue-timeout, a job has not ended yet, or its outputs are still
uploading (sysexits' EX_TEMPFAIL: try again later)."""
EXIT_JOB_TIMEOUT = 124
"""`rpycdl run`: the command ran past --timeout and was stopped (what timeout(1) exits with)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C or SIGTERM (128 + SIGINT, as a shell says)."""

def server_flags(parser: argparse.ArgumentParser) -> None:
    """How a command that talks to servers finds them (registry or --host) and what it proves."""
    parser.add_argument("--host", default=None, help="use this server directly instead of asking the registry")
    parser.add_argument("--port", type=int, default=SERVER_PORT, help="with --host (default: %(default)s)")
    parser.add_argument("--registry", default=None, metavar="HOST[:PORT]",
                        help=f"registry to ask (default: ${ENV_REGISTRY}, else UDP broadcast)")
    credential_flags(parser)


def credential_flags(parser: argparse.ArgumentParser) -> None:
    """The credentials a command proves itself with, as rpycdl.connect takes them."""
    where = f"else the credentials file (${ENV_CONFIG}, else {CONFIG_FILE})"
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help=f"the servers' shared secret (default: ${ENV_SECRET_FILE}, {where})")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help=f"your certificate (default: ${ENV_TLS_CERT}, {where})")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help=f"its key (default: ${ENV_TLS_KEY}, {where})")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help=f"the team's CA certificate (default: ${ENV_TLS_CA}, {where})")


def servers(args: argparse.Namespace) -> list[tuple[tuple[str, int], Callable[..., Connection]]]:
    """The servers a status/jobs/cancel command talks to, each with a way to connect to it
    with the command's credentials (flags, else environment, else the credentials file): connect_to's
    other arguments (attempt=) are its."""
    settings = credentials.resolve(secret_file=args.secret_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                   tls_ca=args.tls_ca, registry=args.registry)
    addresses = [(args.host, args.port)] if args.host else server_addresses(args.service, settings.registry)
    secret, tls_context = settings.secret(), settings.tls_context()  # read once for every server
    return [(address, functools.partial(connect_to, address, secret, tls_context)) for address in addresses]


def each_server(args: argparse.Namespace, call: str, **options: Any) -> list[tuple[tuple[str, int], Any]]:
    """Ask every server the command names for `call` (conn.root's, with `options`), all at once
    (rpycdl.client.discovery.ask_servers): its answer, or why it could not, in the servers' order."""
    openers = dict(servers(args))

    def ask(address: tuple[str, int], attempt: channel.Attempt) -> Any:
        with openers[address](attempt=attempt) as conn:
            return getattr(conn.root, call)(**options)

    answers = dict(ask_servers(list(openers), ask, patience=ASK_PATIENCE))
    for answer in answers.values():
        if isinstance(answer, BaseException) and not isinstance(answer, (OSError, EOFError, AuthFailedError,
                                                                          LimitError)):
            raise answer  # one server's trouble is not the others', but a bug is everyone's
    return [(address, answers[address]) for address in openers]


def report_unreached(args: argparse.Namespace, results: list[tuple[tuple[str, int], Any]]) -> int:
    """0 if every server answered; else say which did not, and EXIT_FAILED."""
    failed = [f"{host}:{port}" for (host, port), result in results if isinstance(result, Exception)]
    if not failed:
        return 0
    print(f"rpycdl {args.command}: {len(failed)} of {len(results)} server(s) could not be reached: "
          f"{', '.join(failed)}", file=sys.stderr)
    return EXIT_FAILED


def size_flags(parser: argparse.ArgumentParser) -> None:
    """--ngpus, --gpus or --gpu-memory, --memory, --cpus, --priority and --keep-idle: what a job asks for (run and
    submit)."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--ngpus", type=int, default=None, help="whole GPUs, -1 for all (default: 1)")
    size.add_argument("--gpus", type=float, default=None, help="a share of one GPU, such as 0.25")
    size.add_argument("--gpu-memory", default=None, metavar="SIZE", help="a share of one GPU by memory, such as 6GiB")
    parser.add_argument("--memory", default=None, metavar="SIZE",
                        help="host memory the job may use, such as 16GiB, where the server fences jobs (default: the "
                             "server's --job-memory)")
    parser.add_argument("--cpus", type=float, default=None, metavar="N",
                        help="CPU cores the job may use, such as 4 or 0.5, where the server fences jobs (default: the "
                             "server's --job-cpus)")
    parser.add_argument("--priority", type=int, default=0, metavar="N",
                        help="from -10 to 10 (default: 0): a waiting job of a higher priority goes before those of "
                             "lower ones; above 0 only up to your ceiling, the `priority` of the server's --limits "
                             "file (docs: sharing)")
    parser.add_argument("--keep-idle", action="store_true",
                        help="keep the job's GPUs however long they show no utilization, where the server reclaims "
                             "idle ones (--idle-reclaim): within your allowance, the `keep_idle` of its --limits file")


def working_dir_flag(parser: argparse.ArgumentParser) -> None:
    """--working-dir: a local directory the job runs in on the server (run and submit)."""
    parser.add_argument("--working-dir", default=None, metavar="DIR",
                        help="run the command in a copy of this local directory on the server (sent once per "
                             "content, leaving out what its .rpycdlignore names; it is the job's current directory "
                             "and first on its sys.path)")


def exit_code(exc: RpycdlError) -> int:
    """The exit code of a command that failed with `exc` (RUN_EXIT_CODES)."""
    if isinstance(exc, JobTimeoutError):
        return EXIT_JOB_TIMEOUT
    if isinstance(exc, (QueueTimeoutError, JobNotFinishedError, UploadTimeoutError)):
        return EXIT_QUEUE_TIMEOUT
    return EXIT_USAGE if isinstance(exc, InvalidRequestError) else EXIT_FAILED


FLAGS = {"ngpus": "--ngpus", "gpus": "--gpus", "gpu_memory": "--gpu-memory", "timeout": "--timeout",
         "queue_timeout": "--queue-timeout", "working_dir": "--working-dir", "name": "--name", "memory": "--memory",
         "cpus": "--cpus", "priority": "--priority"}
"""The flag of each request argument that a server's refusal may name (shares, request: as `gpu_memory='6GiB'`)."""

_ARGUMENT = re.compile(r"(?<![\w.-])(" + "|".join(FLAGS) + r")=('[^']*'|\"[^\"]*\"|[^\s,;:()]+)?")


def in_flags(message: str) -> str:
    """A refusal's words for a command line: each request argument it names as Python's `name=value` (or
    `name=`) named by its flag instead, `gpu_memory='6GiB'` as `--gpu-memory 6GiB`, `ngpus=` as `--ngpus`."""
    def flag(match: re.Match[str]) -> str:
        value = match.group(2) or ""
        if value[:1] in ("'", '"') and not any(space in value for space in " \t"):
            value = value[1:-1]
        return FLAGS[match.group(1)] + (f" {value}" if value else "")

    return _ARGUMENT.sub(flag, message)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], widest: Sequence[int | None] = (),
          indent: str = "") -> list[str]:
    """Rows as lines of columns as wide as their widest cell, two spaces apart (the last one unpadded); a
    cell over its column's `widest` (None: no limit) is cut to it, ending with '~'."""
    def cut(cell: str, column: int) -> str:
        limit = widest[column] if column < len(widest) else None
        return cell if limit is None or len(cell) <= limit else cell[:limit - 1] + "~"

    cells = [[cut(str(cell), column) for column, cell in enumerate(row)] for row in [header, *rows]]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header) - 1)] + [0]
    return [(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))).rstrip()
            for row in cells]


def iso(value: Any) -> Any:
    """JSON's form of what it has none for: a moment as ISO 8601 text (`--json` of status and jobs)."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def os_error(exc: OSError | EOFError) -> str:
    """An OSError or EOFError in words, for the one line a failed command prints."""
    if isinstance(exc, EOFError):
        return "the server closed the connection unexpectedly (see its log)"
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
