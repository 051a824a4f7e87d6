"""The `rpycdl` command: registry, serve, status, jobs, cancel, run, demo, selftest, certs, up, down."""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rpycdl import __version__, credentials, registry, site_cli
from rpycdl.auth import Identity
from rpycdl.client import Connection, connect, connect_to
from rpycdl.defaults import (
    CONFIG_FILE,
    ENV_CONFIG,
    ENV_GPUS,
    ENV_LOCK_DIR,
    ENV_REGISTRY,
    ENV_SECRET_FILE,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    GPU_UNIT,
    IDLE_TIMEOUT,
    LOCK_DIR,
    MAX_CONNECTIONS,
    MAX_PAYLOAD,
    MAX_QUEUED,
    MAX_QUEUED_PER_USER,
    MEMORY_ALLOWANCE,
    MIN_MAX_PAYLOAD,
    REGISTRY_PORT,
    SERVER_PORT,
)
from rpycdl.errors import (
    AuthFailedError,
    InvalidRequestError,
    JobTimeoutError,
    LimitError,
    NoInventoryError,
    NotAllowedError,
    QueueTimeoutError,
    RpycdlError,
)
from rpycdl.gpus import format_size

REPO = Path(__file__).resolve().parent.parent
MiB = 1024**2


EXIT_FAILED = 1
"""The command failed: a job's failure or crash, an unreachable server, no registry, a refusal."""
EXIT_USAGE = 2
"""Bad arguments, or a request no server can ever serve (InvalidRequestError); argparse's own code."""
EXIT_QUEUE_TIMEOUT = 75
"""`rpycdl run`: the GPUs were not granted within --queue-timeout (sysexits' EX_TEMPFAIL: try again later)."""
EXIT_JOB_TIMEOUT = 124
"""`rpycdl run`: the command ran past --timeout and was stopped (what timeout(1) exits with)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C or SIGTERM (128 + SIGINT, as a shell says)."""

RUN_EXIT_CODES = f"""exit codes:
  N     the command's own exit code (128+N when signal N killed it)
  {EXIT_FAILED}     the job failed or crashed or was cancelled, or no server could take it (no registry
        answered, none registered or reachable, authentication refused)
  {EXIT_USAGE}     usage error: bad arguments, or a request no server can serve (more GPUs than it has)
  {EXIT_QUEUE_TIMEOUT}    queue timeout: the GPUs were not granted within --queue-timeout; try again later
  {EXIT_JOB_TIMEOUT}   job timeout: the command ran past --timeout and was stopped (like timeout(1))
  {EXIT_INTERRUPTED}   interrupted (Ctrl-C): the job was cancelled
A command that itself exits with one of these codes looks the same: the last line on stderr tells.

example: rpycdl run pytorch --gpu-memory 6GiB -- python train.py --lr 0.01"""


