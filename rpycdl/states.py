"""A job's states, shared by the ledger that records them, the server that changes them and the
client that shows them; they travel as their plain upper-case strings. And a waiting job's situation in
words (what it asks for, who holds the GPUs it waits for, what is ahead of it), which the client, the
command line and the server's QueueTimeoutError say alike."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from enum import Enum
from typing import Any

from rpycdl.units import format_size


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


# -- a waiting job's situation in words: the client's waiting line, `rpycdl jobs`, QueueTimeoutError ------------

def need_text(ngpus: int, share_bytes: int) -> str:
    """What a request asks for, in words: '1 GPU', '2 GPUs', 'all GPUs', or '4 GiB of one GPU'."""
    if share_bytes:
        return f"{format_size(share_bytes)} of one GPU"
    return "all GPUs" if ngpus < 0 else f"{ngpus} GPU{'' if ngpus == 1 else 's'}"


def clock(when: float | datetime) -> str:
    """A moment as a person reads it here: 10:02 (local time), with the date if it is not today."""
    moment = when if isinstance(when, datetime) else datetime.fromtimestamp(when).astimezone()
    now = datetime.now(moment.tzinfo)
    return moment.strftime("%H:%M" if moment.date() == now.date() else "%Y-%m-%d %H:%M")


def held_by(holders: Iterable[Mapping[str, Any]]) -> str:
    """Who holds the GPUs a request waits for (holders as a waiting job's row or its "pending" info gives them,
    one per GPU held, `since` in epoch seconds or as a datetime): 'GPU 0 held by job 3f2a of alice since
    10:02; GPUs 1, 2 held by job 77b1 of bob since 09:40'; '' for none."""
    jobs: dict[str, list[Mapping[str, Any]]] = {}
    for holder in holders:
        jobs.setdefault(holder["job_id"], []).append(holder)
    parts = []
    for job_id, held in jobs.items():
        gpus = [str(holder["gpu"]) for holder in held if holder.get("gpu") is not None] or ["?"]
        share = " (a share)" if any(holder.get("share_bytes") for holder in held) else ""
        parts.append(f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(gpus)}{share} held by job {job_id} of "
                     f"{held[0].get('user', 'unknown')} since {clock(held[0]['since'])}")
    return "; ".join(parts)


def waiting_behind(ahead: int, holders: Iterable[Mapping[str, Any]] | None) -> str:
    """What a waiting job waits for, in words: 'behind 1 running job and 2 queued requests'. `ahead` counts
    what is ahead of it, the jobs holding the GPUs it waits for (`holders`, one per GPU held) and the waiting
    requests before it in line, as the client gives them (rpycdl.client.displays.client_row); holders None:
    a server from before they were told, whose `ahead` counts the queued requests alone."""
    if holders is None:
        return f"{ahead} queued request(s) ahead"
    jobs = len({holder["job_id"] for holder in holders})
    queued = max(0, ahead - jobs)
    return (f"behind {jobs} running job{'' if jobs == 1 else 's'} and {queued} queued "
            f"request{'' if queued == 1 else 's'}")


def waiting_for(row: Mapping[str, Any]) -> str:
    """What a PENDING job's row (as a server shows it) waits for, in words: what it waits behind in line
    (waiting_behind), or, held by its dependencies before it has a place in line, 'after ok:ID' (to its owner;
    rpycdl.server.held); "" for any other row."""
    if row.get("state") != JobState.PENDING.value:
        return ""
    if row.get("ahead") is not None:
        return waiting_behind(row["ahead"], row.get("holders"))
    after = (row.get("request") or {}).get("after")
    return f"after {after}" if after else ""
