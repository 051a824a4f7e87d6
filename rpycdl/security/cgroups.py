"""A cgroup for each job: its host memory, processes, CPU and GPU device nodes bounded, its usage measured, and
every process it started found and killed however it daemonized.

A root server finds where it may make cgroups once (`detect`): cgroup v1 where the host mounts the controllers
that way (memory, pids, cpu, cpuacct, devices: a directory in each hierarchy), else cgroup v2 (one directory; the
processes of the server's own cgroup move into a leaf of it should it have to hand controllers down:
rpycdl.security.cgroupfs.delegate).
Jobs' cgroups go in `rpycdl/` under the server's own cgroup of each hierarchy, one per job, named after the
job's keeper or supervisor (`job-<pid>-<start time>-<n>`), which makes it before it forks the job process, into
which the job process moves itself at once (`JobCgroup.join`). The job process sets its limits as it is told what
to run, as root, before it becomes its owner (`JobCgroup.limit`), so that the job can change none. The keeper
reads its usage once it has ended, kills whatever is left in it and removes it (`JobCgroup.finish`); a cgroup
whose keeper died is emptied and removed by its requester, or by the next sweep of a server of the same
hierarchy (`Hierarchy.sweep`).

GPU device nodes are fenced by the devices controller on cgroup v1 (it denies the nodes of the GPUs the job was not
granted: NVIDIA's major 195 and each GPU's minor), by a device BPF program on cgroup v2 (rpycdl.security.devices)."""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from rpycdl.scheduler import procs
from rpycdl.security import cgroupfs, devices

JOBS = "rpycdl"
"""The directory of jobs' cgroups under the server's own cgroup."""
CFS_PERIOD = 100_000
"""Microseconds of the CPU bandwidth period a job's `cpus` are a share of."""
_NAME = re.compile(r"job-(\d+)-(\d+)-\d+$")

log = logging.getLogger("rpycdl.cgroups")


@dataclass(frozen=True)
class Limits:
    """What a job's cgroup bounds: host memory in bytes, processes (tasks), CPU cores (a bandwidth share of
    them), and the GPU device nodes (major, minor) it may not open. None: unbounded."""

    memory: int | None = None
    pids: int | None = None
    cpus: float | None = None
    deny: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"memory": self.memory, "pids": self.pids, "cpus": self.cpus, "deny": [list(d) for d in self.deny]}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Limits:
        deny = tuple((int(major), int(minor)) for major, minor in data.get("deny") or ())  # type: ignore[attr-defined]
        return cls(data.get("memory"), data.get("pids"), data.get("cpus"), deny)  # type: ignore[arg-type]


@dataclass
class Usage:
    """What a job's cgroup measured: its peak host memory (bytes), CPU seconds, most processes at once, its
    memory limit, and how often the kernel's OOM killer killed one of its processes for it. None: not known."""

    peak_memory: int | None = None
    cpu_seconds: float | None = None
    max_procs: int | None = None
    memory_limit: int | None = None
    oom_kills: int = 0

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Usage:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})  # type: ignore[arg-type]