def _parser() -> argparse.ArgumentParser:
    verbose = argparse.ArgumentParser(add_help=False)  # -v after a subcommand too: rpycdl status -v
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log what rpycdl does (INFO)")
    parser = argparse.ArgumentParser(
        prog="rpycdl", description="Run Python functions on shared GPU servers, first come, first served.",
        epilog="`rpycdl COMMAND --help` tells more; the README tells everything.")
    parser.add_argument("-v", "--verbose", action="store_true", default=False, help="log what rpycdl does (INFO)")
    parser.add_argument("--version", action="version",
                        version=f"rpycdl {__version__} (Python {platform.python_version()})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, description: str, **options: Any) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=description, parents=[verbose], **options)

    reg = command("registry", "run the RPyC registry servers announce themselves to",
                  "Run the site's RPyC UDP registry in the foreground, until Ctrl-C or SIGTERM. Servers "
                  "announce themselves to it every 20 seconds; clients (rpycdl.connect, rpycdl status, rpycdl "
                  "run) ask it which servers offer a service. One per site is enough.")
    reg.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    reg.add_argument("--port", type=int, default=REGISTRY_PORT, help="UDP port (default: %(default)s)")

    serve = command("serve", "run a GPU server for one framework service",
                    "Run a GPU server for one framework service in the foreground, until Ctrl-C or SIGTERM. It "
                    "announces itself to the registry, queues each job for its GPUs first come, first served "
                    "with every server sharing the lock directory, and runs it in a process of its own that "
                    "sees only its GPUs. If it cannot start (port in use, lock directory not writable, "
                    "unusable credential files), it says what failed and what to do in one line and exits "
                    f"with {EXIT_FAILED} ({EXIT_USAGE} for bad arguments).")
    serve.add_argument("--service", required=True,
                       help="service name: pytorch, tensorflow, jax, caffe, deeplearning, or your own")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: %(default)s; others need --insecure)")
    serve.add_argument("--port", type=int, default=SERVER_PORT, help="TCP port, 0 for any (default: %(default)s)")
    serve.add_argument("--registry", default=None, metavar="HOST[:PORT]",
                       help=f"registry to announce to; 'none' to stay unlisted (default: ${ENV_REGISTRY}, "
                            "else UDP broadcast)")
    serve.add_argument("--gpus", default=None, metavar="SPEC",
                       help=f"GPU inventory: nvml, fake:N or fake:NxSIZE such as fake:2x16GiB "
                            f"(default: ${ENV_GPUS}, else NVML)")
    serve.add_argument("--lock-dir", default=None,
                       help=f"lock directory shared by every server of the host (default: ${ENV_LOCK_DIR}, "
                            f"else {LOCK_DIR})")
    serve.add_argument("--framework-version", default=None, dest="version",
                       help="version to announce (default: read from the installed framework package)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow listening on a non-loopback address without authentication")
    serve.add_argument("--max-payload", default=format_size(MAX_PAYLOAD), metavar="SIZE",
                       help="largest call accepted, at least 1 MiB (default: %(default)s)")
    serve.add_argument("--max-queued", type=int, default=MAX_QUEUED, metavar="N",
                       help="most requests waiting at once (default: %(default)s)")
    serve.add_argument("--max-queued-per-user", type=int, default=MAX_QUEUED_PER_USER, metavar="N",
                       help="most requests of one user waiting at once (default: %(default)s)")
    serve.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                       help="most client connections served at once (default: %(default)s)")
    serve.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT, metavar="SECONDS",
                       help="close connections idle this long (default: %(default)s)")
    serve.add_argument("--gpu-unit", default=GPU_UNIT, metavar="UNIT",
                       help="granularity of shares of a GPU (gpus=0.25, gpu_memory='6GiB'): a size such as "
                            "1GiB or a fraction such as 1/8; shares are rounded up to it (default: %(default)s)")
    serve.add_argument("--memory-allowance", default=format_size(MEMORY_ALLOWANCE), metavar="SIZE",
                       help="GPU memory a job on a share may use beyond its grant (for the CUDA context) before "
                            "the watchdog stops it (default: %(default)s)")
    serve.add_argument("--secret-file", default=None, metavar="PATH",
                       help=f"require clients to prove they know the shared secret in PATH (mode 600); "
                            f"default ${ENV_SECRET_FILE}, else no authentication")
    serve.add_argument("--tls-cert", default=None, metavar="FILE",
                       help="this server's certificate (rpycdl certs server): require mutual TLS")
    serve.add_argument("--tls-key", default=None, metavar="FILE", help="its key (mode 600)")
    serve.add_argument("--tls-ca", default=None, metavar="FILE",
                       help="the team's CA certificate: clients must present a certificate it signed")

    unreachable = f"Exits with {EXIT_FAILED} if a server could not be reached (the others are shown all the same)."
    for name, text, description in (
            ("status", "show each GPU, who holds it, and who waits",
             "Show every GPU of every server the registry knows (or of one service, or of the server at --host): "
             "its memory, who holds it or a share of it, and who waits for GPUs, in order. " + unreachable),
            ("jobs", "list a server's jobs",
             "List the recent jobs of every server the registry knows (or of one service, or of the server at "
             "--host): state, GPUs or share, owner, client. " + unreachable),
            ("cancel", "cancel a job",
             "Cancel a pending or running job by its id, on whichever server knows it: your own job, or anyone's "
             "with an admin certificate.")):
        sub = command(name, text, description)
        if name == "cancel":
            sub.add_argument("job_id", help="the job's id (see `rpycdl jobs`)")
        sub.add_argument("service", nargs="?", default=None,
                         help="only servers of this service (default: every server the registry knows)")
        sub.add_argument("--json", action="store_true", help="print JSON")
        _server_flags(sub)

    run = command(
        "run", "run a command on a GPU server with GPUs of its own, output live (like srun)",
        "Run COMMAND on a server of SERVICE once its GPUs are granted, with its output streamed here;\n"
        "exit with the command's exit code. The command runs in the server's working directory, as the\n"
        "server's user: paths are the server's. Ctrl-C cancels it.",
        usage="rpycdl run SERVICE [options] -- COMMAND [ARG ...]", epilog=RUN_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("service", help="service to run on (pytorch, tensorflow, ...; an alias such as pytorch-2.5)")
    size = run.add_mutually_exclusive_group()
    size.add_argument("--ngpus", type=int, default=None, help="whole GPUs, -1 for all (default: 1)")
    size.add_argument("--gpus", type=float, default=None, help="a share of one GPU, such as 0.25")
    size.add_argument("--gpu-memory", default=None, metavar="SIZE", help="a share of one GPU by memory, such as 6GiB")
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help=f"stop the command after this long (exit code {EXIT_JOB_TIMEOUT})")
    run.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                     help=f"give up if the GPUs are not granted within this long (exit code {EXIT_QUEUE_TIMEOUT})")
    _server_flags(run)

    demo = command("demo", "start a local registry and server and run the example client",
                   "Start a registry and a PyTorch server on loopback (the real GPUs through NVML if there are "
                   "any, else a simulated fake:2 inventory), run an example client against them with its output "
                   "shown, then stop everything. Ctrl-C stops it all.")
    demo.add_argument("--gpus", default=None, metavar="SPEC",
                      help="inventory (default: NVML if it works, else a simulated fake:2)")
    demo.add_argument("--client", default=str(REPO / "clients" / "three_jobs.py"),
                      help="client script to run (default: %(default)s)")

    selftest = command("selftest", "check a machine with real GPUs end to end",
                       "On a machine with NVIDIA GPUs and PyTorch: check the NVML inventory against nvidia-smi, "
                       "that a job sees only its GPU, that jobs queue for busy GPUs, shares of a GPU and the "
                       "memory watchdog, and print a report (scripts/gpu_selftest.sh runs it).")
    selftest.add_argument("--report", default=None, help="also write the report to this file")
    site_cli.add_commands(command, [verbose])
    return parser


