"""Every default setting of rpycdl, and the environment variables that override them."""

from __future__ import annotations

import os
import tempfile

REGISTRY_PORT = 18811
"""UDP port of the RPyC registry (RPyC's own default, so original clients find it)."""

SERVER_PORT = 18861
"""First port a server tries when none is given."""

MONITOR_PORT = 18870
"""TCP port of `rpycdl monitor` (clear of DCGM's exporter, 9400, and the node exporter, 9100)."""

LOCK_DIR = os.path.join(tempfile.gettempdir(), "rpycdl-locks")
"""Directory shared by every server on a host: GPU locks, the waiting queue, job records."""

REGISTRY_PRUNING_TIMEOUT = 60.0
"""Seconds after which the registry forgets a server that stopped re-registering."""

REREGISTER_INTERVAL = 20.0
"""Seconds between a server's registrations with the registry."""

WAIT_FALLBACK_POLL = 0.5
"""Seconds a waiting request sleeps at most between re-checks when nobody wakes it.

Normal releases wake waiters at once; this bounds the wait after a holder died without
saying so (kill -9 of a whole server)."""

DISPATCH_AHEAD = 2
"""How many queued rows at the head of each line (a set of candidate GPUs) have their supervisor started before
their turn: it waits as any request does, so that a release hands the GPUs over without a process start."""

DISPATCH_AHEAD_MAX = 8
"""At most how many queued rows at the head of a line have their supervisor started before their turn: as many as
its GPUs could run at once (one-GPU jobs on a server of four: four), so that a release of every GPU at once finds a
supervisor waiting for each (rpycdl.scheduler.queuedir.Need.at_once)."""

DISPATCH_SETTLE = 0.05
"""Seconds a woken dispatcher lets pass before it reads the queue: the supervisors waiting at the head of the
line, woken by the same release, take their grants first, without its pass over a long queue beside them."""

DISPATCH_LOOKAHEAD = 8
"""How many queued rows, per set of candidate GPUs, a server's dispatcher asks the policy about in one pass
when none of them can go (those behind them wait too: rpycdl.scheduler.locks.GPULockManager.dispatch)."""

LINGER_POLL = 0.02
"""Seconds a waiting request sleeps at most while what a crashed job left, which it has just
killed, may still be dying (rpycdl.locks)."""

SWEEP_INTERVAL = 0.5
"""Seconds between the server parent's routine sweeps for jobs whose connection process died
(its own, whose deaths also trigger a sweep at once through SIGCHLD, and other servers' after
those died: see DLServer). A sweep reads only the live records: a fraction of a millisecond."""

CGROUP_SWEEP_INTERVAL = 0.2
"""Seconds between a fencing server's looks for jobs' cgroups whose keeper died (and their requester: else it
removes them), apart from its routine sweep, which a loaded ledger can slow past a second."""

SPARE_CONNECTIONS = 2
"""Connection processes a server keeps forked and waiting in accept(), each with a spare job
process, so that neither fork is part of a client's round trip."""

KILL_WAIT = 2.0
"""Seconds to wait for a killed job's process group to vanish before giving up on it."""

STATE_SUBDIR = "state"
"""The state directory's name inside the lock directory, unless one is given (`--state-dir`,
$RPYCDL_STATE_DIR): the job ledger, detached jobs' payloads, logs and results."""

KEEP = 7 * 24 * 3600.0
"""Seconds a finished job's ledger row, log and result are kept (`--keep`)."""

PRUNE_INTERVAL = 60.0
"""Seconds between a server's prunes of jobs past their retention (or a tenth of a shorter --keep)."""

FAIR_SHARE_REFRESH = 2.0
"""Seconds between a server's refreshes of the host's fair-share snapshot (under --policy fair): what jobs
that ended since used reaches the order of the queue within this (running ones count at once)."""

