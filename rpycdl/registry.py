"""Starting the RPyC registry, and asking it which servers offer a service."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from rpyc.core import brine
from rpyc.utils.registry import MAX_DGRAM_SIZE, UDPRegistryClient, UDPRegistryServer

from rpycdl.defaults import DISCOVERY_TIMEOUT, ENV_REGISTRY, REGISTRY_PORT, REGISTRY_PRUNING_TIMEOUT
from rpycdl.errors import DiscoveryError, InvalidRequestError

BROADCAST = "255.255.255.255"


def parse_address(text: str | None, default_port: int = REGISTRY_PORT) -> tuple[str, int]:
    """Parse 'host', 'host:port' or ':port'; None or '' means broadcast on the default port."""
    if not text:
        return BROADCAST, default_port
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not port:
        return host or BROADCAST, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequestError(f"bad address {text!r}: use HOST or HOST:PORT")
    return host or BROADCAST, int(port)


def registry_address(text: str | None = None) -> tuple[str, int]:
    """The registry to use: `text`, else $RPYCDL_REGISTRY, else broadcast on port 18811."""
    return parse_address(text or os.environ.get(ENV_REGISTRY))


def describe(address: tuple[str, int]) -> str:
    """A registry's address in words: 'udp 10.0.0.2:18811', or the broadcast on its port."""
    host, port = address
    return f"the UDP broadcast on port {port}" if _is_broadcast(host) else f"udp {host}:{port}"


def resolve(text: str | None = None) -> tuple[str, int]:
    """The registry's address (see registry_address), its host name checked now.

    Raises:
        DiscoveryError: the host name does not resolve.
    """
    address = registry_address(text)
    if not _is_broadcast(address[0]):
        try:
            socket.getaddrinfo(address[0], address[1], socket.AF_INET, socket.SOCK_DGRAM)
        except socket.gaierror as exc:
            raise _unresolved(address[0], exc) from None
    return address


def registry_client(text: str | None = None, timeout: float = DISCOVERY_TIMEOUT) -> UDPRegistryClient:
    """An RPyC registry client for `text` (see registry_address)."""
    host, port = registry_address(text)
    return UDPRegistryClient(ip=host, port=port, timeout=timeout)


def serve_registry(host: str = "0.0.0.0", port: int = REGISTRY_PORT,
                   pruning_timeout: float = REGISTRY_PRUNING_TIMEOUT) -> None:
    """Run an RPyC UDP registry in the foreground (listing allowed, for `rpycdl status`)."""
    logger = logging.getLogger("rpycdl.registry")
    server = UDPRegistryServer(host=host, port=port, pruning_timeout=pruning_timeout, logger=logger,
                               allow_listing=True)
    logger.addFilter(lambda record: record.getMessage() != "User interrupt!")  # the usual way to stop it
    print(f"rpycdl registry listening on udp {host}:{server.sock.getsockname()[1]}", flush=True)
    try:
        server.start()  # returns on KeyboardInterrupt (the CLI turns SIGTERM into one), its socket closed
    finally:
        if server.sock is not None:
            server.sock.close()


def list_services(text: str | None = None, timeout: float = DISCOVERY_TIMEOUT) -> tuple[str, ...]:
    """Names the registry knows (upper case).

    Raises:
        DiscoveryError: no registry answered, or its host name does not resolve.
    """
    return tuple(_ask(text, "LIST", ((None,),), timeout) or ())


def discover(name: str, text: str | None = None, timeout: float = DISCOVERY_TIMEOUT) -> tuple[tuple[str, int], ...]:
    """(host, port) of every server registered under `name`; empty if the registry knows none.

    Raises:
        DiscoveryError: no registry answered, or its host name does not resolve.
    """
    return tuple((str(host), int(port)) for host, port in _ask(text, "QUERY", (name.upper(),), timeout) or ())


def _ask(text: str | None, command: str, args: tuple[Any, ...], timeout: float) -> Any:
    """One request to the registry and its answer, as RPyC's UDPRegistryClient asks, except that
    silence and a bad host are errors here rather than an empty answer."""
    address = registry_address(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        if _is_broadcast(address[0]):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, True)
        sock.settimeout(timeout)
        try:
            sock.sendto(brine.dump(("RPYC", command, args)), address)
            data, _ = sock.recvfrom(MAX_DGRAM_SIZE * 10)
        except socket.gaierror as exc:
            raise _unresolved(address[0], exc) from None
        except OSError as exc:  # a timeout, or refused: nothing listens there
            why = f"within {timeout:g} s" if isinstance(exc, TimeoutError) else f"({exc.strerror})"
            where = describe(address) if _is_broadcast(address[0]) else f"at {describe(address)}"
            raise DiscoveryError(
                f"no registry answered {where} {why}; it may not be running. Start one with `rpycdl registry`, "
                f"name the right one (--registry HOST[:PORT], registry_address=, ${ENV_REGISTRY}), or reach a "
                "server directly (--host, or rpycdl.connect(host=...))") from None
    try:
        return brine.load(data)
    except Exception:  # noqa: BLE001 - whatever answered is no RPyC registry
        raise DiscoveryError(f"something at {describe(address)} answered, but not as an RPyC registry") from None


def _unresolved(host: str, exc: socket.gaierror) -> DiscoveryError:
    return DiscoveryError(f"cannot find the registry's host {host!r} ({exc.strerror}): check the registry address "
                          f"(--registry, registry_address=, ${ENV_REGISTRY} or the credentials file)")


def _is_broadcast(host: str) -> bool:
    return "255" in host.split(".")  # RPyC's own rule