def _server_flags(parser: argparse.ArgumentParser) -> None:
    """How a command that talks to servers finds them (registry or --host) and what it proves."""
    parser.add_argument("--host", default=None, help="use this server directly instead of asking the registry")
    parser.add_argument("--port", type=int, default=SERVER_PORT, help="with --host (default: %(default)s)")
    parser.add_argument("--registry", default=None, metavar="HOST[:PORT]",
                        help=f"registry to ask (default: ${ENV_REGISTRY}, else UDP broadcast)")
    _credential_flags(parser)


def _credential_flags(parser: argparse.ArgumentParser) -> None:
    where = f"else the credentials file (${ENV_CONFIG}, else {CONFIG_FILE})"
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help=f"the servers' shared secret (default: ${ENV_SECRET_FILE}, {where})")
    parser.add_argument("--tls-cert", default=None, metavar="FILE",
                        help=f"your certificate (default: ${ENV_TLS_CERT}, {where})")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help=f"its key (default: ${ENV_TLS_KEY}, {where})")
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help=f"the team's CA certificate (default: ${ENV_TLS_CA}, {where})")


INTERRUPTED = {"run": "interrupted: the job is cancelled", "demo": "interrupted: the servers and the registry stopped"}
"""What Ctrl-C prints, by subcommand (default: interrupted)."""