LIMITS_REFRESH = 2.0
"""Seconds between a server's looks at its --limits file (read again when it changed) and refreshes of the
GPU-hours each account used (rpycdl.scheduler.limits): what jobs that ended since used counts within this."""

SAMPLER_MODULE = "rpycdl.gpu.sampler"
"""The module of a server's load sampler (python -m), which its sweep leaves alone."""

LOAD_PERIOD, LOAD_WINDOW = 1.0, 5
"""Under --placement least-busy: seconds between a server's samples of its GPUs' load (NVML), and how many
of the last samples each GPU's load averages."""

MAX_LOG = 1024**3
"""Bytes of output a detached job's log keeps (`--max-log`); past them, a marker line and nothing more."""

MAX_RESULT = 1024**3
"""Largest result a detached job may store, in bytes (`--max-result`)."""

JOB_PIDS = 4096
"""Processes and threads a job may have at once where its server fences it (`--job-pids`; a cgroup's pids.max)."""

MIN_JOB_MEMORY = 64 * 1024**2
"""The least host memory a job may ask for (`memory=`): less does not start Python with a framework."""

MAX_OUTPUT = 100 * 1024**3
"""Bytes a job may leave in its output directory (`--max-output`); past them, it is stopped and fails."""

OUTPUT_CHECK_INTERVAL = 1.0
"""Seconds between measures of a running job's output directory against --max-output (at least ten times as
long as the last measure took, so that a large tree costs a tenth of a core at most)."""

OUTPUT_DEPTH = 256
"""Directories an output directory may nest at most for its measure: one deeper fails the job as over its
--max-output (each level holds a descriptor while it is measured)."""

MAX_WORKING_DIR = 2 * 1024**3
"""Largest working directory a job may bring (`--max-working-dir`): its files' bytes, after .rpycdlignore."""

WORKING_DIR_CACHE = 10 * 1024**3
"""Bytes of working directories a state directory keeps by content hash (`--working-dir-cache`), so that
the same directory is not sent twice; the least recently used go first."""

MANIFESTS = "~/.cache/rpycdl/workdirs"
"""Where a client remembers the working directories it sent ($RPYCDL_MANIFESTS overrides; "" for nowhere):
each one's entries as stat saw them and its digest, so that an unchanged directory is not read again."""

MANIFESTS_KEPT = 256
"""Most working directories a client remembers; the least recently used are forgotten first."""

ARTIFACT_CHUNK = 4 * 1024**2
"""Bytes of an artifact a download reads through its server per call."""

OUTPUT_DIR_VARIABLE = "RPYCDL_OUTPUT_DIR"
"""A job's output directory: what it leaves there goes to the artifact store when it ends."""

ARRAY_INDEX_VARIABLE = "RPYCDL_ARRAY_INDEX"
"""An array element's index in its array (rpycdl.array_index()); absent for a job of no array."""

MAX_ARRAY = 100_000
"""Most elements of one array (submit_array, rpycdl submit --array)."""

WORKING_DIR_VARIABLE = "RPYCDL_WORKING_DIR"
"""A job's working directory, unpacked for it alone: its current directory, first on its sys.path."""

ATTEMPT_VARIABLE = "RPYCDL_ATTEMPT"
"""Set in a job: which attempt of it this is, 1 for the first (rpycdl.attempt(); a detached job's `retries=`)."""

MAX_RETRIES = 100
"""Most times a detached job may be requeued after an end that is not its own (submit's `retries=`)."""

PREEMPT_GRACE = 30.0
"""Seconds a preempted job has between its SIGTERM (rpycdl.on_preempt's handler runs) and its SIGKILL
(--preempt-grace)."""
MAX_PREEMPT_GRACE = 3600.0
"""The longest --preempt-grace."""

PRIORITY_LOWEST, PRIORITY_HIGHEST = -10, 10
"""The priorities a request may ask (`priority=`; 0 unless asked; higher goes first: rpycdl.scheduler.priorities)."""

