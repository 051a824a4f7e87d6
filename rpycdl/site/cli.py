"""The site operator's subcommands of `rpycdl`: `certs` (a small team's certificate authority,
rpycdl.certs) and `up`/`down` (the service containers, rpycdl.containers). rpycdl.cli adds them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from rpycdl.defaults import (
    CA_DAYS,
    CONFIG_FILE,
    LOCK_DIR,
    MONITOR_PORT,
    REGISTRY_PORT,
    SERVER_CERT_DAYS,
    SERVER_PORT,
    USER_CERT_DAYS,
)
from rpycdl.errors import require_extra
from rpycdl.scheduler.planning import PLACEMENTS
from rpycdl.scheduler.policies import POLICIES

Command = Callable[..., argparse.ArgumentParser]
"""rpycdl.cli's maker of a subcommand: command(name, help, description, **options) -> its parser."""


def add_commands(command: Command, parents: list[argparse.ArgumentParser]) -> None:
    """Add certs, up and down to the `rpycdl` parser's subcommands.

    Args:
        command: makes a subcommand's parser (rpycdl.cli's).
        parents: options every parser takes, sub-subcommands' too (-v).
    """
    _certs_commands(command, parents)
    _container_commands(command)


# -- rpycdl certs: a small team's certificate authority (rpycdl.certs) -----------------------


def _certs_commands(command: Command, parents: list[argparse.ArgumentParser]) -> None:
    certs = command("certs", "create a team's CA, server and user certificates for mutual TLS",
                    "A small team's certificate authority for mutual TLS: create the CA once (ca), then a "
                    "certificate for each server host (server) and for each user (user). Keep ca.key on this "
                    "machine only: whoever holds it can issue admin certificates.")
    kinds = certs.add_subparsers(dest="kind", required=True, metavar="KIND")

    def kind(name: str, text: str, description: str) -> argparse.ArgumentParser:
        parser = kinds.add_parser(name, help=text, description=description, parents=parents)
        parser.add_argument("dir", metavar="DIR", help="the CA's directory")
        return parser

    ca = kind("ca", "create the certificate authority in DIR (ca.crt, ca.key)",
              "Create the team's certificate authority in DIR: ca.crt (give it to every server and user) and "
              "ca.key (mode 600; keep it here). Never overwrites.")
    ca.add_argument("--days", type=int, default=CA_DAYS, help="validity (default: %(default)s)")
    server = kind("server", "issue DIR/server-NAME.crt and .key for a server host",
                  "Issue a server certificate, signed by the CA in DIR, for the host names and addresses clients "
                  "dial: DIR/server-NAME.crt and its key, for rpycdl serve --tls-cert/--tls-key.")
    server.add_argument("--name", action="append", required=True, metavar="HOST",
                        help="a host name clients dial (repeat for more; the first names the files)")
    server.add_argument("--ip", action="append", default=[], metavar="ADDR",
                        help="an IP address clients dial, e.g. the one the registry hands out (repeat for more)")
    server.add_argument("--days", type=int, default=SERVER_CERT_DAYS, help="validity (default: %(default)s)")
    user = kind("user", "issue DIR/user-NAME.crt and .key for a user",
                "Issue a user certificate, signed by the CA in DIR: DIR/user-NAME.crt and its key, which name the "
                "user's jobs; --admin lets its holder cancel anyone's job.")
    user.add_argument("user", metavar="NAME", help="the user's name, as jobs will show it")
    user.add_argument("--admin", action="store_true", help="may cancel anyone's job")
    user.add_argument("--days", type=int, default=USER_CERT_DAYS, help="validity (default: %(default)s)")


def _certs(args: argparse.Namespace) -> int:
    require_extra("site", "cryptography")
    from rpycdl.security import certs  # cryptography is needed only here

    if args.kind == "ca":
        issued = certs.create_ca(args.dir, days=args.days)
        print(f"created the CA {issued.cert} (give it to every server and user) and its key {issued.key} "
              "(keep it here, mode 600)")
    elif args.kind == "server":
        issued = certs.issue_server(args.dir, args.name, args.ip, days=args.days)
        print(f"issued {issued.cert} and {issued.key} for {', '.join(args.name + args.ip)}: "
              f"rpycdl serve --tls-cert {issued.cert} --tls-key {issued.key} --tls-ca {Path(args.dir) / 'ca.crt'}")
    else:
        issued = certs.issue_user(args.dir, args.user, admin=args.admin, days=args.days)
        print(f"issued {issued.cert} and {issued.key} for {args.user}{' (admin)' if args.admin else ''}: give "
              f"them with ca.crt to the user, for tls_cert, tls_key and tls_ca in {CONFIG_FILE}")
    return 0


# -- rpycdl up / down: service containers through the docker SDK (rpycdl.containers) -------


PID_HOST = ("Every server container shares the host's process namespace (--pid host): every server sharing a "
            "lock directory must see the processes of every job on the host, to check that nothing of a crashed "
            "job still runs before its GPUs are granted again, and for the memory watchdog, which reads the host "
            "pids NVML reports.")