def main(argv: list[str] | None = None) -> int:
    """Run the rpycdl command; returns the exit code (see RUN_EXIT_CODES)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])
    args.argv = argv[split + 1:]  # `rpycdl run`'s command
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"rpycdl {args.command}: {INTERRUPTED.get(args.command, 'interrupted')}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RpycdlError as exc:
        print(f"rpycdl {args.command}: {exc}", file=sys.stderr)
        return exit_code(exc)
    except (OSError, EOFError) as exc:  # the network or the machine, not a bug of ours: one line
        if args.verbose:
            logging.getLogger("rpycdl.cli").exception("rpycdl %s failed", args.command)
        print(f"rpycdl {args.command}: {_os_error(exc)}", file=sys.stderr)
        return EXIT_FAILED


def exit_code(exc: RpycdlError) -> int:
    """The exit code of a command that failed with `exc` (RUN_EXIT_CODES)."""
    if isinstance(exc, JobTimeoutError):
        return EXIT_JOB_TIMEOUT
    if isinstance(exc, QueueTimeoutError):
        return EXIT_QUEUE_TIMEOUT
    return EXIT_USAGE if isinstance(exc, InvalidRequestError) else EXIT_FAILED


def _os_error(exc: OSError | EOFError) -> str:
    if isinstance(exc, EOFError):
        return "the server closed the connection unexpectedly (see its log)"
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _terminate(*_: Any) -> None:
    raise KeyboardInterrupt


def _registry(args: argparse.Namespace) -> int:
    try:
        registry.serve_registry(args.host, args.port)
    except OSError as exc:
        raise RpycdlError(_listen_failure(exc, "udp", args.host, args.port) or _os_error(exc)) from None
    print("rpycdl registry: stopped", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rpycdl.context import Limits
    from rpycdl.gpus import parse_size
    from rpycdl.server import ServerConfig, serve  # the server's imports are not the client's
    from rpycdl.shares import ShareRules

    max_payload = parse_size(args.max_payload)
    if max_payload < MIN_MAX_PAYLOAD or min(args.max_queued, args.max_queued_per_user, args.max_connections) < 1 \
            or not args.idle_timeout > 0:
        raise InvalidRequestError("--max-payload must be at least 1MiB, --max-queued, --max-queued-per-user and "
                                  "--max-connections at least 1, --idle-timeout positive")
    limits = Limits(max_payload=max_payload, max_queued=args.max_queued, max_queued_per_user=args.max_queued_per_user,
                    max_connections=args.max_connections, idle_timeout=args.idle_timeout)
    shares = ShareRules(unit=args.gpu_unit, allowance=parse_size(args.memory_allowance))
    config = ServerConfig(service=args.service, host=args.host, port=args.port, registry=args.registry,
                          gpus=args.gpus, lock_dir=args.lock_dir, insecure=args.insecure, version=args.version,
                          secret_file=args.secret_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          tls_ca=args.tls_ca, limits=limits, shares=shares)
    if args.registry != "none":
        registry.resolve(args.registry)  # a registry host that does not resolve: one line now, not a traceback later
    logging.getLogger("rpycdl.rpyc").addFilter(lambda record: record.getMessage() != "keyboard interrupt!")
    try:
        serve(config)
    except OSError as exc:  # the server's own refusals are RpycdlErrors already
        raise RpycdlError(_start_failure(exc, args)) from None
    print("rpycdl serve: stopped", file=sys.stderr)
    return 0


def _listen_failure(exc: OSError, protocol: str, host: str, port: int) -> str | None:
    """Why a server or registry could not listen on host:port, and what to do; None if that was not it."""
    where = f"cannot listen on {protocol} {host}:{port}"
    if isinstance(exc, socket.gaierror):
        return f"{where}: {exc.strerror}: give an address or a host name of this machine with --host"
    if exc.filename:
        return None
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: the port is in use (another server or registry?): stop it, or choose another --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine: give one of its addresses with --host"
    if exc.errno == errno.EACCES and 0 < port < 1024:
        return f"{where}: ports below 1024 need root: choose another --port"
    return None


def _start_failure(exc: OSError, args: argparse.Namespace) -> str:
    """Why `rpycdl serve` could not start, and what to do, in one line."""
    listening = _listen_failure(exc, "tcp", args.host, args.port)
    if listening:
        return listening + " (0 picks a free one)" if "--port" in listening else listening
    directory = os.path.abspath(args.lock_dir or os.environ.get(ENV_LOCK_DIR) or LOCK_DIR)
    failed = os.path.abspath(str(exc.filename)) if exc.filename else ""
    if failed and os.path.commonpath([failed, directory]) in (failed, directory):  # in it, or on the way to it
        return (f"cannot use the lock directory {directory}: {exc.strerror} ({exc.filename}). Every server of "
                f"the host writes there: make it a directory every user may write (chmod 1777 {directory}), "
                f"or choose another (--lock-dir, ${ENV_LOCK_DIR})")
    return f"cannot start: {_os_error(exc)}"


def _servers(args: argparse.Namespace) -> list[tuple[tuple[str, int], Callable[[], Connection]]]:
    """The servers a status/jobs/cancel command talks to, each with a way to connect to it
    with the command's credentials (flags, else environment, else the credentials file)."""
    settings = credentials.resolve(secret_file=args.secret_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                   tls_ca=args.tls_ca, registry=args.registry)
    if args.host:
        addresses = [(args.host, args.port)]
    else:
        names = [args.service.upper()] if args.service else registry.list_services(settings.registry)
        addresses = []
        for name in names:
            for address in registry.discover(name, settings.registry):
                if address not in addresses:
                    addresses.append(address)
    if not addresses:
        raise RpycdlError(f"the registry ({registry.describe(registry.registry_address(settings.registry))}) knows "
                          f"no {'server of ' + args.service.upper() if args.service else 'server'}: start one "
                          "(rpycdl serve --service NAME --registry HOST)")
    secret, tls_context = settings.secret(), settings.tls_context()  # read once for every server
    return [(address, functools.partial(connect_to, address, secret, tls_context)) for address in addresses]


