"""`rpycdl.connect(...)`: credentials, discovery through the registry, and choosing the server most
likely to run a job soonest; or a server named directly. `rpycdl.job(ref)`: the server that knows a job.
`ask_servers`: many servers asked at once, none of them able to stall the others."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import rpyc

from rpycdl import registry
from rpycdl.client import channel, credentials
from rpycdl.client.arrays import ArrayJob
from rpycdl.client.connection import CLIENT_CONFIG, Connection, call
from rpycdl.client.jobs import Job
from rpycdl.defaults import CONNECT_TIMEOUT, HANDSHAKE_TIMEOUT, SERVER_PORT
from rpycdl.errors import (
    AuthFailedError,
    DiscoveryError,
    InvalidRequestError,
    LimitError,
    RpycdlError,
    connection_failed,
)
from rpycdl.states import JobState
from rpycdl.wire import codec

Address = tuple[str, int]
T = TypeVar("T")

ASK_SETTLE = 0.75
"""Seconds a client asking many servers at once (connect by service, rpycdl.job, `rpycdl status`) waits for
every one of them: after that, a server still connecting is given up once another has connected (see
ask_servers), so that listeners that accept and never speak cost at most this much in all."""
ASK_LIMIT = CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT
"""Seconds a server that has not connected yet is waited for at most, while no other has either."""
ASK_PATIENCE = 3.0
"""How many times as long as the slowest server that connected took, a client asking every server (connect by
service, for the one most likely to run its job soonest; rpycdl.job by name, `rpycdl status`, `rpycdl jobs`)
waits for the others past ASK_SETTLE: room for a loaded server slower than the rest, which a connect would
otherwise pass over for a busier one."""

_log = logging.getLogger(__name__)


def connect(service: str | None = None, *, host: str | None = None, port: int | None = None,
            registry_address: str | None = None, secret_file: str | None = None, tls_cert: str | None = None,
            tls_key: str | None = None, tls_ca: str | None = None, quiet: bool | None = None) -> Connection:
    """Connect to a server of `service` found through the registry, or to host:port directly.

    Among the live servers of the service, the one with the most free GPUs and the shortest
    queue is chosen. They are asked all at once: those that answered within ASK_SETTLE (about a
    second) if any did, else the first to answer; a listener that never answers costs no more than
    that, and a server that fails authentication (a certificate the team's CA did not sign) is
    skipped with a warning in the log (logger rpycdl.client.discovery).

    Each credential and the registry come from the argument, else its environment variable
    ($RPYCDL_SECRET_FILE, $RPYCDL_TLS_CERT, $RPYCDL_TLS_KEY, $RPYCDL_TLS_CA, $RPYCDL_REGISTRY), else the
    credentials file (rpycdl.credentials). With credentials, a client talks only to servers that prove
    themselves (the team's CA signed their certificate for the address dialled, or they know the secret);
    without, only to servers without authentication.

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
               quiet: bool | None = None, attempt: channel.Attempt | None = None) -> Connection:
    """Connect to the server at `address` with credentials already loaded (connect() loads them;
    a command talking to many servers loads them once). `attempt`: the first connection's, which
    another thread may give up on (ask_servers does).

    Raises:
        ConnectionFailedError, AuthFailedError, LimitError: as for connect(host=...).
    """
    reopen = functools.partial(channel.connect, *address, CLIENT_CONFIG, secret, tls_context)
    return Connection(reopen(attempt=attempt), address, reopen, quiet=quiet)


def ask_servers(addresses: Sequence[Address], ask: Callable[[Address, channel.Attempt], T],
                discard: Callable[[T], None] | None = None, *, patience: float = 1.0, settle: float = ASK_SETTLE,
                limit: float = ASK_LIMIT) -> Iterator[tuple[Address, T | BaseException]]:
    """Ask every server at once: `ask(address, attempt)` runs in a thread of its own for each address, and
    connects through `attempt` (connect_to's, channel.connect's). Yields each address with its answer, or the
    exception its ask raised, as they come.

    No server can stall the others: after `settle` seconds, a server that is still connecting is given up
    once another has connected and `patience` times as long as the last one took to connect has passed
    (1: at once; more: some room for a loaded server slower than the others); one still connecting after
    `limit` seconds is given up too. Each one given up is yielded last, with a ConnectionFailedError (also a
    TimeoutError) saying so. A server that has connected is waited for, as a call on a connection is.
    Closing the iterator early gives up on the servers not yielded yet; `discard` is called on each answer
    that comes after that (to close a connection it holds).
    """
    asking = _Asking(discard)
    for address in dict.fromkeys(addresses):
        asking.start(address, ask)
    try:
        yield from asking.answers(patience, settle, limit)
    finally:
        asking.stop()


class _Asking:
    """The state ask_servers shares with the threads that ask: what is still awaited, and the answers."""

    def __init__(self, discard: Callable[[Any], None] | None) -> None:
        self._discard = discard
        self._lock = threading.Lock()
        self._events: queue.SimpleQueue[tuple[Address, bool, Any, bool]] = queue.SimpleQueue()
        self._attempts: dict[Address, channel.Attempt] = {}  # those still awaited

    def start(self, address: Address, ask: Callable[[Address, channel.Attempt], Any]) -> None:
        attempt = channel.Attempt(lambda: self._events.put((address, False, None, False)))
        self._attempts[address] = attempt
        threading.Thread(target=self._run, args=(address, attempt, ask), daemon=True,
                         name=f"rpycdl-ask-{address[0]}:{address[1]}").start()

    def _run(self, address: Address, attempt: channel.Attempt, ask: Callable[[Address, channel.Attempt], Any]) -> None:
        try:
            answer, failed = ask(address, attempt), False
        except BaseException as exc:  # noqa: BLE001 - handed to the iterator, which raises what it must
            answer, failed = exc, True
        with self._lock:
            if self._attempts.get(address) is attempt:
                self._events.put((address, True, answer, failed))
                return
        if not failed and self._discard is not None:
            self._discard(answer)

    def answers(self, patience: float, settle: float, limit: float) -> Iterator[tuple[Address, Any]]:
        start, last_connect, cut = time.monotonic(), None, False
        while self._attempts:
            wait = None
            if not cut:
                until = limit if last_connect is None else min(limit, max(settle, patience * last_connect))
                wait = max(0.0, start + until - time.monotonic())
            try:
                address, finished, answer, failed = self._events.get(timeout=wait)
            except queue.Empty:
                cut = True
                yield from self._give_up(time.monotonic() - start)
                continue
            if not finished:  # connected
                last_connect = max(last_connect or 0.0, time.monotonic() - start)
            if finished and self._take(address):
                yield address, answer
            elif finished and not failed and self._discard is not None:
                self._discard(answer)

    def _take(self, address: Address) -> bool:
        with self._lock:
            return self._attempts.pop(address, None) is not None

    def _give_up(self, waited: float) -> Iterator[tuple[Address, Any]]:
        """Give up on every server still connecting."""
        for address, attempt in list(self._attempts.items()):
            if attempt.abort() and self._take(address):
                where = f"{address[0]}:{address[1]}"
                yield address, connection_failed(f"the server at {where} did not answer within {waited:.1f} s",
                                                 address, TimeoutError)

    def stop(self) -> None:
        """Give up on every server not yielded yet, and discard the answers that came meanwhile."""
        with self._lock:
            attempts, self._attempts = self._attempts, {}
        for attempt in attempts.values():
            attempt.abort()
        while True:
            try:
                _, finished, answer, failed = self._events.get_nowait()
            except queue.Empty:
                return
            if finished and not failed and self._discard is not None:
                self._discard(answer)


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
    """Connect to the best live server of `service` that passes authentication, all of them asked at once."""
    addresses = registry.discover(service, registry_address)  # DiscoveryError if no registry answers
    if not addresses:
        where = registry.describe(registry.registry_address(registry_address))
        raise DiscoveryError(f"the registry ({where}) knows no server of {service.upper()!r}: start one "
                             "(rpycdl serve --service NAME --registry HOST), or check the name (rpycdl status "
                             "lists every server the registry knows)")
    order = {address: index for index, address in enumerate(addresses)}  # equal loads: the first listed
    best: tuple[tuple[int, int, int], rpyc.Connection, Address] | None = None
    refused: list[tuple[Address, AuthFailedError | LimitError]] = []
    down: list[str] = []
    probe = functools.partial(_probe, secret=secret, tls_context=tls_context)
    try:
        with contextlib.closing(ask_servers(addresses, probe, _close_probe, patience=ASK_PATIENCE)) as answers:
            for address, answer in answers:
                if isinstance(answer, (AuthFailedError, LimitError)):  # a server that cannot prove itself gets nothing
                    _log.warning("skipped the server at %s:%d: %s", *address, answer)
                    refused.append((address, answer))
                elif isinstance(answer, (OSError, EOFError)):
                    _log.info("skipped the server at %s:%d: %s", *address, answer)
                    down.append(str(answer))
                elif isinstance(answer, BaseException):
                    raise answer
                else:
                    conn, (free, waiting) = answer
                    score = (-free, waiting, order[address])
                    if best is not None and best[0] < score:
                        conn.close()
                        continue
                    if best is not None:
                        best[1].close()
                    best = (score, conn, address)
    except BaseException:
        if best is not None:
            best[1].close()
        raise
    if best is None:
        raise _none_of(service, refused, down)
    return Connection(best[1], best[2], functools.partial(channel.connect, *best[2], CLIENT_CONFIG, secret,
                                                          tls_context))


def _probe(address: Address, attempt: channel.Attempt, secret: bytes | None,
           tls_context: ssl.SSLContext | None) -> tuple[rpyc.Connection, tuple[int, int]]:
    """A connection to the server at `address` and its load: free GPUs, waiting requests."""
    conn = channel.connect(*address, CLIENT_CONFIG, secret, tls_context, attempt=attempt)
    try:
        with channel.reported(address, "calling load"):
            free, waiting, _ = call(conn, "load")
    except BaseException:
        conn.close()
        raise
    return conn, (free, waiting)


def _close_probe(answer: tuple[rpyc.Connection, tuple[int, int]]) -> None:
    answer[0].close()


def _none_of(service: str, refused: list[tuple[Address, AuthFailedError | LimitError]],
             down: list[str]) -> RpycdlError:
    """Why no server of `service` could be used: each refused us (LimitError if every one for its limits,
    else AuthFailedError), or none was up (DiscoveryError)."""
    if refused:
        error = LimitError if all(isinstance(exc, LimitError) for _, exc in refused) else AuthFailedError
        return error(f"no server of {service.upper()!r} let us in: "
                     + "; ".join(f"{host}:{port}: {exc}" for (host, port), exc in refused))
    return DiscoveryError(f"every server of {service.upper()!r} the registry knows is down: {'; '.join(down)}")


def job(ref: str, service: str | None = None, *, host: str | None = None, port: int | None = None,
        registry_address: str | None = None, secret_file: str | None = None, tls_cert: str | None = None,
        tls_key: str | None = None, tls_ca: str | None = None, quiet: bool | None = None) -> Job | ArrayJob:
    """Find a job by id, or by name among your jobs, from any process: on the server at host:port, else
    on the servers the registry knows (of `service`, if given), all asked at once (ask_servers, with
    ASK_PATIENCE). An id is unique everywhere: the first server that knows it answers. A name needs every
    server's answer, since each host keeps its own jobs: your unfinished job of that name wins, else your
    latest one of that name on any host.
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
    lookup = functools.partial(_look_up, ref=ref, secret=secret, tls_context=tls_context, quiet=quiet)
    try:
        with contextlib.closing(ask_servers(addresses, lookup, _close_found, patience=ASK_PATIENCE)) as answers:
            for address, answer in answers:
                if isinstance(answer, (OSError, EOFError, AuthFailedError, LimitError)):
                    where = f"{address[0]}:{address[1]}"  # said once: a failure to connect names it already
                    unreached.append(f"{where}: {str(answer).removeprefix(f'cannot reach the server at {where}: ')}")
                elif isinstance(answer, BaseException):
                    raise answer
                elif answer is not None and answer[0]["job_id"] in found:
                    answer[1].close()
                elif answer is not None:
                    found[answer[0]["job_id"]] = answer
                    if answer[0]["job_id"] == ref:
                        break
        if not found:
            unasked = f"; could not ask {', '.join(unreached)}" if unreached else ""
            raise InvalidRequestError(f"no server knows job {ref!r}{unasked}")
        row, connection = found.pop(_choose(ref, {job_id: row for job_id, (row, _) in found.items()}))
        return ArrayJob(row, connection) if row.get("is_array") else Job(row, connection)
    finally:
        for _, other in found.values():
            other.close()


def _look_up(address: Address, attempt: channel.Attempt, ref: str, secret: bytes | None,
             tls_context: ssl.SSLContext | None, quiet: bool | None) -> tuple[dict[str, Any], Connection] | None:
    """Job `ref`'s row on the server at `address`, with a connection to it; None if that server does not know it."""
    connection = connect_to(address, secret, tls_context, quiet, attempt)
    try:
        return codec.decode_outcome(connection.call("job", ref)), connection
    except InvalidRequestError:  # this host knows no job of that id or name: an array, maybe
        try:
            array = codec.decode_outcome(connection.call("array", ref))
            state = JobState.PENDING if array["counts"]["unfinished"] else JobState.SUCCEEDED  # for _choose alone
            return {**array, "job_id": array["array_id"], "state": state.value, "is_array": True}, connection
        except (InvalidRequestError, AttributeError):  # nor an array (or it predates arrays)
            connection.close()
            return None
    except BaseException:
        connection.close()
        raise


def _close_found(answer: tuple[dict[str, Any], Connection] | None) -> None:
    if answer is not None:
        answer[1].close()


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
