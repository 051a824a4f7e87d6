"""`rpycdl.connect(...)`: credentials, discovery through the registry, and choosing the server most
likely to run a job soonest; or a server named directly. `rpycdl.job(ref)`: the server that knows a job."""

from __future__ import annotations

import functools
import ssl
from typing import Any

import rpyc

from rpycdl import registry
from rpycdl.client import channel, credentials
from rpycdl.client.connection import CLIENT_CONFIG, Connection, call
from rpycdl.client.jobs import Job
from rpycdl.defaults import SERVER_PORT
from rpycdl.errors import AuthFailedError, DiscoveryError, InvalidRequestError, LimitError
from rpycdl.states import JobState
from rpycdl.wire import codec


def connect(service: str | None = None, *, host: str | None = None, port: int | None = None,
            registry_address: str | None = None, secret_file: str | None = None, tls_cert: str | None = None,
            tls_key: str | None = None, tls_ca: str | None = None, quiet: bool | None = None) -> Connection:
    """Connect to a server of `service` found through the registry, or to host:port directly.

    Among the live servers of the service, the one with the most free GPUs and the shortest
    queue is chosen. Each credential and the registry come from the argument, else its
    environment variable ($RPYCDL_SECRET_FILE, $RPYCDL_TLS_CERT, $RPYCDL_TLS_KEY, $RPYCDL_TLS_CA,
    $RPYCDL_REGISTRY), else the credentials file (rpycdl.credentials). With credentials, a client
    talks only to servers that prove themselves (the team's CA signed their certificate for the
    address dialled, or they know the secret); without, only to servers without authentication.

    Args:
        service: a service name or alias: "pytorch", "PYTORCH-2.5", "deeplearning", ...
        host, port: connect directly instead (port defaults to 18861).
        registry_address: "HOST[:PORT]" of the registry; default: UDP broadcast.
        secret_file: file holding the team's shared secret.
        tls_cert, tls_key, tls_ca: this user's certificate and key, and the team's CA certificate.
        quiet: True: its calls say nothing of their own (no waiting line, no download bar); False: they do,
            even in batch use; None (default): where a person looks (a terminal, a notebook), unless
            $RPYCDL_QUIET=1. Connection.quiet changes it later.

    Raises:
        DiscoveryError: no registry answered (or its host name does not resolve), it knows no
            server of the service, or none of them answered.
        AuthFailedError: client and server could not authenticate each other.
        LimitError: the server refused the connection (--max-connections).
        ConnectionFailedError: with host=, the server could not be reached (also a ConnectionError); the
            message names its address.
        InvalidRequestError: neither a service nor a host was given, or unusable credentials.
    """
    settings = credentials.resolve(secret_file=secret_file, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
                                   registry=registry_address)
    secret, tls_context = settings.secret(), settings.tls_context()
    if host is not None:
        return connect_to((host, port or SERVER_PORT), secret, tls_context, quiet)
    if not service:
        raise InvalidRequestError("connect() needs a service name, or host= (and port=)")
    connection = _discover(service, settings.registry, secret, tls_context)
    connection.quiet = quiet
    return connection


def connect_to(address: tuple[str, int], secret: bytes | None, tls_context: ssl.SSLContext | None,
               quiet: bool | None = None) -> Connection:
    """Connect to the server at `address` with credentials already loaded (connect() loads them;
    a command talking to many servers loads them once).

    Raises:
        ConnectionFailedError, AuthFailedError, LimitError: as for connect(host=...).
    """
    reopen = functools.partial(channel.connect, *address, CLIENT_CONFIG, secret, tls_context)
    return Connection(reopen(), address, reopen, quiet=quiet)


def server_addresses(service: str | None, registry_address: str | None) -> list[tuple[str, int]]:
    """The addresses of the live servers of `service` (of every service, if None) the registry knows.

    Raises:
        DiscoveryError: no registry answered, or it knows no such server.
    """
    names = [service.upper()] if service else registry.list_services(registry_address)
    addresses: list[tuple[str, int]] = []
    for name in names:
        for address in registry.discover(name, registry_address):
            if address not in addresses:
                addresses.append(address)
    if not addresses:
        raise DiscoveryError(f"the registry ({registry.describe(registry.registry_address(registry_address))}) knows "
                             f"no {'server of ' + service.upper() if service else 'server'}: start one "
                             "(rpycdl serve --service NAME --registry HOST)")
    return addresses


