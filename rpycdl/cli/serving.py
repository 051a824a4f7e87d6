"""The `rpycdl` subcommands that run something here: `registry`, `serve`, `demo` and `selftest`;
a start failure is one line saying what to do."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from typing import Any

from rpycdl import registry
from rpycdl.cli import reclaiming, scheduling
from rpycdl.cli.common import EXIT_FAILED, EXIT_USAGE, Command, os_error
from rpycdl.defaults import (
    DRAIN_TIMEOUT,
    ENV_GPUS,
    ENV_LOCK_DIR,
    ENV_REGISTRY,
    ENV_SECRET_FILE,
    ENV_STATE_DIR,
    GPU_UNIT,
    IDLE_TIMEOUT,
    JOB_PIDS,
    KEEP,
    LOCK_DIR,
    MAX_CONNECTIONS,
    MAX_FRAME_CEILING,
    MAX_LOG,
    MAX_OUTPUT,
    MAX_PAYLOAD,
    MAX_QUEUED,
    MAX_QUEUED_PER_USER,
    MAX_RESULT,
    MAX_STARTUPS,
    MAX_STARTUPS_CEILING,
    MAX_WORKING_DIR,
    MEMORY_ALLOWANCE,
    MIN_JOB_MEMORY,
    MIN_MAX_PAYLOAD,
    PER_SOURCE_STARTUPS,
    REGISTRY_PORT,
    SERVER_PORT,
    STATE_SUBDIR,
    WORKING_DIR_CACHE,
    lock_dir,
    state_dir,
)
from rpycdl.errors import InvalidRequestError, RpycdlError, require_extra
from rpycdl.security.accounts import Accounts
from rpycdl.units import format_duration, format_size, parse_duration, parse_size


def add_commands(command: Command) -> None:
    """Add registry, serve, demo and selftest to the `rpycdl` parser."""
    reg = command("registry", "run the RPyC registry servers announce themselves to",
                  "Run the site's RPyC UDP registry in the foreground, until Ctrl-C or SIGTERM. Servers "
                  "announce themselves to it every 20 seconds; clients (rpycdl.connect, rpycdl status, rpycdl "
                  "run) ask it which servers offer a service. One per site is enough.")
    reg.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    reg.add_argument("--port", type=int, default=REGISTRY_PORT, help="UDP port (default: %(default)s)")

    _add_serve(command)
    demo = command("demo", "start a local registry and server and run an example client",
                   "Start a registry, a PyTorch server and its monitor on loopback (the real GPUs through NVML if "
                   "there are any, else a simulated fake:2 inventory), run an example client against them with its "
                   "output shown, stop everything, and say what to try next. With --keep, run no client (unless "
                   "--client) and keep them running until Ctrl-C, for your own scripts and notebooks.")
    demo.add_argument("--gpus", default=None, metavar="SPEC",
                      help="inventory (default: NVML if it works, else a simulated fake:2)")
    demo.add_argument("--client", default=None, metavar="SCRIPT",
                      help="client script to run (default: clients/three_jobs.py, none with --keep)")
    demo.add_argument("--keep", action="store_true",
                      help="keep the registry and the server running until Ctrl-C, and print how to reach them")

    selftest = command("selftest", "check a machine with real GPUs end to end",
                       "On a machine with NVIDIA GPUs and PyTorch: check the NVML inventory against nvidia-smi, "
                       "a server confined by CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES, that a job sees only "
                       "its GPU, that jobs queue for busy GPUs, shares of a GPU and the memory watchdog, where "
                       "least-busy placement puts two compute-heavy shares, detached jobs, a CUDA call on a server "
                       "whose forkserver preloaded torch, a job of a second account (as root), the watchdog stopping "
                       "a job that reaches a GPU it was not granted, and the monitor's NVML figures, and print a "
                       "report (scripts/gpu_selftest.sh runs it).")
    selftest.add_argument("--report", default=None, help="also write the report to this file")


def _add_job_store_flags(serve: argparse.ArgumentParser) -> None:
    """Where the ledger and detached jobs' files live, and how much of them is kept."""
    serve.add_argument("--state-dir", default=None,
                       help=f"state directory shared by every server of the host: the job ledger, detached jobs' "
                            f"logs and results (default: ${ENV_STATE_DIR}, else {STATE_SUBDIR}/ in the lock directory)")
    serve.add_argument("--keep", default=format_duration(KEEP), metavar="DURATION",
                       help="how long finished jobs, their logs and results are kept, such as 7d or 12h "
                            "(default: %(default)s)")
    serve.add_argument("--max-log", default=format_size(MAX_LOG), metavar="SIZE",
                       help="most output a detached job's log keeps (default: %(default)s)")
    serve.add_argument("--max-result", default=format_size(MAX_RESULT), metavar="SIZE",
                       help="largest result a detached job may store (default: %(default)s)")
    serve.add_argument("--max-output", default=format_size(MAX_OUTPUT), metavar="SIZE",
                       help="most a job may leave in its output directory, measured about once a second while it "
                            "runs and at its end; past it, the job is stopped and fails, what it wrote is kept "
                            "(default: %(default)s)")
    serve.add_argument("--artifacts", default=None, metavar="URL",
                       help="where jobs' outputs go when they end: a directory, or s3://BUCKET[/PREFIX] (credentials "
                            "and region from the AWS variables; default: artifacts/ in the state directory)")
    serve.add_argument("--artifacts-endpoint", default=None, metavar="URL",
                       help="the S3-compatible endpoint of --artifacts, such as MinIO's (default: $AWS_ENDPOINT_URL, "
                            "else AWS)")
    serve.add_argument("--max-working-dir", default=format_size(MAX_WORKING_DIR), metavar="SIZE",
                       help="largest working directory a job may bring, its files' bytes (default: %(default)s)")
    serve.add_argument("--working-dir-cache", default=format_size(WORKING_DIR_CACHE), metavar="SIZE",
                       help="working directories kept by content in the state directory, so that the same one is not "
                            "sent twice; the least recently used go first (default: %(default)s)")