@dataclass
class JobCgroup:
    """One job's cgroup: a directory in each hierarchy (v1), or one (v2)."""

    version: int
    dirs: dict[str, Path]  # v1: controller -> directory; v2: "" -> directory
    name: str = ""

    def _dir(self, controller: str) -> Path | None:
        return self.dirs.get("" if self.version == 2 else controller)

    def _write(self, controller: str, name: str, value: str) -> None:
        where = self._dir(controller)
        if where is not None and (where / name).exists():
            (where / name).write_text(value)

    def _read(self, controller: str, name: str) -> str | None:
        where = self._dir(controller)
        try:
            return (where / name).read_text() if where is not None else None
        except OSError:
            return None

    def _number(self, controller: str, name: str, key: str = "") -> int | None:
        """A count the kernel keeps: the file's, or the value of `key`'s line in it; None if not there ("max")."""
        text = self._read(controller, name) or ""
        value = _field(text, key) if key else text.strip()
        return int(value) if value and value.isdigit() else None

    def join(self) -> None:
        """Move this process (all its threads) into the cgroup."""
        for where in {*self.dirs.values()}:
            (where / "cgroup.procs").write_text("0")

    def limit(self, limits: Limits) -> None:
        """Set `limits` (as root: the job, once its owner, can change none)."""
        v2 = self.version == 2
        if limits.memory is not None:
            self._write("memory", "memory.max" if v2 else "memory.limit_in_bytes", str(limits.memory))
            self._write("memory", "memory.swap.max" if v2 else "memory.memsw.limit_in_bytes",
                        "0" if v2 else str(limits.memory))  # its limit is RAM, not RAM then swap
        if limits.pids is not None:
            self._write("pids", "pids.max", str(limits.pids))
        if limits.cpus is not None:
            quota = max(1000, round(limits.cpus * CFS_PERIOD))
            if v2:
                self._write("cpu", "cpu.max", f"{quota} {CFS_PERIOD}")
            else:
                self._write("cpu", "cpu.cfs_period_us", str(CFS_PERIOD))
                self._write("cpu", "cpu.cfs_quota_us", str(quota))
        if v2:
            devices.deny(str(self.dirs[""]), limits.deny)
        else:
            for major, minor in limits.deny:
                self._write("devices", "devices.deny", f"c {major}:{minor} rwm")

    def pids(self) -> set[int]:
        """The processes in it now."""
        found: set[int] = set()
        for where in {*self.dirs.values()}:
            with contextlib.suppress(OSError):
                found.update(int(line) for line in (where / "cgroup.procs").read_text().split())
        return found

    def kill(self, wait: float = 5.0) -> bool:
        """SIGKILL every process in it until none is left (or `wait` seconds passed); whether none is."""
        deadline = time.monotonic() + wait
        while True:
            left = self.pids()
            if not left:
                return True
            if self.version == 2:
                self._write("", "cgroup.kill", "1")
            procs.kill(sorted(left))
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def usage(self) -> Usage:
        """What it measured so far."""
        v2 = self.version == 2
        cpu = self._number("cpu", "cpu.stat", "usage_usec") if v2 else self._number("cpuacct", "cpuacct.usage")
        return Usage(peak_memory=self._number("memory", "memory.peak" if v2 else "memory.max_usage_in_bytes"),
                     cpu_seconds=None if cpu is None else cpu / (1e6 if v2 else 1e9),
                     max_procs=self._number("pids", "pids.peak"),
                     memory_limit=self._number("memory", "memory.max" if v2 else "memory.limit_in_bytes"),
                     oom_kills=self._number("memory", "memory.events" if v2 else "memory.oom_control", "oom_kill") or 0)

    def empty(self) -> Usage:
        """Once its job process has ended: kill what is left in it; what it measured."""
        self.kill()
        return self.usage()

    def finish(self) -> Usage:
        """Once its job process has ended: kill what is left in it, and remove it; what it measured."""
        found = self.empty()
        self.remove()
        return found

    def remove(self) -> None:
        """Kill what is left in it and remove its directories."""
        self.kill()
        for where in {*self.dirs.values()}:
            with contextlib.suppress(FileNotFoundError):
                _rmdir(where)


def _field(text: str, name: str) -> str | None:
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return value.strip()
    return None


def _rmdir(where: Path, wait: float = 2.0) -> None:
    """rmdir a cgroup, which the kernel refuses (EBUSY) while an exited process's last references go."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.rmdir(where)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@dataclass(frozen=True)
class Hierarchy:
    """Where this server makes its jobs' cgroups: `version` 1 or 2, and the directory of jobs' cgroups in each
    hierarchy (v1: by controller; v2: "")."""

    version: int
    bases: dict[str, Path]

    def describe(self) -> str:
        """What it fences, in words: `cgroup v1 (memory, pids, cpu, devices)`."""
        if self.version == 1:
            return f"cgroup v1 ({', '.join(c for c in self.bases if c != 'cpuacct')})"
        controllers = cgroupfs.v2_controllers(self.bases[""])
        return f"cgroup v2 ({', '.join([*controllers, 'devices'])})"

    def create(self, name: str) -> JobCgroup:
        """A new job's cgroup named `name` (job-<keeper pid>-<keeper start>-<n>)."""
        made = JobCgroup(self.version, {}, name)
        try:
            for controller, base in self.bases.items():  # cpu and cpuacct may share one hierarchy
                where = base / name
                if where not in made.dirs.values():
                    where.mkdir(mode=0o755)
                made.dirs[controller] = where
        except BaseException:
            made.remove()
            raise
        return made

    def job(self, name: str) -> JobCgroup:
        """The job's cgroup named `name`, made before (by its keeper or supervisor)."""
        return JobCgroup(self.version, {c: b / name for c, b in self.bases.items() if (b / name).is_dir()}, name)

    def stale(self) -> list[str]:
        """The names of the jobs' cgroups whose keeper (or supervisor) is gone, sorted."""
        names = {entry.name for base in self.bases.values() if base.is_dir() for entry in base.iterdir()
                 if entry.is_dir() and _NAME.match(entry.name)}
        return sorted(name for name in names if procs.identify((keeper := keeper_of(name))[0]) != keeper)

    def sweep(self) -> int:
        """Remove the cgroups of jobs whose keeper is gone (killing what they still hold); how many."""
        removed = 0
        for name in self.stale():
            with contextlib.suppress(OSError):
                self.job(name).remove()
                removed += 1
        return removed