def _discover(service: str, registry_address: str | None, secret: bytes | None,
              tls_context: ssl.SSLContext | None) -> Connection:
    """Connect to the best live server of `service` that passes authentication."""
    addresses = registry.discover(service, registry_address)  # DiscoveryError if no registry answers
    if not addresses:
        where = registry.describe(registry.registry_address(registry_address))
        raise DiscoveryError(f"the registry ({where}) knows no server of {service.upper()!r}: start one "
                             "(rpycdl serve --service NAME --registry HOST), or check the name (rpycdl status "
                             "lists every server the registry knows)")
    best: tuple[tuple[int, int], rpyc.Connection, tuple[str, int]] | None = None
    refused: list[tuple[tuple[str, int], AuthFailedError | LimitError]] = []
    down: list[str] = []
    for address in addresses:
        try:
            conn = channel.connect(*address, CLIENT_CONFIG, secret, tls_context)
            with channel.reported(address, "calling load"):
                free, waiting, _ = call(conn, "load")
        except (AuthFailedError, LimitError) as exc:  # a server that cannot prove itself gets nothing
            refused.append((address, exc))
            continue
        except (OSError, EOFError) as exc:
            down.append(str(exc))
            continue
        score = (-free, waiting)
        if best is None or score < best[0]:
            if best is not None:
                best[1].close()
            best = (score, conn, address)
        else:
            conn.close()
    if best is None and refused:
        error = LimitError if all(isinstance(exc, LimitError) for _, exc in refused) else AuthFailedError
        raise error(f"no server of {service.upper()!r} let us in: "
                    + "; ".join(f"{host}:{port}: {exc}" for (host, port), exc in refused))
    if best is None:
        raise DiscoveryError(f"every server of {service.upper()!r} the registry knows is down: {'; '.join(down)}")
    return Connection(best[1], best[2], functools.partial(channel.connect, *best[2], CLIENT_CONFIG, secret,
                                                          tls_context))


def job(ref: str, service: str | None = None, *, host: str | None = None, port: int | None = None,
        registry_address: str | None = None, secret_file: str | None = None, tls_cert: str | None = None,
        tls_key: str | None = None, tls_ca: str | None = None, quiet: bool | None = None) -> Job:
    """Find a job by id, or by name among your jobs, from any process: on the server at host:port, else
    on the servers the registry knows (of `service`, if given). An id is unique everywhere: the first
    server that knows it answers. A name is asked of every server, since each host keeps its own
    jobs: your unfinished job of that name wins, else your latest one of that name on any host.
    Credentials, the registry and `quiet` come as for rpycdl.connect.

    Raises:
        InvalidRequestError: no server reached knows the job (the message names those not reached), or
            you have unfinished jobs of that name on several hosts (the message names them: use the id).
    """
    settings = credentials.resolve(secret_file=secret_file, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
                                   registry=registry_address)
    secret, tls_context = settings.secret(), settings.tls_context()
    addresses = [(host, port or SERVER_PORT)] if host else server_addresses(service, settings.registry)
    unreached: list[str] = []
    found: dict[str, tuple[dict[str, Any], Connection]] = {}  # by job id: servers of one host share their jobs
    try:
        for address in addresses:
            try:
                connection = connect_to(address, secret, tls_context, quiet)
            except (OSError, EOFError, AuthFailedError, LimitError) as exc:
                where = f"{address[0]}:{address[1]}"  # said once: a failure to connect names it already
                unreached.append(f"{where}: {str(exc).removeprefix(f'cannot reach the server at {where}: ')}")
                continue
            try:
                row = codec.decode_outcome(connection.call("job", ref))
            except InvalidRequestError:  # this host does not know it
                connection.close()
                continue
            except BaseException:
                connection.close()
                raise
            if row["job_id"] in found:
                connection.close()
                continue
            found[row["job_id"]] = (row, connection)
            if row["job_id"] == ref:
                break
        if not found:
            unasked = f"; could not ask {', '.join(unreached)}" if unreached else ""
            raise InvalidRequestError(f"no server knows job {ref!r}{unasked}")
        row, connection = found.pop(_choose(ref, {job_id: row for job_id, (row, _) in found.items()}))
        return Job(row, connection)
    finally:
        for _, other in found.values():
            other.close()


def _choose(ref: str, rows: dict[str, dict[str, Any]]) -> str:
    """The id of the job `ref` names among the rows the servers answered (by job id): the job whose id
    it is, else the unfinished one of that name, else the latest submitted."""
    if ref in rows:
        return ref
    live = [row for row in rows.values() if not JobState(row["state"]).finished]
    if len(live) > 1:
        raise InvalidRequestError(f"you have unfinished jobs named {ref!r} on several hosts: "
                                  + ", ".join(f"{row['job_id']} on {row['server']}" for row in live)
                                  + ": give the job's id instead")
    return (live or sorted(rows.values(), key=lambda row: row["submitted"]))[-1]["job_id"]
