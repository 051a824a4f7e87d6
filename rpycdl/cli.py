"""The `rpycdl` command: registry, serve, status, jobs, cancel, run, demo, selftest, certs, up, down."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rpycdl import credentials, registry, site_cli
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
    MAX_CONNECTIONS,
    MAX_PAYLOAD,
    MAX_QUEUED,
    MAX_QUEUED_PER_USER,
    MEMORY_ALLOWANCE,
    MIN_MAX_PAYLOAD,
    REGISTRY_PORT,
    SERVER_PORT,
)
from rpycdl.errors import AuthFailedError, InvalidRequestError, LimitError, NoInventoryError, RpycdlError
from rpycdl.locks import describe_need

REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rpycdl", description="Run Python functions on shared GPU servers, first come, first served.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the servers do")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    reg = commands.add_parser("registry", help="run the RPyC registry servers announce themselves to")
    reg.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    reg.add_argument("--port", type=int, default=REGISTRY_PORT, help="UDP port (default: %(default)s)")

    serve = commands.add_parser("serve", help="run a GPU server for one framework service")
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
                            "else /tmp/rpycdl-locks)")
    serve.add_argument("--framework-version", default=None, dest="version",
                       help="version to announce (default: read from the installed framework package)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow listening on a non-loopback address without authentication")
    serve.add_argument("--max-payload", default=str(MAX_PAYLOAD), metavar="SIZE",
                       help="largest call accepted, at least 1MiB, e.g. 8GiB (default: %(default)s bytes)")
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
    serve.add_argument("--memory-allowance", default=str(MEMORY_ALLOWANCE), metavar="SIZE",
                       help="GPU memory a job on a share may use beyond its grant (for the CUDA context) before "
                            "the watchdog stops it (default: %(default)s bytes)")
    serve.add_argument("--secret-file", default=None, metavar="PATH",
                       help=f"require clients to prove they know the shared secret in PATH (mode 600); "
                            f"default ${ENV_SECRET_FILE}, else no authentication")
    serve.add_argument("--tls-cert", default=None, metavar="FILE",
                       help="this server's certificate (rpycdl certs server): require mutual TLS")
    serve.add_argument("--tls-key", default=None, metavar="FILE", help="its key (mode 600)")
    serve.add_argument("--tls-ca", default=None, metavar="FILE",
                       help="the team's CA certificate: clients must present a certificate it signed")

    for name, text in (("status", "show each GPU, who holds it, and who waits"),
                       ("jobs", "list a server's jobs"), ("cancel", "cancel a job")):
        sub = commands.add_parser(name, help=text)
        if name == "cancel":
            sub.add_argument("job_id", help="the job's id (see `rpycdl jobs`)")
        sub.add_argument("service", nargs="?", default=None,
                         help="only servers of this service (default: every server the registry knows)")
        sub.add_argument("--json", action="store_true", help="print JSON")
        _server_flags(sub)

    run = commands.add_parser(
        "run", help="run a command on a GPU server with GPUs of its own, output live (like srun)",
        usage="rpycdl run SERVICE [options] -- COMMAND [ARG ...]",
        description="Run COMMAND on a server of SERVICE once its GPUs are granted, with its output streamed "
                    "here; exits with the command's exit code. The command runs in the server's working "
                    "directory, as the server's user: paths are the server's.",
        epilog="example: rpycdl run pytorch --gpu-memory 6GiB -- python train.py --lr 0.01")
    run.add_argument("service", help="service to run on (pytorch, tensorflow, ...; an alias such as pytorch-2.5)")
    size = run.add_mutually_exclusive_group()
    size.add_argument("--ngpus", type=int, default=None, help="whole GPUs, -1 for all (default: 1)")
    size.add_argument("--gpus", type=float, default=None, help="a share of one GPU, such as 0.25")
    size.add_argument("--gpu-memory", default=None, metavar="SIZE", help="a share of one GPU by memory, such as 6GiB")
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="stop the command after this long")
    run.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                     help="give up if the GPUs are not granted within this long")
    _server_flags(run)

    demo = commands.add_parser("demo", help="start a local registry and server and run the example client")
    demo.add_argument("--gpus", default=None, metavar="SPEC",
                      help="inventory (default: NVML if it works, else a simulated fake:2)")
    demo.add_argument("--client", default=str(REPO / "clients" / "three_jobs.py"),
                      help="client script to run (default: %(default)s)")

    selftest = commands.add_parser("selftest", help="check a machine with real GPUs end to end")
    selftest.add_argument("--report", default=None, help="also write the report to this file")
    site_cli.add_commands(commands)
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

def main(argv: list[str] | None = None) -> int:
    """Run the rpycdl command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])
    args.argv = argv[split + 1:]  # `rpycdl run`'s command
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return COMMANDS[args.command](args)
    except RpycdlError as exc:
        print(f"rpycdl {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _terminate(*_: Any) -> None:
    raise KeyboardInterrupt


def _registry(args: argparse.Namespace) -> int:
    registry.serve_registry(args.host, args.port)
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
    serve(config)
    return 0


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
        raise RpycdlError(f"the registry {registry.registry_address(settings.registry)} knows no "
                          f"{'server of ' + args.service.upper() if args.service else 'server'}")
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
        return 0
    for address, status in results:
        print(format_status(address, status))
    return 0


def format_status(address: tuple[str, int], status: dict[str, Any] | Exception) -> str:
    """Human-readable status of one server."""
    if isinstance(status, Exception):
        return f"{address[0]}:{address[1]}  {_unreachable(status)}\n"
    now = status["time"]
    server = status["server"]
    kind = "simulated " + server["inventory"] if server["simulated"] else "NVML"
    lines = [f"{server['name']} @ {address[0]}:{address[1]}  [{', '.join(server['aliases'])}]  {kind}"]
    lines.append(f"  {'GPU':<4}{'UUID':<42}{'NAME':<24}{'MEMORY USED':<20}HELD BY")
    for gpu in status["gpus"]:
        used = "?" if gpu["memory_used"] is None else f"{gpu['memory_used'] / 2**30:.1f}"
        memory = f"{used}/{gpu['memory_total'] / 2**30:.1f} GiB"
        holders = gpu["holders"]
        if not holders:
            who = "free"
        elif not holders[0]["memory"]:
            who = "whole: " + _holder(holders[0], now)
        else:
            granted = sum(holder["memory"] for holder in holders) * 2**20 / 2**30
            who = f"shared: {granted:.1f}/{gpu['memory_total'] / 2**30:.1f} GiB granted to {len(holders)} job(s)"
        lines.append(f"  {gpu['index']:<4}{gpu['uuid']:<42}{gpu['name'][:23]:<24}{memory:<20}{who}")
        if holders and holders[0]["memory"]:
            lines.extend(f"      {holder['memory'] / 1024:.1f} GiB: {_holder(holder, now)}" for holder in holders)
    if status["queue"]:
        lines.append(f"  waiting ({len(status['queue'])}), first come first served:")
        for place, waiter in enumerate(status["queue"], 1):
            wants = describe_need(waiter["count"], waiter["memory"])
            lines.append(f"    {place}. job {waiter['job_id']} of {waiter.get('user', 'unknown')} wants {wants}, "
                         f"from {waiter['client']} ({waiter['server']}), waiting {_ago(now - waiter['since'])}")
    else:
        lines.append("  nobody waiting")
    return "\n".join(lines) + "\n"


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
        return 0
    for (host, port), jobs in results:
        print(f"{host}:{port}")
        if isinstance(jobs, Exception):
            print(f"  {_unreachable(jobs)}")
            continue
        for job in jobs:
            when = time.strftime("%H:%M:%S", time.localtime(job["submitted"]))
            user = Identity(job["user"], job["user_verified"]).label
            print(f"  {job['job_id']}  {job['state']:<10} {describe_need(job['ngpus'], job['gpu_memory']):<18} "
                  f"{user:<24} from {job['client']:<22} "
                  f"submitted {when}  {job['error']}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    for (host, port), open_connection in _servers(args):
        with open_connection() as conn:
            if any(job["job_id"] == args.job_id for job in conn.root.jobs()):
                state = conn.root.cancel(args.job_id)
                print(f"job {args.job_id} ({state}) on {host}:{port}: cancel requested as {conn.identity['label']}")
                return 0
    raise RpycdlError(f"no server knows job {args.job_id}")


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
    with connect(**target, registry_address=args.registry, secret_file=args.secret_file, tls_cert=args.tls_cert,
                 tls_key=args.tls_key, tls_ca=args.tls_ca) as conn:
        code = conn.root.run_code(run_command, argv, args.ngpus, gpus=args.gpus, gpu_memory=args.gpu_memory,
                                  timeout=args.timeout, queue_timeout=args.queue_timeout, on_state=on_state)
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
        code = subprocess.call([sys.executable, args.client], env=env)
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
