"""`rpycdl serve`: the server's configuration, its service names and versions, building the
forking server (inventory, lock directory, authentication, registration) and running it."""

from __future__ import annotations

import getpass
import importlib.metadata
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rpycdl.artifacts.files import can_clone
from rpycdl.defaults import REREGISTER_INTERVAL, SAMPLER_MODULE, lock_dir, state_dir
from rpycdl.errors import ArtifactStoreError, InvalidRequestError
from rpycdl.gpu.inventory import load_inventory
from rpycdl.registry import registry_client
from rpycdl.scheduler import dirfds, limits, lockdir
from rpycdl.scheduler.planning import LEAST_BUSY
from rpycdl.scheduler.policies import Scheduling
from rpycdl.scheduler.shares import ShareRules
from rpycdl.security import auth, cgroups, tls
from rpycdl.security.accounts import Accounts
from rpycdl.security.auth import is_loopback
from rpycdl.security.handshake import ServerCredentials
from rpycdl.server import child
from rpycdl.server.context import Limits, ServerContext
from rpycdl.server.forking import DLServer
from rpycdl.server.forkserver import ForkServer
from rpycdl.server.limitwatch import LimitsWatch

FRAMEWORK_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "pytorch": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly"),
    "jax": ("jax",),
    "caffe": (),
    "deeplearning": (),
}
"""Package whose version names the service version, per known service (read from metadata,
so the server parent never imports, let alone initialises, the framework)."""

PRELOADED: dict[str, str] = {"pytorch": "torch", "jax": "jax"}
"""The module a service's job forkserver imports by default, where it is installed (rpycdl serve --preload), so
that every job starts with it imported. Not TensorFlow: importing it starts threads, after which forking is
not safe."""

CONTAINER_SERVICE = "deeplearning"
"""The generic service, whose jobs may run in containers of their own."""

log = logging.getLogger("rpycdl.server")


@dataclass
class ServerConfig:
    """Everything `rpycdl serve` takes."""

    service: str
    host: str = "127.0.0.1"
    port: int = 0
    registry: str | None = None  # HOST[:PORT]; None: $RPYCDL_REGISTRY or broadcast; "none": do not register
    inventory: str | None = None  # fake:N, fake:NxSIZE, nvml, or None for $RPYCDL_GPUS / NVML
    lock_dir: str | None = None
    state_dir: str | None = None  # None: $RPYCDL_STATE_DIR, else the lock directory's state/
    insecure: bool = False
    secret_file: str | None = None  # None: $RPYCDL_SECRET_FILE, else no authentication
    tls_cert: str | None = None  # all three, or none: mutual TLS (rpycdl.tls)
    tls_key: str | None = None
    tls_ca: str | None = None
    limits: Limits = field(default_factory=Limits)
    shares: ShareRules = field(default_factory=ShareRules)
    version: str | None = None  # framework version to announce; None reads package metadata
    artifact_store: str = ""  # where jobs' outputs go (a URL); "": the state directory's artifacts/
    artifact_endpoint: str | None = None  # an S3-compatible endpoint (MinIO)
    scheduling: Scheduling = field(default_factory=Scheduling)  # --policy, --placement, --fair-share
    accounts: Accounts = field(default_factory=Accounts)  # --user-map, --guest-user, --require-verified, --one-account
    preload: tuple[str, ...] | None = None  # --preload; None: the service's framework, where installed (PRELOADED)
    limits_file: str | None = None  # --limits: per-user and per-group limits (rpycdl.scheduler.limits)