SAVE_SOCKET_VARIABLE = "RPYCDL_SAVE_SOCKET"
"""Set in a job (but a container's): the socket on which the process that owns it takes rpycdl.save_artifact's
requests."""

STORE_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
"""The store's credentials as a server may find them in its environment: taken out of every job's."""

SECRET_VARIABLE_PREFIXES = ("AWS_", "AZURE_", "GOOGLE_APPLICATION_CREDENTIALS", "RPYCDL_SECRET", "RPYCDL_TLS_KEY")
"""Variables of a server's environment that a job never gets, by prefix: cloud credentials and where the server's
own secrets are (rpycdl.server.forkserver starts clean of them, and so does every job)."""

RECENT_JOBS = 24 * 3600.0
"""Seconds after its end that a job still shows in `rpycdl jobs` without --all."""

JOBS_SHOWN = 100
"""Jobs `rpycdl jobs` shows at most (the newest), unless given --limit."""

JOB_WAIT_MAX = 10.0
"""Seconds a server waits at most within one call for a job to end, its log to grow or its outputs to be
uploaded; clients call again (so a client that went away frees its connection soon)."""

UPLOAD_WAIT = 600.0
"""Seconds `job.download()` and `rpycdl download` wait at most, by default, for a job's outputs still
uploading to the artifact store after its end."""

LOG_CHUNK = 1024**2
"""Bytes of a job's log one call reads at most."""

SUPERVISOR_NAME = "rpycdl-superv"
"""The name of detached jobs' supervisors (/proc/PID/comm): how servers and the site tell them from other
processes (they are forked from a server's forkserver, so their command line is the forkserver's)."""

FORKSERVER_MODULE = "rpycdl.server.forkserver"
"""What a server's job forkserver runs (`python -m`)."""

LEDGER_BUSY_TIMEOUT = 30.0
"""Seconds a ledger write waits for another process's write to end (they take milliseconds)."""

REFUSAL_BUSY_TIMEOUT = 1.0
"""Seconds counting a refused request waits for another process's ledger write: the refusal is not
held up longer (the server's parent counts the connections it refuses between its forks)."""

MAX_PAYLOAD = 8 * 1024**3
"""Largest call a server accepts, in bytes (`--max-payload`)."""

MAX_FRAME_CEILING = 2**32 - 1
"""The largest RPyC frame there is (its header counts bytes in 32 bits)."""

FRAME_MEMORY_SHARE = 8
"""By default a server takes RPyC frames of at most its machine's memory over this (`--max-frame`), and never more
than --max-payload (plus FRAME_SLACK): a frame is held whole in its connection process's memory, twice for a moment."""

FRAME_SLACK = 1 << 20
"""Bytes an RPyC frame may carry beyond the payload limit (the call around the payload)."""

SPOOL_MIN = 256 * 1024**2
"""An out-of-band buffer of a call of more bytes than this is received into a file of the state directory
(deleted as it is made, so nothing is left), not into anonymous memory: the kernel may write it out to disk."""

MIN_MAX_PAYLOAD = 1024**2
"""The smallest --max-payload a server takes: calls up to this size need no look at the limit."""

RELEASE_BEFORE_REPLY = 1024**2
"""An outcome of more bytes than this gives its GPUs back before the reply is sent (a smaller one
goes first, and the GPUs follow at once: the round trip does not wait for the release)."""

RESULT_DECODE_TIMEOUT = 30.0
"""Seconds a server spends at most making a job's value for an original client (`run_code`),
which gets it by reference from the connection process; its GPUs are free by then."""

RESULT_MEMORY_FACTOR = 32
RESULT_MEMORY_MIN = 256 * 1024**2
"""Making that value may take this many times the outcome's size in new memory (this much at least)."""

MAX_QUEUED = 50_000
"""Most requests of one server waiting at once (`--max-queued`). A waiting detached job is a row of a few KiB, and
a server answers with 10,000 waiting as fast as with a hundred (BENCHMARKS.md, bench_scale)."""