def _add_fence_flags(serve: argparse.ArgumentParser) -> None:
    """What each job may use of the host, where the server fences jobs (root: a cgroup per job, a private /tmp)."""
    serve.add_argument("--job-memory", default="auto", metavar="SIZE",
                       help="host memory of a job that does not ask (memory=): past it, the kernel stops the job and "
                            "it fails naming its limit (default: auto, its GPUs' share of this machine's memory)")
    serve.add_argument("--max-job-memory", default=None, metavar="SIZE",
                       help="most host memory a job may ask for (default: this machine's memory)")
    serve.add_argument("--job-pids", type=int, default=JOB_PIDS, metavar="N",
                       help="most processes and threads a job may have at once (default: %(default)s)")
    serve.add_argument("--job-cpus", type=float, default=None, metavar="N",
                       help="CPU cores a job that does not ask (cpus=) may use, a bandwidth share such as 4 or 0.5 "
                            "(default: all of them)")
    serve.add_argument("--no-fence", action="store_true",
                       help="fence no job, even where this server could (root: a cgroup per job), as a server that is "
                            "not root: no limit on a job's host memory, processes or CPUs, no device node kept from it "
                            "(for a host whose jobs another layer confines, such as Slurm's cgroups)")
    serve.add_argument("--job-tmp", default="off", metavar="SIZE",
                       help="give each job its own empty /tmp and /dev/shm of this size, gone at its end (auto: as "
                            "the job's memory limit, which its files there count against); off: jobs see the host's, "
                            "where a client on this host may leave them files (default: %(default)s)")


