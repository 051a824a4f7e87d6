"""A job's states, shared by the ledger that records them, the server that changes them and the
client that shows them; they travel as their plain upper-case strings."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Where a job is in its life. A stop the user asked for (cancelled) is not a failure, and a
    detached job whose supervising process died is lost: its outcome is unknown."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    LOST = "LOST"

    @property
    def finished(self) -> bool:
        """Whether the job has ended (its state never changes again)."""
        return self not in UNFINISHED


UNFINISHED = (JobState.PENDING, JobState.RUNNING)