MAX_QUEUED_PER_USER = 10_000
"""Most requests of one user waiting at once on one server (`--max-queued-per-user`): a sweep of 10,000."""

MAX_CONNECTIONS = 256
"""Most authenticated client connections a server serves at once (`--max-connections`); one more is refused
once it has authenticated."""

MAX_STARTUPS = (64, 30, 256)
"""Connections still authenticating that a server holds (`--max-startups LOW:RATE:HIGH`, as OpenSSH's MaxStartups):
from LOW of them on, a new one is dropped with a probability of RATE percent, rising to 100 at HIGH."""

MAX_STARTUPS_CEILING = 512
"""The highest HIGH of --max-startups: the server parent holds one descriptor per startup, and a connection
process keeps its socket's descriptor number, which select() wants below 1024."""

PER_SOURCE_STARTUPS = 16
"""Connections still authenticating that a server holds from one source address (`--per-source-startups`); one
more replaces the oldest of them that has sent nothing, or is dropped."""

STARTUP_GRACE = 5.0
"""Seconds a connection may take to authenticate (and, on a server without authentication, to send its first
byte) before the server drops it."""

ACCEPT_DEFER = 1
"""Seconds the kernel keeps a new connection that has sent nothing to itself before the server's gate is told
of it (TCP_DEFER_ACCEPT): rpycdl's clients speak at once (a hello, or RPyC's first request) and go straight to
the gate, while a flood of silent connections waits in the kernel rather than in the gate's queue before them
(an older client with credentials, which waits for the greeting, waits this long too)."""

ACCEPT_BATCH = 8
"""Connections the server parent accepts at most per turn of its loop, between turns that advance the handshakes
already under way (so that a flood of new ones never starves those)."""

DROP_LOG_INTERVAL = 10.0
"""Seconds over which the server parent sums up the connections it dropped or refused before authentication:
the first of each source and cause is logged at once, the rest in one line at the end of the interval."""

DROP_COUNT_INTERVAL = 1.0
"""Seconds between the server parent's writes of those counts to the ledger (the monitor reads them there)."""

CONNECT_TIMEOUT = 10.0
"""Seconds a client keeps connecting again when a busy server drops its connection before authenticating it
(--max-startups, --per-source-startups)."""

SESSION_IDLE_TIMEOUT = 600.0
"""Seconds a session may stay without a call before it is closed and its GPUs go back (session(idle_timeout=))."""

IDLE_RECLAIM_LOOK = 1.0
"""Seconds between two looks at a job's GPUs' utilization, where the server reclaims idle GPUs (--idle-reclaim)."""

IDLE_RECLAIM_WARNING = 300.0
"""Seconds before it is reclaimed that a job idle on its GPUs is warned (at most half of --idle-reclaim)."""

SESSION_INTERRUPT_GRACE = 3.0
"""Seconds a session's call has to stop after Ctrl-C (KeyboardInterrupt in it) before the session is ended."""

SESSION_TICK = 0.25
"""Seconds between a connection's looks at its open session while no call runs (a dead process, a cancel,
the idle timeout, the watchdog): what it finds ends the session within about that."""

CANCEL_WAIT = 5.0
"""Seconds `job.cancel()` waits at most for the job to end (it stops within a fraction of a second, or its
cancel is still under way when cancel() returns its state)."""

OUTPUT_FLUSH_DELAY = 0.1
"""Seconds a job's output without a newline (`print("loading...", end="")`) waits at most in the job
process before it is sent on: a job's stdout and stderr flush at each newline, and this much after a write
that left a partial line."""

IDLE_TIMEOUT = 3600.0
"""Seconds a connection may stay idle (no request, no job) before the server closes it (`--idle-timeout`)."""

