"""The job ledger's schema: one SQL script per version, applied in order (PRAGMA user_version counts them).

`meta(key, value)` holds the ledger_id, a uuid made with the database; `jobs` has a column per JobRecord
field (rpycdl.scheduler.jobrecord), job_id its primary key, request and gpu_uuids as JSON text, booleans as
0/1, times in seconds since the epoch (`ended` set once the job finished). Indexes: submitted (newest first,
`since`), (ended, submitted) (the default view, prune), (state, submitted) (unfinished rows and state
filters, cheap whatever the history), (user, submitted), (user, name) for find, and (user, name) UNIQUE
among unfinished rows: one live job of a name per user. `refusals(service, reason, count)` counts the
requests the host's servers refused, one row per service and reason. `artifacts(job_id, state, files,
error, updated)` says where a job's outputs stand; a job's row going takes it along (a trigger). Version 4
adds `jobs.gpus`, the GPUs a job was granted (a share's fraction), which fair share counts; version 5
`drops(service, reason, count)`, the connections the host's servers dropped before they authenticated; version 6
`jobs.result_nonce` and `jobs.result_key_id`, a detached job's seal (rpycdl.security.results; NULL for jobs
without one); version 7 the index `jobs_waiting` (server_id, user, user_verified) of the PENDING rows, which a
submit counts against the queue's limits; version 8 `jobs.peak_memory`, `jobs.cpu_seconds` and `jobs.max_procs`,
what the server measured of a job's cgroup at its end (NULL: not measured); version 9 `jobs.attempt`, which attempt
of a detached job the row is (1, then one more each time `retries=` requeues it: rpycdl.scheduler.attempts), and
`attempts(job_id, attempt, ...)`, the earlier attempts of a requeued job, each as its row told it when it ended
(gone with its job's row, by a trigger); version 10 job arrays
(rpycdl.scheduler.arrays): `jobs.array_id` and `jobs.array_index` (NULL for a job of no array) with their index,
and `arrays(array_id, user, user_verified, name, size, max_running, submitted, server_id, kind)`, one row per
array, which goes with its last element's row (a trigger); version 11 `jobs.priority`, its priority among the waiting
(rpycdl.scheduler.priorities; 0 for the jobs before); version 12 `preemptions(job_id, attempt, by_job, by_user,
priority, victim_priority, at, ended, outcome, ticket)`, who preempted whom and when (rpycdl.scheduler.preemptions),
gone with the job's row (a trigger).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from rpycdl.errors import LedgerError

REFUSALS = ("invalid", "limit", "connections", "auth", "not_allowed")
"""Why a server refuses a request, the reasons count_refusal counts: a run or submit request it could
never serve (InvalidRequestError), over a limit (LimitError: a full queue, --max-payload), a connection
over --max-connections, an authentication that failed, a user acting on another's job (NotAllowedError)."""

DROPS = ("startups", "per_source", "grace")
"""Why a server's parent drops a connection before it authenticated, the reasons count_drops counts: over
--max-startups, over --per-source-startups, its handshake not completed in time."""

ARTIFACT_STATES = ("uploading", "uploaded", "failed")
"""Where a job's outputs stand: going to the artifact store, there, or kept on the server (its error says
why) for `rpycdl artifacts JOB --retry`."""

LIVE = "state IN ('PENDING', 'RUNNING')"
"""The UNFINISHED rows, in the words of the unique index (the planner matches words)."""