def _fence_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The fence flags as context.Limits fields, checked."""
    from rpycdl.server.context import memory

    job_memory = 0 if args.job_memory == "auto" else parse_size(args.job_memory)
    max_job_memory = memory() if args.max_job_memory is None else parse_size(args.max_job_memory)
    job_tmp = {"auto": 0, "off": -1}[args.job_tmp] if args.job_tmp in ("auto", "off") else parse_size(args.job_tmp)
    if job_memory and not MIN_JOB_MEMORY <= job_memory <= max_job_memory or max_job_memory < MIN_JOB_MEMORY:
        raise InvalidRequestError(f"--job-memory and --max-job-memory must be at least {format_size(MIN_JOB_MEMORY)}, "
                                  "--job-memory at most --max-job-memory")
    job_cpus = args.job_cpus or 0.0
    if args.job_pids < 16 or not 0 <= job_cpus <= (os.cpu_count() or 1) or job_tmp < 4096 and \
            args.job_tmp not in ("auto", "off"):
        raise InvalidRequestError(f"--job-pids must be at least 16, --job-cpus between 0 and this machine's "
                                  f"{os.cpu_count()} cores, --job-tmp a size, auto or off")
    return {"job_memory": job_memory, "max_job_memory": max_job_memory, "job_pids": args.job_pids,
            "job_cpus": job_cpus, "job_tmp": job_tmp, "fence": not args.no_fence}


def _add_limit_flags(serve: argparse.ArgumentParser) -> None:
    """What one client or user may take, and how many connections are held."""
    serve.add_argument("--max-payload", default=format_size(MAX_PAYLOAD), metavar="SIZE",
                       help="largest call accepted, at least 1 MiB (default: %(default)s)")
    serve.add_argument("--max-queued", type=int, default=MAX_QUEUED, metavar="N",
                       help="most requests waiting at once (default: %(default)s)")
    serve.add_argument("--max-queued-per-user", type=int, default=MAX_QUEUED_PER_USER, metavar="N",
                       help="most requests of one user waiting at once (default: %(default)s)")
    serve.add_argument("--max-frame", default=None, metavar="SIZE",
                       help="largest RPyC frame taken, checked on its header (default: --max-payload, but at most an "
                            "eighth of this machine's memory)")
    serve.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                       help="most authenticated client connections served at once (default: %(default)s)")
    serve.add_argument("--max-startups", default=":".join(map(str, MAX_STARTUPS)), metavar="LOW:RATE:HIGH",
                       help="connections still authenticating held at once: from LOW on, a new one is dropped with a "
                            "chance of RATE percent, rising to all at HIGH (default: %(default)s)")
    serve.add_argument("--per-source-startups", type=int, default=PER_SOURCE_STARTUPS, metavar="N",
                       help="connections of one address still authenticating held at once (default: %(default)s)")
    serve.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT, metavar="SECONDS",
                       help="close connections idle this long (default: %(default)s)")
    serve.add_argument("--drain-timeout", default=format_duration(DRAIN_TIMEOUT), metavar="DURATION",
                       help="once told to stop (SIGTERM), let the attached jobs and sessions under way run this long "
                            "at most, then cancel them (their clients get JobCancelledError); its connections refuse "
                            "new jobs meanwhile (ServerStoppingError), detached jobs are not touched (default: "
                            "%(default)s; 0 cancels them at once)")


def _add_isolation_flags(serve: argparse.ArgumentParser) -> None:
    """Whose account runs each job (rpycdl.security.accounts)."""
    serve.add_argument("--user-map", default=None, metavar="FILE",
                       help="a root server runs each job as the account named like its owner's verified identity; this "
                            "TOML file maps identities to other accounts ([accounts] alice = \"alice\" or "
                            "\"uid:gid\") and names admins ([admins] names = [...])")
    serve.add_argument("--guest-user", default=None, metavar="ACCOUNT",
                       help="on a root server, run the jobs of unverified clients (shared secret, no certificate) as "
                            "this account (default: refuse them)")
    serve.add_argument("--require-verified", action="store_true",
                       help="refuse jobs of unverified clients, on any server")
    serve.add_argument("--preload", default=None, metavar="MODULES",
                       help="modules (comma-separated) the job forkserver imports before it forks any job, so that "
                            "every job starts with them imported; '' for none (default: the service's framework where "
                            "installed: torch for pytorch, jax for jax; not tensorflow, which is not safe to fork "
                            "after its import)")
    serve.add_argument("--one-account", action="store_true",
                       help="on a root server, run every job as root, as a server that is not root runs every job as "
                            "its own account: jobs can then reach each other and the server's files")


def _accounts(args: argparse.Namespace) -> Accounts:
    """The server's account rules from the flags (a bad user map or guest account is a start failure)."""
    try:
        return Accounts.for_server(os.geteuid() == 0, args.one_account, args.user_map, args.guest_user,
                                   args.require_verified)
    except InvalidRequestError as exc:
        raise RpycdlError(str(exc)) from None


