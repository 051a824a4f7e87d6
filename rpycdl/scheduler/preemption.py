"""Preemption on paper (`rpycdl serve --preempt requeue|cancel`): which running jobs a waiting job of a higher priority
stops to get the GPUs it needs, decided once, and the marks that say so in the lock directory (preempt/<job id>.json).

The decision is the waiting job's own, taken by its process (its connection process, or a detached job's supervisor)
as it tries to be granted, under queue.lock (rpycdl.scheduler.locks): only one process decides at a time, and it
sees every mark made before. A waiting job preempts only when it heads its line (no request ahead of it competes for
its GPUs) and is held back by no limit, only for the GPUs it lacks, only jobs of a lower priority, and of those the
fewest, youngest: the GPUs whose holders are all of a lower priority and marked by nobody, those of fewest holders
first, then those granted last. A job that marked its victims marks no more while they hold their GPUs; a mark whose
job holds no grant any more is removed. The victims' keepers (a connection process, a supervisor) read their mark
(`mark_of`, checked against their grant's ticket) as they poll for a cancel, and do the signalling
(rpycdl.server.preempting)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rpycdl.scheduler import lockdir
from rpycdl.scheduler.holders import Records
from rpycdl.scheduler.policies import OFF, Decision, Scheduling

MARKS = "preempt"
"""The lock directory's folder of marks: preempt/<victim's job id>.json, {"by", "by_user", "priority",
"victim_priority", "ticket" (the victim's grant's), "at", "grace", "mode"}."""


def consider(root: Path, scheduling: Scheduling, records: Callable[[], Records], info: Mapping[str, Any],
             entry: Mapping[str, Any], decision: Decision) -> list[str]:
    """Under the queue lock, for a request that may not go now (`decision`): mark the jobs it preempts, if the host
    preempts, it heads its line and lower-priority jobs hold the GPUs it lacks. `records()` reads the grants' records;
    `info` and `entry` are the request's (its job id, user, priority; its candidates and GPUs). Returns the ids of
    the jobs it marked (none: it waits as without preemption)."""
    if scheduling.preempt == OFF or decision.uuids or decision.ahead or decision.reason or not info.get("job_id"):
        return []
    held, folder, rank = records(), root / MARKS, info.get("priority") or 0
    holding = {record.get("job_id") for entries in held.values() for _, record in entries}
    marks = {}
    for name in lockdir.names(folder, "", ".json"):
        mark = lockdir.read_json(folder / name)
        if mark is None or name[:-5] not in holding:  # its job let go of its GPUs (or never will: it died)
            (folder / name).unlink(missing_ok=True)
        else:
            marks[name[:-5]] = mark
    if any(mark.get("by") == info["job_id"] for mark in marks.values()):
        return []  # decided already: it waits for its victims to let go
    victims = choose(held, entry["candidates"], entry["ngpus"], rank, set(marks))
    lockdir.shared_dir(folder)
    now = time.time()
    for job_id, record in victims.items():
        lockdir.write_json(folder / f"{job_id}.json", {
            "by": info["job_id"], "by_user": info.get("user", ""), "priority": rank,
            "victim_priority": record.get("priority") or 0, "ticket": record["ticket"], "at": now,
            "grace": scheduling.preempt_grace, "mode": scheduling.preempt})
    return list(victims)


def choose(held: Records, candidates: list[str], ngpus: int, rank: int, marked: set[str]) -> dict[str, dict[str, Any]]:
    """The jobs (by id, with one of their grant's records) to preempt for `ngpus` GPUs of `candidates` at priority
    `rank`: none if enough are free, or if not enough could be freed of lower-priority jobs that nobody `marked`;
    else the holders of the GPUs of fewest holders, then of the youngest grants."""
    free, freeable = 0, []
    for uuid in candidates:
        holders = [record for _, record in held.get(uuid, [])]
        if not holders:
            free += 1
        elif all(record.get("job_id") and (record.get("priority") or 0) < rank and record["job_id"] not in marked
                 for record in holders):
            freeable.append((len({record["job_id"] for record in holders}),
                             -max(record.get("since", 0.0) for record in holders), uuid, holders))
    lacking = ngpus - free
    if lacking <= 0 or len(freeable) < lacking:
        return {}
    return {record["job_id"]: record for *_, holders in sorted(freeable)[:lacking] for record in holders}


def mark_of(root: str | Path, job_id: str) -> dict[str, Any] | None:
    """The mark of job `job_id`'s preemption, or None."""
    return lockdir.read_json(Path(root) / MARKS / f"{job_id}.json")


def unmark(root: str | Path, job_id: str) -> None:
    """Remove job `job_id`'s mark (its preemption is done)."""
    (Path(root) / MARKS / f"{job_id}.json").unlink(missing_ok=True)
