"""Starting the RPyC registry, and asking it which servers offer a service."""

from __future__ import annotations

import logging
import os

from rpyc.utils.registry import UDPRegistryClient, UDPRegistryServer

from rpycdl.defaults import DISCOVERY_TIMEOUT, ENV_REGISTRY, REGISTRY_PORT, REGISTRY_PRUNING_TIMEOUT
from rpycdl.errors import InvalidRequestError

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
    print(f"rpycdl registry listening on udp {host}:{server.sock.getsockname()[1]}", flush=True)
    try:
        server.start()  # returns on KeyboardInterrupt (the CLI turns SIGTERM into one)
    finally:
        server.sock.close()


def list_services(text: str | None = None) -> tuple[str, ...]:
    """Names the registry knows (upper case)."""
    return tuple(registry_client(text).list() or ())


def discover(name: str, text: str | None = None) -> tuple[tuple[str, int], ...]:
    """(host, port) of every server registered under `name`."""
    return tuple(tuple(addr) for addr in registry_client(text).discover(name.upper()))  # type: ignore[misc]