def _preload(text: str | None) -> tuple[str, ...] | None:
    """--preload's modules (None: the default); a name that is no module's is a usage error."""
    if text is None:
        return None
    modules = tuple(module.strip() for module in text.split(",") if module.strip())
    bad = [module for module in modules if not all(part.isidentifier() for part in module.split("."))]
    if bad:
        raise InvalidRequestError(f"--preload takes module names separated by commas, not {', '.join(bad)}")
    return modules


def _add_serve(command: Command) -> None:
    """The serve subcommand and its options."""
    serve = command("serve", "run a GPU server for one framework service",
                    "Run a GPU server for one framework service in the foreground, until Ctrl-C or SIGTERM. It "
                    "announces itself to the registry, queues each job for its GPUs first come, first served "
                    "with every server sharing the lock directory, and runs it in a process of its own that "
                    "sees only its GPUs. If it cannot start (port in use, lock or state directory not writable, "
                    "unusable credential files), it says what failed and what to do in one line and exits with "
                    f"{EXIT_FAILED} ({EXIT_USAGE} for a command line it cannot take: an unknown flag, a bad size).")
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
    _add_job_store_flags(serve)
    serve.add_argument("--framework-version", default=None, dest="version",
                       help="version to announce (default: read from the installed framework package)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow listening on a non-loopback address without authentication")
    _add_limit_flags(serve)
    _add_fence_flags(serve)
    reclaiming.add_flags(serve)
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
    scheduling.add_flags(serve)
    _add_isolation_flags(serve)


