"""What one server's connections share: its limits, GPUs, lock manager, job ledger, job files and working
directories' cache, built once in the server parent before any fork (rpycdl.server), read by every
connection (rpycdl.service); a detached job's supervisor builds the same from its spec."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from rpycdl.artifacts.store import ArtifactStore
from rpycdl.artifacts.workdircache import WorkdirCache
from rpycdl.defaults import (
    DRAIN_TIMEOUT,
    FRAME_MEMORY_SHARE,
    FRAME_SLACK,
    IDLE_TIMEOUT,
    JOB_PIDS,
    KEEP,
    MAX_CONNECTIONS,
    MAX_FRAME_CEILING,
    MAX_LOG,
    MAX_OUTPUT,
    MAX_PAYLOAD,
    MAX_QUEUED,
    MAX_QUEUED_PER_USER,
    MAX_RESULT,
    MAX_STARTUPS,
    MAX_WORKING_DIR,
    PER_SOURCE_STARTUPS,
    WORKING_DIR_CACHE,
)
from rpycdl.gpu.inventory import GPU, Inventory
from rpycdl.scheduler import lockdir, procs
from rpycdl.scheduler.jobfiles import JobFiles
from rpycdl.scheduler.ledger import Ledger
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.scheduler.policies import Scheduling
from rpycdl.scheduler.shares import ShareRules
from rpycdl.security import cgroups
from rpycdl.security.accounts import Accounts
from rpycdl.server import orphans, runner


@dataclass(frozen=True)
class Limits:
    """What one server accepts (see rpycdl.defaults); each refusal names the limit's option."""

    max_payload: int = MAX_PAYLOAD
    max_queued: int = MAX_QUEUED
    max_queued_per_user: int = MAX_QUEUED_PER_USER
    max_connections: int = MAX_CONNECTIONS
    idle_timeout: float = IDLE_TIMEOUT
    drain_timeout: float = DRAIN_TIMEOUT
    max_result: int = MAX_RESULT
    max_log: int = MAX_LOG
    max_output: int = MAX_OUTPUT
    keep: float = KEEP
    max_working_dir: int = MAX_WORKING_DIR
    working_dir_cache: int = WORKING_DIR_CACHE
    max_startups: tuple[int, int, int] = MAX_STARTUPS  # LOW, RATE (percent), HIGH
    per_source_startups: int = PER_SOURCE_STARTUPS
    max_frame: int = 0  # 0: default_max_frame(max_payload)
    job_memory: int = 0  # a job's host memory unless it asks (memory=); 0: its GPUs' share of the machine's
    max_job_memory: int = 0  # the most a job may ask for; 0: the machine's memory
    job_pids: int = JOB_PIDS
    job_cpus: float = 0.0  # CPU cores a job may use unless it asks (cpus=); 0: all of them
    job_tmp: int = -1  # bytes of a job's private /tmp and /dev/shm; 0: as its memory; -1: none (the host's)
    fence: bool = True  # False: no job is fenced, even where the server could (--no-fence)
    idle_reclaim: float = 0.0  # seconds a job's GPUs may show no utilization before it is reclaimed; 0: never

    def __post_init__(self) -> None:
        if not self.max_frame:
            object.__setattr__(self, "max_frame", default_max_frame(self.max_payload))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory() -> int:
    """This machine's memory, in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def job_memory(limits: Limits, ngpus: int, served: int) -> int:
    """The host memory of a job of `ngpus` GPUs (a share counts as one) that did not ask (memory=) on a server of
    `served` GPUs: --job-memory, else its GPUs' share of the machine's, as Slurm's DefMemPerGPU."""
    if limits.job_memory:
        return limits.job_memory
    return memory() * max(1, ngpus) // max(1, served)


def max_job_memory(limits: Limits) -> int:
    """The most host memory a job may ask for: --max-job-memory, else the machine's."""
    return limits.max_job_memory or memory()


def default_max_frame(max_payload: int) -> int:
    """The largest RPyC frame a server takes unless told (--max-frame): --max-payload (plus FRAME_SLACK for the
    call around it), but no more than a FRAME_MEMORY_SHARE of the machine's memory, and no more than a frame
    can announce."""
    return min(max_payload + FRAME_SLACK, memory() // FRAME_MEMORY_SHARE, MAX_FRAME_CEILING)


@dataclass
class ServerContext:
    """What every connection of one server shares; built once in the server parent."""

    name: str
    aliases: tuple[str, ...]
    inventory: Inventory
    lock_dir: str
    state_dir: str
    server_id: str
    host: str = ""
    port: int = 0
    framework_version: str | None = None
    limits: Limits = field(default_factory=Limits)
    shares: ShareRules = field(default_factory=ShareRules)
    gpus: list[GPU] = field(default_factory=list)
    server_process: procs.Pid = field(default_factory=lambda: procs.identify(os.getpid()))
    artifact_store: str = ""  # a URL (rpycdl.artifacts.store); "": the state directory's artifacts/
    artifact_endpoint: str | None = None  # an S3 endpoint (MinIO); None: $AWS_ENDPOINT_URL, else AWS
    scheduling: Scheduling = field(default_factory=Scheduling)  # the host's policy and placement
    accounts: Accounts = field(default_factory=Accounts)  # whose account runs each job (security.accounts)
    launcher: runner.Launcher = orphans.HERE  # what starts job processes: the server's forkserver, else this one
    preload: tuple[str, ...] = ()  # what the forkserver imported before it forked any job (--preload)
    ledger_checked: bool = False  # a server checked and migrated the ledger (a supervisor's: Ledger's checked)
    locks: GPULockManager = field(init=False)
    ledger: Ledger = field(init=False)
    files: JobFiles = field(init=False)
    working_dirs: WorkdirCache = field(init=False)
    store: ArtifactStore = field(init=False)

    def __post_init__(self) -> None:
        if os.geteuid() == 0:  # what this process makes in the lock and state directories is root's alone to change
            lockdir.use_private_modes()
        self.gpus = self.inventory.gpus()
        self.locks = GPULockManager(self.lock_dir, self.scheduling)  # creates the layout; connections inherit it
        # LedgerError if it is missing or damaged: never start over a history
        self.ledger = Ledger(self.state_dir, checked=self.ledger_checked)
        self.files = JobFiles(self.state_dir)
        self.working_dirs = WorkdirCache(os.path.join(self.state_dir, "workdirs"), self.limits.working_dir_cache)
        if self.accounts.isolated:  # every user's code and data: nobody's but the server's to read
            os.chmod(self.working_dirs.root, 0o700)
        self.artifact_store = self.artifact_store or os.path.join(os.path.abspath(self.state_dir), "artifacts")
        self.store = ArtifactStore.from_url(self.artifact_store, endpoint_url=self.artifact_endpoint)
        self.inventory.use_lock_dir(self.lock_dir)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "aliases": list(self.aliases), "host": self.host, "port": self.port,
                "server_id": self.server_id, "inventory": self.inventory.spec,
                "simulated": self.inventory.simulated, "framework_version": self.framework_version,
                "pid": os.getpid(), "limits": self.limits.to_dict(), "shares": self.shares.to_dict(),
                "lock_dir": self.lock_dir, "state_dir": self.state_dir, "ledger_id": self.ledger.ledger_id,
                "artifact_store": self.artifact_store, "scheduling": self.scheduling.to_dict(),
                "isolation": self.accounts.mode, "preload": list(self.preload),
                "fencing": cgroups.fencing(self.limits.job_tmp != -1)}