def _each_server(args: argparse.Namespace, call: str) -> list[tuple[tuple[str, int], Any]]:
    results = []
    for address, open_connection in _servers(args):
        try:
            with open_connection() as conn:
                results.append((address, getattr(conn.root, call)()))
        except (OSError, EOFError, AuthFailedError, LimitError) as exc:  # one server's trouble is not the others'
            results.append((address, exc))
    return results


def _status(args: argparse.Namespace) -> int:
    results = _each_server(args, "gpu_status")
    if args.json:
        print(json.dumps([r if not isinstance(r, Exception) else {"address": list(a), "error": str(r)}
                          for a, r in results], indent=2))
    else:
        for address, status in results:
            print(format_status(address, status))
    return _reached(args, results)


def _reached(args: argparse.Namespace, results: list[tuple[tuple[str, int], Any]]) -> int:
    """0 if every server answered; else say which did not, and EXIT_FAILED."""
    failed = [f"{host}:{port}" for (host, port), result in results if isinstance(result, Exception)]
    if not failed:
        return 0
    print(f"rpycdl {args.command}: {len(failed)} of {len(results)} server(s) could not be reached: "
          f"{', '.join(failed)}", file=sys.stderr)
    return EXIT_FAILED


def format_status(address: tuple[str, int], status: dict[str, Any] | Exception) -> str:
    """Human-readable status of one server."""
    if isinstance(status, Exception):
        return f"{address[0]}:{address[1]}  {_unreachable(status)}\n"
    now = status["time"]
    server = status["server"]
    kind = "simulated " + server["inventory"] if server["simulated"] else "NVML"
    lines = [f"{server['name']} @ {address[0]}:{address[1]}  [{', '.join(server['aliases'])}]  {kind}"]
    lines.append(f"  {'GPU':<4}{'UUID':<42}{'NAME':<24}{'MEMORY USED':<22}HELD BY")
    for gpu in status["gpus"]:
        used = "?" if gpu["memory_used"] is None else format_size(gpu["memory_used"])
        memory = f"{used} / {format_size(gpu['memory_total'])}"
        holders = gpu["holders"]
        if not holders:
            who = "free"
        elif not holders[0]["memory"]:
            who = "whole: " + _holder(holders[0], now)
        else:
            granted = format_size(sum(holder["memory"] for holder in holders) * MiB)
            who = f"shared: {granted} of {format_size(gpu['memory_total'])} granted to {len(holders)} job(s)"
        lines.append(f"  {gpu['index']:<4}{gpu['uuid']:<42}{gpu['name'][:23]:<24}{memory:<22}{who}")
        if holders and holders[0]["memory"]:
            lines.extend(f"      {format_size(holder['memory'] * MiB)}: {_holder(holder, now)}" for holder in holders)
    if status["queue"]:
        lines.append(f"  waiting ({len(status['queue'])}), first come first served:")
        for place, waiter in enumerate(status["queue"], 1):
            wants = _need(waiter["count"], waiter["memory"])
            lines.append(f"    {place}. job {waiter['job_id']} of {waiter.get('user', 'unknown')} wants {wants}, "
                         f"from {waiter['client']} ({waiter['server']}), waiting {_ago(now - waiter['since'])}")
    else:
        lines.append("  nobody waiting")
    return "\n".join(lines) + "\n"


