"""The job ledger's record of preemptions (`rpycdl serve --preempt`), mixed into rpycdl.scheduler.ledger.Ledger: who
preempted whom, when, at which priorities, and what became of the job preempted (requeued or ended); one row per
preempted attempt, gone with its job's row (a trigger)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

COLUMNS = ("job_id", "attempt", "by_job", "by_user", "priority", "victim_priority", "at", "ended", "outcome", "ticket")
"""The preemptions table's columns: the job preempted and its attempt, the job that preempted it (and its user), their
priorities, when it was decided and when the job preempted let go of its GPUs, "requeued" or "ended", and the ticket
of the preempted attempt (its place in line, which a requeued job takes again: rpycdl.server.retries)."""


class PreemptionsLedger:
    """The ledger's preemptions, in its own transactions (`_write`, `_db`)."""

    _write: Callable[..., contextlib.AbstractContextManager[Any]]
    _db: Callable[[], contextlib.AbstractContextManager[Any]]

    def record_preemption(self, row: dict[str, Any]) -> None:
        """Record a preemption (COLUMNS); a second record of one attempt changes nothing."""
        with self._write() as db:
            db.execute(f"INSERT OR IGNORE INTO preemptions ({', '.join(COLUMNS)}) VALUES "
                       f"({', '.join('?' * len(COLUMNS))})", [row.get(column) for column in COLUMNS])

    def preemptions(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """The preemptions of job `job_id` (None: of every job), oldest first."""
        where, args = ("WHERE job_id = ?", (job_id,)) if job_id is not None else ("", ())
        with self._db() as db:
            rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM preemptions {where} ORDER BY at", args).fetchall()
        return [dict(zip(COLUMNS, row, strict=True)) for row in rows]

    def preemption_counts(self) -> dict[str, int]:
        """How many jobs were preempted, by what became of them ("requeued", "ended"), since the ledger was made."""
        with self._db() as db:
            return dict(db.execute("SELECT outcome, count(*) FROM preemptions GROUP BY outcome").fetchall())
