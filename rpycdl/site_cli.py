"""The site operator's subcommands of `rpycdl`: `certs` (a small team's certificate authority,
rpycdl.certs) and `up`/`down` (the service containers, rpycdl.containers). rpycdl.cli adds them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rpycdl.defaults import CA_DAYS, CONFIG_FILE, LOCK_DIR, REGISTRY_PORT, SERVER_CERT_DAYS, SERVER_PORT, USER_CERT_DAYS


def add_commands(commands: Any) -> None:
    """Add certs, up and down to the `rpycdl` parser's subcommands."""
    _certs_commands(commands)
    _container_commands(commands)


# -- rpycdl certs: a small team's certificate authority (rpycdl.certs) -----------------------


def _certs_commands(commands: Any) -> None:
    certs = commands.add_parser("certs", help="create a team's CA, server and user certificates for mutual TLS")
    kinds = certs.add_subparsers(dest="kind", required=True, metavar="KIND")

    def kind(name: str, text: str) -> argparse.ArgumentParser:
        parser = kinds.add_parser(name, help=text)
        parser.add_argument("dir", metavar="DIR", help="the CA's directory")
        return parser

    ca = kind("ca", "create the certificate authority in DIR (ca.crt, ca.key)")
    ca.add_argument("--days", type=int, default=CA_DAYS, help="validity (default: %(default)s)")
    server = kind("server", "issue DIR/server-NAME.crt and .key for a server host")
    server.add_argument("--name", action="append", required=True, metavar="HOST",
                        help="a host name clients dial (repeat for more; the first names the files)")
    server.add_argument("--ip", action="append", default=[], metavar="ADDR",
                        help="an IP address clients dial, e.g. the one the registry hands out (repeat for more)")
    server.add_argument("--days", type=int, default=SERVER_CERT_DAYS, help="validity (default: %(default)s)")
    user = kind("user", "issue DIR/user-NAME.crt and .key for a user")
    user.add_argument("user", metavar="NAME", help="the user's name, as jobs will show it")
    user.add_argument("--admin", action="store_true", help="may cancel anyone's job")
    user.add_argument("--days", type=int, default=USER_CERT_DAYS, help="validity (default: %(default)s)")


def _certs(args: argparse.Namespace) -> int:
    from rpycdl import certs  # cryptography is needed only here

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


def _container_commands(commands: Any) -> None:
    up = commands.add_parser("up", help="start the registry and server containers (see scripts/start_servers.sh)")
    up.add_argument("specs", nargs="+", metavar="SERVICE[:VERSION]",
                    help="a server per spec, from image rpycdl-SERVICE:VERSION (default tag: latest)")
    up.add_argument("--registry", default=f"127.0.0.1:{REGISTRY_PORT}", metavar="HOST:PORT",
                    help="registry the servers announce to (default: %(default)s)")
    up.add_argument("--no-registry", action="store_true", help="do not start a registry container: use --registry's")
    up.add_argument("--host", default="127.0.0.1",
                    help="address servers listen on, handed to clients by the registry (default: %(default)s)")
    up.add_argument("--insecure", action="store_true", help="let servers listen on a non-loopback address")
    up.add_argument("--port", type=int, default=SERVER_PORT, help="first server port (default: %(default)s)")
    up.add_argument("--gpus", default="all", help="'all' (NVIDIA runtime) or fake:N (default: %(default)s)")
    up.add_argument("--lock-dir", default=LOCK_DIR, help="host lock directory (default: %(default)s)")
    up.add_argument("--user", default=None, metavar="UID[:GID]", help="user to run as (default: the image's)")
    up.add_argument("--secret-file", default=None, metavar="PATH",
                    help="shared secret the servers require (mounted read-only; readable by the servers' user)")
    for name, what in (("cert", "the servers' TLS certificate"), ("key", "its key"),
                       ("ca", "the CA whose client certificates the servers accept")):
        up.add_argument(f"--tls-{name}", default=None, metavar="PATH", help=f"{what} (mounted read-only)")
    up.add_argument("--shm-size", default="8g", help="shared memory per server (default: %(default)s)")
    up.add_argument("--no-ulimits", action="store_true",
                    help="keep the engine's ulimits instead of memlock=-1, stack=64 MiB")
    down = commands.add_parser("down", help="stop and remove every rpycdl container (servers, registry, jobs)")
    down.add_argument("--timeout", type=int, default=10, help="seconds to wait for a clean stop (default: %(default)s)")


def _up(args: argparse.Namespace) -> int:
    from rpycdl.containers import UpConfig, up

    config = UpConfig(specs=args.specs, registry=args.registry, start_registry=not args.no_registry, host=args.host,
                      insecure=args.insecure, port=args.port, gpus=args.gpus, lock_dir=args.lock_dir, user=args.user,
                      secret_file=args.secret_file, tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                      shm_size=args.shm_size)
    if args.no_ulimits:
        config.ulimits = []
    for container in up(config):
        print(f"started {container.name} ({container.short_id})")
    return 0


def _down(args: argparse.Namespace) -> int:
    from rpycdl.containers import down

    for name in down(timeout=args.timeout):
        print(f"removed {name}")
    return 0


COMMANDS = {"certs": _certs, "up": _up, "down": _down}
