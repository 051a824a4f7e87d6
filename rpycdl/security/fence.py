"""What a job process enters as it is told what to run, as root, before it becomes its owner, where its server
fences jobs: its cgroup's limits (rpycdl.security.cgroups) and its private /tmp (rpycdl.security.privatetmp).
Chosen by the server (rpycdl.server.fencing), sent in the job's Go (rpycdl.server.child)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rpycdl.security import cgroups, privatetmp


@dataclass(frozen=True)
class Fence:
    """How a job is fenced: its cgroup's limits, and the size of its private /tmp and /dev/shm (0: the host's)."""

    limits: cgroups.Limits
    tmp: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"limits": self.limits.to_dict(), "tmp": self.tmp}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fence:
        return cls(cgroups.Limits.from_dict(data["limits"]), int(data.get("tmp") or 0))

    def enter(self, cgroup: cgroups.JobCgroup | None, env: dict[str, str]) -> None:
        """In the job process, as root, before it becomes its owner: its cgroup's limits set, its /tmp its own."""
        if cgroup is None:  # its keeper could not make it (logged): the job does not run unfenced
            raise RuntimeError("rpycdl: this job could not be fenced (its cgroup could not be made: the server's log "
                               "says why); try again, or ask the server's operator")
        cgroup.limit(self.limits)
        if self.tmp:
            privatetmp.enter(self.tmp, privatetmp.wanted(env))
