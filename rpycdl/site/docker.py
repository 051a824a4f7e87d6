"""Docker through its SDK, as both sides use it: the engine client, rpycdl's container labels,
listing and removing containers. Everything goes through argument lists: no shell string is
ever built. Every container rpycdl starts carries the label `rpycdl.role` (registry, server or
job)."""

from __future__ import annotations

import contextlib

import docker
import docker.errors
from docker.models.containers import Container

from rpycdl.errors import RpycdlError

LABEL_ROLE = "rpycdl.role"
LABEL_OWNER = "rpycdl.owner"
LABEL_JOB = "rpycdl.job"
LABEL_LOCK_DIR = "rpycdl.lock-dir"
LABEL_UP = "rpycdl.up"  # the `up` call that started a service container


def docker_client() -> docker.DockerClient:
    """A client of the local Docker engine ($DOCKER_HOST, else the default socket).

    Raises:
        RpycdlError: the engine cannot be reached.
    """
    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        raise RpycdlError(f"cannot reach the Docker engine: {exc}") from None
    return client


def listed(client: docker.DockerClient, *labels: str) -> list[Container]:
    """Containers with all these labels, from the list alone (one may vanish before an inspect)."""
    return client.containers.list(all=True, sparse=True, filters={"label": list(labels)})


def remove(container: Container) -> None:
    """Remove a container, running or not; one already gone is fine."""
    with contextlib.suppress(docker.errors.NotFound):
        container.remove(force=True)
