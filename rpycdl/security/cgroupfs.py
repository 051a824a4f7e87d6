"""The cgroup file systems as this process sees them: where they are mounted, its own cgroup in each, and (cgroup
v2) handing controllers down to the cgroups made under its own (rpycdl.security.cgroups makes jobs' cgroups there)."""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterable
from pathlib import Path

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "devices")
V2_CONTROLLERS = ("memory", "pids", "cpu")

log = logging.getLogger("rpycdl.cgroups")

LEAF = "rpycdl-leaf"
"""cgroup v2: where the processes of the server's own cgroup go when it must hand its controllers down to the jobs'
cgroups, which the kernel allows a cgroup other than the root only once it has no processes of its own (all of
them move, as systemd's DelegateSubgroup= and docker-in-docker do); that cgroup stays the server's own."""


def mounts() -> Iterable[tuple[str, str, set[str]]]:
    """The cgroup mounts of this process's mount namespace: (mount point, type, super options)."""
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            dash = fields.index("-")
            kind = fields[dash + 1]
            if kind in ("cgroup", "cgroup2"):
                yield fields[4], kind, set(fields[dash + 3].split(","))


def own_paths() -> dict[str, str]:
    """This process's cgroup in each hierarchy: v1 by controller, v2 by ""."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as lines:
        for line in lines:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    return own


def v2_controllers(where: Path) -> list[str]:
    """Those of V2_CONTROLLERS that the cgroups made in `where` (a v2 directory) have."""
    try:
        enabled = (where.parent / "cgroup.subtree_control").read_text().split()
    except OSError:
        return []
    return [c for c in V2_CONTROLLERS if c in enabled]


def layout() -> tuple[dict[str, Path], Path | None]:
    """This process's own cgroup in each v1 hierarchy of V1_CONTROLLERS (by controller), and in the v2 one (or None).

    Raises:
        OSError, ValueError: /proc unreadable.
    """
    own, found = own_paths(), list(mounts())
    v1 = {c: Path(point) / own.get(c, "/").lstrip("/") for point, kind, options in found if kind == "cgroup"
          for c in V1_CONTROLLERS if c in options}
    unified = next((Path(point) / own.get("", "/").lstrip("/") for point, kind, _ in found if kind == "cgroup2"),
                   None)
    return v1, unified.parent if unified is not None and unified.name == LEAF else unified


def delegate(own: Path, controllers: list[str]) -> None:
    """Enable `controllers` for the children of `own` (v2); should it hold processes, move them into own/LEAF first.

    Raises:
        OSError: the kernel refused.
    """
    enable = " ".join(f"+{c}" for c in controllers)
    try:
        (own / "cgroup.subtree_control").write_text(enable)
        return
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
    (own / LEAF).mkdir(mode=0o755, exist_ok=True)
    moved = 0
    while pids := (own / "cgroup.procs").read_text().split():  # a process forks meanwhile: its child follows
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                (own / LEAF / "cgroup.procs").write_text(pid)
                moved += 1
    (own / "cgroup.subtree_control").write_text(enable)
    log.warning("moved the %d processes of %s into %s to hand %s down to jobs' cgroups", moved, own, LEAF, enable)
