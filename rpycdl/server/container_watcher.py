"""A job container's watcher, `python -m rpycdl.server.container_watcher OWNER_PID CONTAINER_ID`,
in a session of its own: it removes the container once the process running its job has died: the
connection process of an attached job, the supervisor of a detached one (rpycdl.server.supervisor),
never the connection process that accepted a submission, which leaves at once. The owner kills the
watcher when it removes the container itself."""

from __future__ import annotations

import contextlib
import os
import select
import sys


def watch(owner_pid: int, container_id: str) -> None:
    """Remove the job container `container_id` once the process `owner_pid` has died."""
    with contextlib.suppress(ProcessLookupError):
        pidfd = os.pidfd_open(owner_pid)
        select.select([pidfd], [], [])
    import docker.errors  # only now: the server parent imports this module to recognise watchers

    from rpycdl.site.docker import docker_client, remove

    with contextlib.suppress(docker.errors.NotFound):
        remove(docker_client().containers.get(container_id))


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