def _need(count: int, memory: int) -> str:
    """What a request asks for, in words: '2 GPU(s)', 'all GPUs', or '4 GiB of one GPU' (memory in MiB)."""
    if memory:
        return f"{format_size(memory * MiB)} of one GPU"
    return "all GPUs" if count < 0 else f"{count} GPU(s)"


def _holder(holder: dict[str, Any], now: float) -> str:
    return (f"job {holder['job_id']} of {holder.get('user', 'unknown')} from {holder['client']} ({holder['server']}) "
            f"since {time.strftime('%H:%M:%S', time.localtime(holder['since']))} ({_ago(now - holder['since'])})")


def _unreachable(exc: Exception) -> str:
    return f"{'REFUSED' if isinstance(exc, RpycdlError) else 'UNREACHABLE'} ({exc})"


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _jobs(args: argparse.Namespace) -> int:
    results = _each_server(args, "jobs")
    if args.json:
        print(json.dumps({f"{a[0]}:{a[1]}": (r if not isinstance(r, Exception) else str(r)) for a, r in results},
                         indent=2))
        return _reached(args, results)
    for (host, port), jobs in results:
        print(f"{host}:{port}")
        if isinstance(jobs, Exception):
            print(f"  {_unreachable(jobs)}")
            continue
        for job in jobs:
            when = time.strftime("%H:%M:%S", time.localtime(job["submitted"]))
            user = Identity(job["user"], job["user_verified"]).label
            print(f"  {job['job_id']}  {job['state']:<10} {_need(job['ngpus'], job['gpu_memory']):<18} "
                  f"{user:<24} from {job['client']:<22} "
                  f"submitted {when}  {job['error']}")
    return _reached(args, results)


def _cancel(args: argparse.Namespace) -> int:
    unreachable = []
    for (host, port), open_connection in _servers(args):
        try:
            with open_connection() as conn:
                if any(job["job_id"] == args.job_id for job in conn.root.jobs()):
                    state = conn.root.cancel(args.job_id)
                    print(f"job {args.job_id} ({state}) on {host}:{port}: cancel requested as "
                          f"{conn.identity['label']}")
                    return 0
        except NotAllowedError:  # a PermissionError, but the server's answer
            raise
        except (OSError, EOFError, AuthFailedError, LimitError) as exc:  # perhaps another server knows it
            unreachable.append(f"{host}:{port} ({exc})")
    unasked = f"; could not ask {', '.join(unreachable)}" if unreachable else ""
    raise RpycdlError(f"no server knows job {args.job_id}{unasked}")