def framework_version(service: str) -> str | None:
    """The installed version of the service's framework, from package metadata, or None."""
    for dist in FRAMEWORK_DISTRIBUTIONS.get(service.lower(), (service.lower(),)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def service_aliases(service: str, version: str | None) -> tuple[str, ...]:
    """`PYTORCH`, plus `PYTORCH-2.5` and `PYTORCH-2.5.1` when the version is known."""
    name = service.upper()
    if not name.replace("-", "").replace("_", "").isalnum():
        raise InvalidRequestError(f"bad service name {service!r}: letters, digits, '-' and '_' only")
    aliases = [name]
    if version:
        public = version.split("+")[0]
        parts = public.split(".")
        if len(parts) > 2:
            aliases.append(f"{name}-{'.'.join(parts[:2])}")
        aliases.append(f"{name}-{public}")
    return tuple(aliases)


def preload_of(config: ServerConfig) -> tuple[str, ...]:
    """The modules the job forkserver imports: --preload's, else the service's framework if it is installed."""
    if config.preload is not None:
        return config.preload
    module = PRELOADED.get(config.service.lower())
    return (module,) if module and importlib.util.find_spec(module) is not None else ()


def _remove_orphan_containers(lock_dir: str) -> None:
    """Remove job containers a killed server left running; before any thread or fork, since the
    parent must not use docker from a thread while it forks."""
    from rpycdl.server import containers  # only the generic server needs docker

    try:
        for name in containers.remove_orphans(lock_dir):
            print(f"removed orphaned job container {name}", flush=True)
    except Exception as exc:  # no engine reachable: nothing of ours can run there either
        log.info("orphaned job containers not checked: %s", exc)


def build_server(config: ServerConfig) -> DLServer:
    """Check the configuration, load the inventory, and bind the server (not started yet)."""
    secret = auth.load_secret(config.secret_file)
    tls_context = None
    if config.tls_cert or config.tls_key or config.tls_ca:
        tls_context = tls.server_context(config.tls_cert, config.tls_key, config.tls_ca)
    if not is_loopback(config.host) and not config.insecure and secret is None and tls_context is None:
        raise InvalidRequestError(
            f"refusing to listen on {config.host} without authentication: anyone who reaches it can run "
            "code here. Give TLS certificates (--tls-cert, --tls-key, --tls-ca) or a shared secret "
            "(--secret-file), bind to 127.0.0.1, or pass --insecure if the network is trusted")
    user_limits = None if config.limits_file is None else limits.read(config.limits_file)  # a bad file: refused
    inventory = load_inventory(config.inventory)
    version = config.version or framework_version(config.service)
    directory = config.lock_dir or lock_dir()
    states = config.state_dir or state_dir(directory)
    secure_trees(directory, states)
    # Creates the lock directory's layout, so it fails early on permissions; opens (or creates) the ledger.
    context = ServerContext(name=config.service.lower(), aliases=service_aliases(config.service, version),
                            inventory=inventory, lock_dir=directory, server_id=uuid.uuid4().hex[:12],
                            state_dir=states,
                            host=config.host, framework_version=version, limits=config.limits,
                            shares=config.shares, artifact_store=config.artifact_store,
                            artifact_endpoint=config.artifact_endpoint, scheduling=config.scheduling,
                            accounts=config.accounts)
    secure_trees(directory, states)  # made meanwhile in a sticky directory (/tmp) by another account: refused
    lockdir.claim_pid_namespace(Path(directory))
    lockdir.claim_isolation(Path(directory), context.accounts.mode)
    context.locks.claim_scheduling()
    limits.claim(Path(directory), user_limits, config.limits_file)
    context.preload = preload_of(config)
    if not config.limits.fence:
        cgroups.turn_off(cgroups.NO_FENCE)
    lockdir.claim_fencing(Path(directory), cgroups.mark())  # where jobs' cgroups go, found once before any fork
    context.launcher = ForkServer(context.server_id, context.preload, config.limits.fence)  # before any fork
    registrar = None
    if config.registry != "none":
        registrar = registry_client(config.registry)
        registrar.REREGISTER_INTERVAL = REREGISTER_INTERVAL
    return DLServer(context, ServerCredentials(tls_context, secret), hostname=config.host, port=config.port,
                    registrar=registrar, auto_register=registrar is not None, logger=logging.getLogger("rpycdl.rpyc"))


def secure_trees(lock_dir: str, states: str) -> None:
    """Where this process runs as root: refuse lock and state directories that another account could change
    (dirfds.check_trusted), and take from those that servers of other accounts shared what the private modes do
    not give (lockdir.make_private). Nothing elsewhere.

    Raises:
        RpycdlError: a directory another account could change, or holding files of another account.
    """
    if os.geteuid() != 0:
        return
    for root, what in ((lock_dir, "lock directory"), (states, "state directory")):
        dirfds.check_trusted(root, what)
        if os.path.isdir(root):
            lockdir.make_private(Path(root), skip=("simulated-gpus", "workdirs", "artifacts"))


def proc_hides_pids(mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether /proc is mounted with hidepid (invisible or noaccess: users see only their own processes)."""
    try:
        with open(mountinfo) as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 4 and fields[4] == "/proc":
                    options = line.rpartition(" - ")[2].split()[-1].split(",")
                    return any(option.startswith("hidepid=") and option not in ("hidepid=0", "hidepid=off")
                               for option in options)
    except OSError:
        pass
    return False


def serve(config: ServerConfig) -> None:
    """Build the server and serve until SIGTERM or Ctrl-C."""
    server = build_server(config)
    ctx = server.context
    if not is_loopback(config.host) and not server.credentials.mode:
        print(f"WARNING: listening on {config.host} with --insecure: anyone who can reach port "
              f"{server.port} can run code as {getpass.getuser()}",
              file=sys.stderr, flush=True)
    try:
        ctx.store.check()
    except ArtifactStoreError as exc:  # jobs still run; their outputs wait on the server for a retry
        print(f"WARNING: {exc}: jobs' outputs will stay on this server until `rpycdl artifacts JOB --retry`",
              file=sys.stderr, flush=True)
    server.listener.listen(server.backlog)  # before the ready line, so whoever reads it can connect at once
    gpus = ", ".join(f"{g.index}:{g.name}" for g in ctx.gpus)
    kind = "SIMULATED" if ctx.inventory.simulated else "NVML"
    print(f"rpycdl server {ctx.name} on {config.host}:{server.port} as {', '.join(ctx.aliases)}; "
          f"{len(ctx.gpus)} GPU(s) ({kind} {ctx.inventory.spec}): {gpus}; locks in {ctx.lock_dir}; "
          f"ledger {ctx.ledger.path} ({ctx.ledger.count()} job(s)); artifacts to {ctx.artifact_store}; "
          f"authentication: {server.credentials.mode or 'none'}; isolation: {ctx.accounts.mode}; "
          f"fencing: {cgroups.fencing(ctx.limits.job_tmp != -1)}; preloaded: "
          f"{', '.join(ctx.preload) or 'nothing'}; jobs' working "
          f"directories {'cloned' if can_clone(ctx.working_dirs.root) else 'copied (no reflinks here)'}", flush=True)
    if ctx.accounts.isolated and not proc_hides_pids():
        print("WARNING: /proc is mounted without hidepid: every local user reads the command lines of the others' "
              "jobs (and any secret on them); mount it with hidepid=invisible (docs/security.md, What is not "
              "protected)", file=sys.stderr, flush=True)
    if ctx.name == CONTAINER_SERVICE:
        _remove_orphan_containers(ctx.lock_dir)
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    watch = LimitsWatch(config.limits_file, Path(ctx.lock_dir), ctx.ledger)
    signal.signal(signal.SIGHUP, lambda *_: watch.reload())  # read the --limits file again
    watch.start()
    child.name_process("rpycdl-server")
    sampler = None
    if ctx.scheduling.placement == LEAST_BUSY and not ctx.inventory.simulated:  # NVML in a process of its own
        sampler = subprocess.Popen([sys.executable, "-m", SAMPLER_MODULE, ctx.lock_dir], stdin=subprocess.DEVNULL)
    try:
        server.start()
    except (KeyboardInterrupt, OSError):
        pass
    finally:
        if server.active:
            server.close()
        server.tally.flush(force=True)
        watch.stop()
        if sampler is not None:
            sampler.terminate()