def _registry(args: argparse.Namespace) -> int:
    try:
        registry.serve_registry(args.host, args.port)
    except OSError as exc:
        raise RpycdlError(_listen_failure(exc, "udp", args.host, args.port) or os_error(exc)) from None
    print("rpycdl registry: stopped", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    require_extra("server", "fasteners", "pynvml")
    from rpycdl.scheduler.shares import ShareRules
    from rpycdl.server.app import (
        ServerConfig,
        serve,  # the server's imports are not the client's
    )
    from rpycdl.server.context import Limits
    from rpycdl.server.gate import parse_max_startups

    max_payload = parse_size(args.max_payload)
    if max_payload < MIN_MAX_PAYLOAD or min(args.max_queued, args.max_queued_per_user, args.max_connections,
                                            args.per_source_startups) < 1 or not args.idle_timeout > 0:
        raise InvalidRequestError("--max-payload must be at least 1MiB, --max-queued, --max-queued-per-user, "
                                  "--max-connections and --per-source-startups at least 1, --idle-timeout positive")
    limits = Limits(max_payload=max_payload, max_queued=args.max_queued, max_queued_per_user=args.max_queued_per_user,
                    max_connections=args.max_connections, idle_timeout=args.idle_timeout,
                    max_result=parse_size(args.max_result), max_log=parse_size(args.max_log),
                    max_output=parse_size(args.max_output),
                    keep=parse_duration(args.keep), max_working_dir=parse_size(args.max_working_dir),
                    working_dir_cache=parse_size(args.working_dir_cache),
                    max_startups=parse_max_startups(args.max_startups, MAX_STARTUPS_CEILING),
                    per_source_startups=args.per_source_startups, max_frame=_max_frame(args.max_frame),
                    drain_timeout=parse_duration(args.drain_timeout), **_fence_limits(args),
                    **reclaiming.limits(args))
    if min(limits.max_result, limits.max_log, limits.max_output, limits.max_working_dir,
           limits.working_dir_cache) < 1 or limits.keep <= 0:
        raise InvalidRequestError("--max-result, --max-log, --max-output, --max-working-dir, --working-dir-cache and "
                                  "--keep must be more than 0")
    shares = ShareRules(unit=args.gpu_unit, allowance=parse_size(args.memory_allowance))
    config = ServerConfig(service=args.service, host=args.host, port=args.port, registry=args.registry,
                          inventory=args.gpus, lock_dir=args.lock_dir, state_dir=args.state_dir,
                          insecure=args.insecure, version=args.version,
                          secret_file=args.secret_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          tls_ca=args.tls_ca, limits=limits, shares=shares, artifact_store=args.artifacts or "",
                          artifact_endpoint=args.artifacts_endpoint, scheduling=scheduling.scheduling(args),
                          accounts=_accounts(args), preload=_preload(args.preload), limits_file=args.limits)
    if args.registry != "none":
        registry.resolve(args.registry)  # a registry host that does not resolve: one line now, not a traceback later
    logging.getLogger("rpycdl.rpyc").addFilter(lambda record: record.getMessage() != "keyboard interrupt!")
    try:
        serve(config)
    except OSError as exc:
        raise RpycdlError(_start_failure(exc, args)) from None
    except InvalidRequestError as exc:  # credential files, the inventory, an address: a start failure, exit 1
        raise RpycdlError(str(exc)) from None  # (exit 2 is the command line's: argparse and the checks above)
    print("rpycdl serve: stopped", file=sys.stderr)
    return 0


def _max_frame(text: str | None) -> int:
    """--max-frame in bytes (0: the default, derived from --max-payload and the machine's memory)."""
    from rpycdl.server.context import memory

    if text is None:
        return 0
    size = parse_size(text)
    if not MIN_MAX_PAYLOAD <= size <= min(MAX_FRAME_CEILING, memory() // 2):
        raise InvalidRequestError(f"--max-frame must be at least 1MiB and at most {format_size(MAX_FRAME_CEILING)} "
                                  f"and half this machine's memory ({format_size(memory() // 2)}): a frame is held "
                                  "whole, twice for a moment")
    return size


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


def _root_keeps(directory: str) -> bool:
    """Whether `directory` is a lock directory of servers running as root (root's, not writable by others)."""
    try:
        status = os.stat(directory)
    except OSError:
        return False
    return status.st_uid == 0 and not status.st_mode & 0o002


def _start_failure(exc: OSError, args: argparse.Namespace) -> str:
    """Why `rpycdl serve` could not start, and what to do, in one line."""
    listening = _listen_failure(exc, "tcp", args.host, args.port)
    if listening:
        return listening + " (0 picks a free one)" if "--port" in listening else listening
    locks = args.lock_dir or lock_dir()
    directory = os.path.abspath(locks)
    failed = os.path.abspath(str(exc.filename)) if exc.filename else ""

    def on_the_way(path: str) -> bool:  # in it, or on the way to it
        return bool(failed) and os.path.commonpath([failed, path]) in (failed, path)

    if on_the_way(directory) and os.geteuid() != 0 and _root_keeps(directory):
        return (f"cannot use the lock directory {directory}: {exc.strerror} ({exc.filename}). It is kept by servers "
                "running as root, root's alone to change: run this server as root too, or choose another lock "
                f"directory (--lock-dir, ${ENV_LOCK_DIR})")
    if on_the_way(directory):
        return (f"cannot use the lock directory {directory}: {exc.strerror} ({exc.filename}). Every server of "
                f"the host writes there: make it a directory every user may write (chmod 1777 {directory}), "
                f"or choose another (--lock-dir, ${ENV_LOCK_DIR})")
    state = os.path.abspath(args.state_dir or state_dir(locks))
    if on_the_way(state):
        return (f"cannot use the state directory {state}: {exc.strerror} ({exc.filename}). Every server of the "
                f"host keeps the job ledger and detached jobs' files there: make it a directory the servers may "
                f"write, or choose another (--state-dir, ${ENV_STATE_DIR})")
    return f"cannot start: {os_error(exc)}"


def _demo(args: argparse.Namespace) -> int:
    require_extra("server", "fasteners", "pynvml", "prometheus_client", "starlette", "uvicorn")
    from rpycdl.site import demo

    return demo.run(args.gpus, args.client, args.keep)


def _selftest(args: argparse.Namespace) -> int:
    from rpycdl.site.selftest import run_selftest

    return run_selftest(args.report)


COMMANDS = {"registry": _registry, "serve": _serve, "demo": _demo, "selftest": _selftest}
