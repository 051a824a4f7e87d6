"""A job container's watcher, `python -m rpycdl.server.container_watcher CONNECTION_PID CONTAINER_ID`,
in a session of its own: it removes the container once the connection process running its job has
died (the connection process kills the watcher when it removes the container itself)."""

from __future__ import annotations

import contextlib
import os
import select
import sys


def watch(connection_pid: int, container_id: str) -> None:
    """Remove the job container `container_id` once the process `connection_pid` has died."""
    with contextlib.suppress(ProcessLookupError):
        pidfd = os.pidfd_open(connection_pid)
        select.select([pidfd], [], [])
    import docker.errors  # only now: the server parent imports this module to recognise watchers

    from rpycdl.site.docker import docker_client, remove

    with contextlib.suppress(docker.errors.NotFound):
        remove(docker_client().containers.get(container_id))


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
