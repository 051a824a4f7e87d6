"""`rpycdl monitor`: the host's metrics for Prometheus and its dashboard, over HTTP."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from rpycdl.cli.common import Command
from rpycdl.defaults import ENV_GPUS, ENV_LOCK_DIR, ENV_SECRET_FILE, LOCK_DIR, MONITOR_PORT, state_dir
from rpycdl.errors import InvalidRequestError, RpycdlError, require_extra


def add_commands(command: Command) -> None:
    monitor = command(
        "monitor", "serve the host's metrics for Prometheus (/metrics), a dashboard (/) and a health check "
        "(/healthz)",
        "Serve, over HTTP (HTTPS with --tls-cert), what every server and container of this host shares: its\n"
        "GPUs (memory total, used and granted, utilisation, holders), the queue, and the jobs of the ledger\n"
        "(by state; queue wait and run time histograms; requests refused). One per host. It reads only: it\n"
        "takes no lock a grant waits on, and never touches CUDA. Scrape it with Prometheus: docs/monitor.md\n"
        "lists the metrics. Open / in a browser for the dashboard: the GPUs, the queue and the recent jobs, live;\n"
        "/jobs/ID for a job. Everyone sees that a job exists (owner, state, GPUs, times); its command, name,\n"
        "error and live log only its owner and admins, known by their client certificates (--tls-ca) or, on a\n"
        "shared-secret site, by the user name given with the secret (--secret-file) as the servers know them.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    monitor.add_argument("--host", default="127.0.0.1",
                         help="address to listen on (default: %(default)s); another needs --tls-cert or --insecure")
    monitor.add_argument("--port", type=int, default=MONITOR_PORT, help="TCP port, 0 for any (default: %(default)s)")
    monitor.add_argument("--gpus", default=None, metavar="SPEC",
                         help=f"the host's GPUs, as the servers were given them: nvml or fake:N (default: ${ENV_GPUS}, "
                              "else NVML)")
    monitor.add_argument("--lock-dir", default=None,
                         help=f"the servers' lock directory (default: ${ENV_LOCK_DIR}, else {LOCK_DIR})")
    monitor.add_argument("--state-dir", default=None, help="the servers' state directory (default: as theirs)")
    monitor.add_argument("--secret-file", default=None, metavar="PATH",
                         help="the site's shared secret (as `rpycdl serve --secret-file`, mode 600): whoever gives it "
                              "with a user name is that user, unverified, as on the servers (sees that user's jobs "
                              f"sent with the secret, their logs included); default ${ENV_SECRET_FILE}, else none")
    monitor.add_argument("--tls-cert", default=None, metavar="FILE",
                         help="serve HTTPS with this certificate (rpycdl certs server); then --host may be any "
                              "address without --insecure")
    monitor.add_argument("--tls-key", default=None, metavar="FILE", help="its key (mode 600)")
    monitor.add_argument("--tls-ca", default=None, metavar="FILE",
                         help="also require a client certificate signed by this CA (rpycdl certs user; for "
                              "Prometheus' tls_config): only the team's clients read the metrics and the dashboard, "
                              "each user their own jobs' details and logs, an admin everyone's")
    monitor.add_argument("--user", default=None, metavar="ACCOUNT",
                         help="started as root: the account (a name, or uid:gid) the monitor runs as once its port and "
                              "TLS files are open; it reads the lock and state directories through their group, so "
                              "the account is in it (docs/monitor.md, Which account). A monitor started as root on a "
                              "host whose servers run jobs as their owners needs one")
    monitor.add_argument("--insecure", action="store_true",
                         help="listen on a non-loopback address over plain HTTP: anyone who reaches it reads the "
                              "metrics and the dashboard (and a secret given for logs crosses the network in clear)")


def _monitor(args: argparse.Namespace) -> int:
    require_extra("server", "fasteners", "pynvml", "prometheus_client", "starlette", "uvicorn")
    from rpycdl.gpu.inventory import load_inventory
    from rpycdl.monitor import pages, reader
    from rpycdl.monitor.host import HostView
    from rpycdl.monitor.metrics import HostCollector
    from rpycdl.monitor.web import create_app, import_ahead, serve
    from rpycdl.security.auth import is_loopback, load_secret
    from rpycdl.security.tls import web_server_context

    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        tls = web_server_context(args.tls_cert, args.tls_key, args.tls_ca)
    elif not is_loopback(args.host) and not args.insecure:
        raise InvalidRequestError(f"--host {args.host} is not loopback: the metrics name users and jobs; give "
                                  "--tls-cert and --tls-key (and --tls-ca for client certificates), or add "
                                  "--insecure to serve them over plain HTTP to anyone who reaches this address")
    lock_dir = os.path.abspath(args.lock_dir or os.environ.get(ENV_LOCK_DIR) or LOCK_DIR)
    secret = load_secret(args.secret_file)
    states = args.state_dir or state_dir(lock_dir)
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise RpycdlError(f"cannot listen on tcp {args.host}:{args.port}: {exc.strerror or exc}; choose another "
                          "--port") from None
    if args.user:
        import_ahead()  # its account may not read where this Python lies
    reader.become_reader(lock_dir, states, args.user)
    inventory = load_inventory(args.gpus)
    collector = HostCollector(inventory, lock_dir, states)
    dashboard = pages.routes(HostView(inventory, lock_dir, states), secret)
    port = sock.getsockname()[1]
    logs = "logs for their owners" if secret or args.tls_ca else "no logs: no --tls-ca nor --secret-file"
    clients = ", client certificates of " + args.tls_ca if args.tls_ca else ""
    print(f"rpycdl monitor on http{'s' if tls else ''}://{args.host}:{port}/metrics (health: /healthz; dashboard: "
          f"/, {logs}{clients}); lock directory {lock_dir}", flush=True)
    serve(create_app(collector, dashboard), sock, tls)
    print("rpycdl monitor: stopped", file=sys.stderr)
    return 1 if reader.refused() else 0


COMMANDS = {"monitor": _monitor}