def keeper_of(name: str) -> procs.Pid:
    """The keeper (or supervisor) a job's cgroup `name` is named after: its pid and start time."""
    match = _NAME.match(name)
    assert match is not None
    return int(match.group(1)), int(match.group(2))


def detect() -> Hierarchy | str:
    """Where this process may make jobs' cgroups (their `rpycdl/` directories made here), or why it may not."""
    if os.geteuid() != 0:
        return "not root"
    try:
        v1, unified = cgroupfs.layout()
    except (OSError, ValueError) as exc:
        return f"cgroups unreadable ({exc})"
    try:
        if "memory" in v1 and "pids" in v1:
            bases = {c: mine / JOBS for c, mine in v1.items()}
            for base in bases.values():
                base.mkdir(mode=0o755, exist_ok=True)
            return Hierarchy(1, bases)
        if unified is None:
            return "no cgroup hierarchy mounted"
        base = unified / JOBS
        base.mkdir(mode=0o755, exist_ok=True)
        available = (unified / "cgroup.controllers").read_text().split()
        wanted = [c for c in cgroupfs.V2_CONTROLLERS if c in available]
        if wanted:
            try:
                cgroupfs.delegate(unified, wanted)
                cgroupfs.delegate(base, wanted)
            except OSError as exc:  # fenced by what is left (describe() says what)
                log.warning("cgroup v2 controllers %s could not be handed down to jobs: %s", wanted, exc)
        return Hierarchy(2, {"": base})
    except OSError as exc:
        return f"cannot make cgroups ({exc.strerror})"


def own() -> JobCgroup | None:
    """The cgroup of the job this process belongs to (as a job process or what it started sees it: its files are
    readable by all), or None outside a job's."""
    try:
        v1, unified = cgroupfs.layout()
    except (OSError, ValueError):
        return None
    jobs = {c: where for c, where in v1.items() if where.parent.name == JOBS and _NAME.match(where.name)}
    if "memory" in jobs:
        return JobCgroup(1, jobs, jobs["memory"].name)
    if unified is None or unified.parent.name != JOBS or not _NAME.match(unified.name):
        return None
    return JobCgroup(2, {"": unified}, unified.name)


NO_FENCE = "--no-fence"
"""The server's option that turns fencing off; its forkserver and supervisors are told so by it, on their command
line."""
_off = ""


def turn_off(why: str) -> None:
    """Fence no job of this process, nor of those it forks after (the server's --no-fence): `why`."""
    global _off
    _off = why


def turned_off() -> str:
    """Why this process fences no job although it might (turn_off), or ""."""
    return _off


def hierarchy() -> Hierarchy | str:
    """Where this process makes jobs' cgroups (`detect()`, found once: a process forked after keeps the answer), or
    why it makes none."""
    return _off or _detected()


@functools.cache
def _detected() -> Hierarchy | str:
    return detect()


_made = itertools.count()


def for_job() -> JobCgroup | None:
    """A new cgroup for a job process this process is about to fork (named after this process, which removes it
    once the job process has ended: JobCgroup.finish); None where this server does not fence, or it could not be
    made (logged: the job runs unfenced)."""
    found = hierarchy()
    if isinstance(found, str):
        return None
    me = procs.myself()
    try:
        return found.create(f"job-{me[0]}-{me[1]}-{next(_made)}")
    except OSError as exc:
        log.warning("a job's cgroup could not be made, it runs unfenced: %s", exc)
        return None


def finish(name: str) -> Usage | None:
    """Kill what is left in the cgroup `name` (its keeper died), and remove it; what it measured."""
    found = hierarchy()
    if isinstance(found, str) or not _NAME.match(name):
        return None
    try:
        return found.job(name).finish()
    except OSError as exc:
        log.warning("the cgroup of a job whose keeper died could not be removed: %s", exc)
        return None


def fencing(private_tmp: bool) -> str:
    """How this server fences its jobs, in words: `cgroup v1 (memory, pids, cpu, devices), private /tmp`, or
    `none (not root)`."""
    found = hierarchy()
    if isinstance(found, str):
        return f"none ({found})"
    return found.describe() + (", private /tmp" if private_tmp else "")


def mark() -> str:
    """How this server fences its jobs, as a file name for its lock directory's marks: cgroup-v1, cgroup-v2, none."""
    found = hierarchy()
    return "none" if isinstance(found, str) else f"cgroup-v{found.version}"


def sweep() -> int:
    """Remove the cgroups of this server's hierarchy whose keeper or supervisor is gone; how many."""
    found = hierarchy()
    return 0 if isinstance(found, str) else found.sweep()