MIGRATIONS = [
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY NOT NULL, server_id TEXT NOT NULL, client TEXT NOT NULL,
        ngpus INTEGER NOT NULL, share_bytes INTEGER NOT NULL, state TEXT NOT NULL,
        owner_pid INTEGER NOT NULL, owner_start INTEGER NOT NULL, pgid INTEGER NOT NULL,
        leader_start INTEGER NOT NULL, gpu_uuids TEXT NOT NULL, submitted REAL NOT NULL, started REAL,
        ended REAL, error TEXT NOT NULL, error_type TEXT NOT NULL, exit_code INTEGER, user TEXT NOT NULL,
        user_verified INTEGER NOT NULL, name TEXT, detached INTEGER NOT NULL, kind TEXT NOT NULL,
        service TEXT NOT NULL, server TEXT NOT NULL, request TEXT NOT NULL, log_bytes INTEGER NOT NULL,
        result_bytes INTEGER, cancel_requested INTEGER NOT NULL DEFAULT 0);
    CREATE INDEX jobs_submitted ON jobs (submitted);
    CREATE INDEX jobs_ended ON jobs (ended, submitted);
    CREATE INDEX jobs_state ON jobs (state, submitted);
    CREATE INDEX jobs_user ON jobs (user, submitted);
    CREATE INDEX jobs_name ON jobs (user, name) WHERE name IS NOT NULL;
    CREATE UNIQUE INDEX jobs_unfinished_name ON jobs (user, name)
        WHERE name IS NOT NULL AND state IN ('PENDING', 'RUNNING');
    """,
    """
    CREATE TABLE refusals (service TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
                           PRIMARY KEY (service, reason)) WITHOUT ROWID;
    """,
    """
    CREATE TABLE artifacts (job_id TEXT PRIMARY KEY, state TEXT NOT NULL, files TEXT NOT NULL,
                            error TEXT NOT NULL, updated REAL NOT NULL);
    CREATE TRIGGER jobs_artifacts_deleted AFTER DELETE ON jobs BEGIN
        DELETE FROM artifacts WHERE job_id = old.job_id;
    END;
    """,
    """
    ALTER TABLE jobs ADD COLUMN gpus REAL NOT NULL DEFAULT 0;
    """,
    """
    CREATE TABLE drops (service TEXT NOT NULL, reason TEXT NOT NULL, count INTEGER NOT NULL,
                        PRIMARY KEY (service, reason)) WITHOUT ROWID;
    """,
    """
    ALTER TABLE jobs ADD COLUMN result_nonce TEXT;
    ALTER TABLE jobs ADD COLUMN result_key_id TEXT;
    """,
    """
    CREATE INDEX jobs_waiting ON jobs (server_id, user, user_verified) WHERE state = 'PENDING';
    """,
    """
    ALTER TABLE jobs ADD COLUMN peak_memory INTEGER;
    ALTER TABLE jobs ADD COLUMN cpu_seconds REAL;
    ALTER TABLE jobs ADD COLUMN max_procs INTEGER;
    """,
    """
    ALTER TABLE jobs ADD COLUMN attempt INTEGER NOT NULL DEFAULT 1;
    CREATE TABLE attempts (job_id TEXT NOT NULL, attempt INTEGER NOT NULL, state TEXT NOT NULL, started REAL,
                           ended REAL NOT NULL, error TEXT NOT NULL, error_type TEXT NOT NULL, exit_code INTEGER,
                           gpu_uuids TEXT NOT NULL, PRIMARY KEY (job_id, attempt)) WITHOUT ROWID;
    CREATE TRIGGER jobs_attempts_deleted AFTER DELETE ON jobs BEGIN
        DELETE FROM attempts WHERE job_id = old.job_id;
    END;
    """,
    """
    ALTER TABLE jobs ADD COLUMN array_id TEXT;
    ALTER TABLE jobs ADD COLUMN array_index INTEGER;
    CREATE INDEX jobs_array ON jobs (array_id, array_index) WHERE array_id IS NOT NULL;
    CREATE TABLE arrays (array_id TEXT PRIMARY KEY, user TEXT NOT NULL, user_verified INTEGER NOT NULL, name TEXT,
                         size INTEGER NOT NULL, max_running INTEGER, submitted REAL NOT NULL,
                         server_id TEXT NOT NULL, kind TEXT NOT NULL);
    CREATE INDEX arrays_name ON arrays (user, name) WHERE name IS NOT NULL;
    CREATE TRIGGER jobs_array_deleted AFTER DELETE ON jobs WHEN old.array_id IS NOT NULL BEGIN
        DELETE FROM arrays WHERE array_id = old.array_id
            AND NOT EXISTS (SELECT 1 FROM jobs WHERE array_id = old.array_id);
    END;
    """,
    """
    ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;
    """,
    """
    CREATE TABLE preemptions (job_id TEXT NOT NULL, attempt INTEGER NOT NULL, by_job TEXT NOT NULL,
                              by_user TEXT NOT NULL, priority INTEGER NOT NULL, victim_priority INTEGER NOT NULL,
                              at REAL NOT NULL, ended REAL NOT NULL, outcome TEXT NOT NULL, ticket INTEGER NOT NULL,
                              PRIMARY KEY (job_id, attempt)) WITHOUT ROWID;
    CREATE INDEX preemptions_by ON preemptions (by_job);
    CREATE TRIGGER jobs_preemptions_deleted AFTER DELETE ON jobs BEGIN
        DELETE FROM preemptions WHERE job_id = old.job_id;
    END;
    """,
]
"""One SQL script per schema version: a database at version N runs MIGRATIONS[N:]. Never edit one."""


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Inside a write transaction: run the MIGRATIONS the database at `path` lacks.

    Raises:
        LedgerError: the database was written by a newer rpycdl.
    """
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > len(MIGRATIONS):
        raise LedgerError(f"the job ledger {path} was written by a newer rpycdl (schema version {version}, this "
                          f"one knows up to {len(MIGRATIONS)}): upgrade rpycdl, or use another state directory")
    for number, script in enumerate(MIGRATIONS[version:], version + 1):
        statement = ""  # one at a time: executescript would commit the transaction
        for line in script.splitlines(keepends=True):
            statement += line
            if sqlite3.complete_statement(statement):
                db.execute(statement)
                statement = ""
        db.execute(f"PRAGMA user_version = {number}")