def _container_commands(command: Command) -> None:
    up = command("up", "start the registry, server and monitor containers (see scripts/start_servers.sh)",
                 "Start a registry container and one server container per SERVICE[:VERSION] on this host's Docker "
                 "engine, from the images scripts/build_images.sh builds, on the host network, all sharing the "
                 "lock directory, and the host's monitor (rpycdl monitor, from the first server's image), "
                 "published on 127.0.0.1:--monitor-port; its address is printed. Starting again is harmless: a "
                 "container that runs already is left as it is, a stale one (created, exited) is replaced. If the "
                 "engine refuses the ulimits (rootless or sandboxed engines), the servers run with the engine's own, "
                 "and a line says so. If a container cannot start, those this command created are removed again. "
                 + PID_HOST)
    up.add_argument("specs", nargs="+", metavar="SERVICE[:VERSION]",
                    help="a server per spec, from image rpycdl-SERVICE:VERSION (default tag: latest)")
    up.add_argument("--registry", default=f"127.0.0.1:{REGISTRY_PORT}", metavar="HOST:PORT",
                    help="registry the servers announce to (default: %(default)s)")
    up.add_argument("--no-registry", action="store_true", help="do not start a registry container: use --registry's")
    up.add_argument("--host", default="127.0.0.1",
                    help="address servers listen on, handed to clients by the registry (default: %(default)s)")
    up.add_argument("--insecure", action="store_true",
                    help="let servers listen on a non-loopback address, and publish the monitor (which has no "
                         "authentication) on --host instead of 127.0.0.1")
    up.add_argument("--port", type=int, default=SERVER_PORT, help="first server port (default: %(default)s)")
    up.add_argument("--gpus", default="all", help="'all' (NVIDIA runtime) or fake:N (default: %(default)s)")
    up.add_argument("--lock-dir", default=LOCK_DIR, help="host lock directory (default: %(default)s)")
    up.add_argument("--user", default=None, metavar="UID[:GID]", help="user to run as (default: the image's)")
    up.add_argument("--secret-file", default=None, metavar="PATH",
                    help="shared secret the servers require (mounted read-only; readable by the servers' user)")
    for name, what in (("cert", "the servers' TLS certificate"), ("key", "its key"),
                       ("ca", "the CA whose client certificates the servers accept")):
        up.add_argument(f"--tls-{name}", default=None, metavar="PATH", help=f"{what} (mounted read-only)")
    up.add_argument("--monitor-port", type=int, default=MONITOR_PORT, metavar="PORT",
                    help="host port of the monitor container, 0 to start none (default: %(default)s)")
    up.add_argument("--shm-size", default="8g", help="shared memory per server (default: %(default)s)")
    up.add_argument("--policy", default=None, choices=POLICIES,
                    help="the servers' scheduling policy (see rpycdl serve --help; default: fcfs)")
    up.add_argument("--placement", default=None, choices=PLACEMENTS,
                    help="where the servers place shares of a GPU (see rpycdl serve --help; default: pack)")
    up.add_argument("--fair-share", default=None, metavar="PATH",
                    help="with --policy fair: the site's fair-share file (mounted read-only)")
    up.add_argument("--user-map", default=None, metavar="PATH",
                    help="with --user 0: servers run as root and each job as its owner's account, mapped by this "
                         "file (identities to \"uid:gid\"; see rpycdl serve --user-map; mounted read-only)")
    up.add_argument("--no-ulimits", action="store_true",
                    help="keep the engine's ulimits instead of asking for memlock=-1, stack=64 MiB (an engine that "
                         "refuses them gets its own anyway)")
    down = command("down", "stop and remove every rpycdl container (servers, monitor, registry, jobs)",
                   "Stop the server containers (SIGTERM, then SIGKILL after --timeout), the monitor and the registry "
                   "that rpycdl up or scripts/start_servers.sh started, then remove them and any job container the "
                   "generic server left. Containers are found by their rpycdl.role label.")
    down.add_argument("--timeout", type=int, default=10, help="seconds to wait for a clean stop (default: %(default)s)")


def _up(args: argparse.Namespace) -> int:
    require_extra("site", "docker")
    from rpycdl.site.docker import docker_client
    from rpycdl.site.up import UpConfig, monitor_url, up

    config = UpConfig(specs=args.specs, registry=args.registry, start_registry=not args.no_registry, host=args.host,
                      insecure=args.insecure, port=args.port, inventory=args.gpus, lock_dir=args.lock_dir,
                      user=args.user, secret_file=args.secret_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
                      tls_ca=args.tls_ca, shm_size=args.shm_size, monitor_port=args.monitor_port,
                      scheduling=[f"--{name}={value}" for name, value in (("policy", args.policy),
                                                                          ("placement", args.placement)) if value],
                      fair_share=args.fair_share, user_map=args.user_map)
    if args.no_ulimits:
        config.ulimits = []
    client = docker_client()
    for container in up(config, client, say=lambda line: print(f"rpycdl up: {line}", file=sys.stderr)):
        print(f"started {container.name} ({container.short_id})")
    url = monitor_url(client, config.image_prefix)  # the one that runs: a monitor left running keeps its address
    if url:
        print(f"monitor on {url}")
    return 0


def _down(args: argparse.Namespace) -> int:
    require_extra("site", "docker")
    from rpycdl.site.up import down

    for name in down(timeout=args.timeout):
        print(f"removed {name}")
    return 0


COMMANDS = {"certs": _certs, "up": _up, "down": _down}