def run_command(argv: list[str]) -> int:
    """The job of `rpycdl run`: the command, with the job's GPUs; returns its exit code."""
    try:
        return subprocess.run(argv, check=False).returncode
    except OSError as exc:  # not found, not executable: say so like a shell would
        print(f"rpycdl run: {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127


def _run(args: argparse.Namespace) -> int:
    argv = args.argv
    if not argv:
        raise InvalidRequestError("give the command to run after the service: rpycdl run pytorch -- python train.py")

    def on_state(state: str, info: dict[str, Any]) -> None:
        if state == "pending":
            print(f"rpycdl run: job {info['job_id']} waits for its GPUs ({info['ahead']} request(s) ahead)",
                  file=sys.stderr, flush=True)
        else:
            print(f"rpycdl run: job {info['job_id']} runs on GPU {','.join(map(str, info['gpus']))}",
                  file=sys.stderr, flush=True)

    target = {"host": args.host, "port": args.port} if args.host else {"service": args.service}
    try:
        conn = connect(**target, registry_address=args.registry, secret_file=args.secret_file,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    except OSError as exc:  # --host: a server that is not there (discovery says so itself)
        raise RpycdlError(f"cannot reach the server at {args.host}:{args.port}: {exc.strerror or exc}") from None
    with conn:
        try:
            code = conn.root.run_code(run_command, argv, args.ngpus, gpus=args.gpus, gpu_memory=args.gpu_memory,
                                      timeout=args.timeout, queue_timeout=args.queue_timeout, on_state=on_state)
        except (RpycdlError, OSError, EOFError):
            raise
        except Exception as exc:  # the job raised (not the command: its exit code comes back): it failed
            raise RpycdlError(f"the job failed: {type(exc).__name__}: {exc}") from None
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says


def _demo(args: argparse.Namespace) -> int:
    from rpycdl.gpus import load_inventory
    from rpycdl.local import LocalCluster

    gpus = args.gpus
    if gpus is None:
        try:
            inventory = load_inventory("nvml")
            print(f"rpycdl demo: NVML found {len(inventory.gpus())} real GPU(s)")
            gpus = "nvml"
        except NoInventoryError as exc:
            print(f"rpycdl demo: no real GPU here ({str(exc).split(' (')[0]}); using a SIMULATED inventory, fake:2")
            gpus = "fake:2"
    if not Path(args.client).is_file():
        raise RpycdlError(f"no client script at {args.client}: run the demo from a checkout, or pass --client")
    with tempfile.TemporaryDirectory(prefix="rpycdl-demo-") as lock_dir, LocalCluster(lock_dir) as cluster:
        print(f"rpycdl demo: registry on udp {cluster.registry_address}")
        _, port = cluster.add_server("pytorch", gpus)
        print(f"rpycdl demo: server PYTORCH on 127.0.0.1:{port} with {gpus}; running {args.client}\n", flush=True)
        env = {**os.environ, ENV_REGISTRY: cluster.registry_address}
        # In a session of its own, so that Ctrl-C reaches the demo, which stops it without its traceback.
        code = subprocess.call([sys.executable, args.client], env=env, start_new_session=True)
        print(f"\nrpycdl demo: client exited with {code}; stopping the server and the registry")
    return code


def _selftest(args: argparse.Namespace) -> int:
    from rpycdl.selftest import run_selftest

    return run_selftest(args.report)


COMMANDS = {"registry": _registry, "serve": _serve, "status": _status, "jobs": _jobs, "cancel": _cancel,
            "run": _run, "demo": _demo, "selftest": _selftest, **site_cli.COMMANDS}


def serve_service(service: str) -> None:
    """Entry point of servers/*_server.py: `rpycdl serve --service SERVICE` with this process's arguments."""
    sys.exit(main(["serve", "--service", service, *sys.argv[1:]]))