DRAIN_TIMEOUT = 3600.0
"""Seconds the attached jobs and sessions of a server told to stop (SIGTERM) may go on running before they are
cancelled (`--drain-timeout`); its connections refuse new jobs meanwhile, and close once idle past it."""

DISCOVERY_TIMEOUT = 2.0
"""Seconds to wait for the registry to answer."""

HANDSHAKE_TIMEOUT = 5.0
"""Seconds a client and a server may take to greet and authenticate each other."""

CA_DAYS = 3650
SERVER_CERT_DAYS = 825
USER_CERT_DAYS = 365
"""Validity of the certificates `rpycdl certs` issues, in days (`--days` overrides)."""

CONFIG_FILE = "~/.config/rpycdl/credentials.toml"
"""The client's credentials file (`secret_file`, `tls_cert`, `tls_key`, `tls_ca`, `registry`, `result_key`)."""

RESULT_KEY_FILE = "result-key"
"""The client's result key (rpycdl.security.results), beside its credentials file unless `result_key` (or
$RPYCDL_RESULT_KEY) names another path."""

ENV_GPUS = "RPYCDL_GPUS"
ENV_NVML_MODULE = "RPYCDL_NVML_MODULE"  # a module to use instead of pynvml: a stand-in that plays a driver
ENV_LOCK_DIR = "RPYCDL_LOCK_DIR"
ENV_STATE_DIR = "RPYCDL_STATE_DIR"
ENV_REGISTRY = "RPYCDL_REGISTRY"
ENV_SECRET_FILE = "RPYCDL_SECRET_FILE"
ENV_SIMULATED_GPUS = "RPYCDL_SIMULATED_GPUS"
"""Set in jobs on simulated GPUs: where rpycdl.gpus.simulate_memory records their memory use."""
ENV_TLS_CERT = "RPYCDL_TLS_CERT"
ENV_TLS_KEY = "RPYCDL_TLS_KEY"
ENV_TLS_CA = "RPYCDL_TLS_CA"
ENV_CONFIG = "RPYCDL_CONFIG"
ENV_RESULT_KEY = "RPYCDL_RESULT_KEY"
ENV_CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
ENV_NVIDIA_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
"""CUDA's and the NVIDIA container runtime's: a server started with either set manages only the GPUs they
leave it (rpycdl.gpu.inventory.confine), as a Kubernetes pod or a Slurm job is given them."""
ENV_MANIFESTS = "RPYCDL_MANIFESTS"
QUIET_VARIABLE = "RPYCDL_QUIET"
"""Set to 1, the client says nothing of its own (no waiting line, no download bar), as in batch use."""


def lock_dir() -> str:
    """The lock directory: $RPYCDL_LOCK_DIR, else LOCK_DIR."""
    return os.environ.get(ENV_LOCK_DIR) or LOCK_DIR


def state_dir(locks: str) -> str:
    """The state directory of the lock directory `locks`: $RPYCDL_STATE_DIR, else STATE_SUBDIR in it."""
    return os.environ.get(ENV_STATE_DIR) or os.path.join(locks, STATE_SUBDIR)

GPU_UNIT = "256MiB"
"""Granularity of fractional grants (`--gpu-unit`): shares are rounded up to whole units."""

MEMORY_ALLOWANCE = 1024**3
"""Bytes of GPU memory a fractional job may use beyond its grant before the watchdog stops it
(`--memory-allowance`): room for the CUDA context, which no framework cap covers."""

WATCH_INTERVAL = 1.0
"""Seconds between the watchdog's looks at a fractional job's GPU memory."""

ARGUMENT_ITEMS = 1_000_000
"""Most items a server copies from the arguments an original client passes by reference (lists,
dicts and sets arrive as RPyC netrefs: rpycdl.transport.materialize)."""

ARGUMENT_DEPTH = 100
"""Most levels of nested containers a server copies from arguments passed by reference."""

ARGUMENT_TIMEOUT = 5.0
"""Seconds a server spends at most copying the arguments an original client passed by reference."""
