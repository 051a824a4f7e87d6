"""The host's scheduling as its lock directory holds it, for rpycdl.scheduler.locks: the claim that every
server and supervisor grants with the same policy (policies/<key>, share-locked while they live), and what
the policies read from the queue and the grants' records: requests as Wants, a backfill's Board, fair
share's usage, the limits' tally, the queue in the policy's order (with why each over its owner's limits waits)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rpycdl.errors import RpycdlError
from rpycdl.scheduler import fairshare, limits, lockdir, policies
from rpycdl.scheduler.fairshare import FairShare
from rpycdl.scheduler.holders import Records
from rpycdl.scheduler.policies import BACKFILL, FAIR, Board, Hold, Rules, Scheduling, Want
from rpycdl.scheduler.queuedir import in_line


def claim(root: Path, scheduling: Scheduling) -> None:
    """Mark the lock directory `root` as granted from with `scheduling` for as long as this process lives;
    refuse if a live process grants with another.

    Raises:
        RpycdlError: servers or supervisors of the directory use another policy, placement or fair share.
    """
    folder = root / "policies"
    lockdir.shared_dir(folder)
    said = folder / f"{scheduling.key()}.json"
    if lockdir.read_json(said) is None:  # the same for the same key: written once
        lockdir.write_json(said, scheduling.to_dict())
    for other in lockdir.claim(folder, scheduling.key()):
        theirs = _claimed(folder, other)
        raise RpycdlError(f"the lock directory {root} is used by servers with {theirs.words() if theirs else other}; "
                          f"this one was started with {scheduling.words()}: every server sharing a lock directory "
                          "must use the same --policy, --placement and --fair-share file (stop them, or start this "
                          "one like them)")


def host_scheduling(lock_dir: str | os.PathLike[str]) -> Scheduling | None:
    """The scheduling the live servers of a lock directory grant with (None: no server or supervisor lives);
    for those who read it without granting (the monitor)."""
    folder = Path(lock_dir) / "policies"
    if not folder.is_dir():
        return None
    for key in lockdir.names(folder, "", ""):
        if "." not in key and lockdir.others(lockdir.open_once(str(folder / key)), 0, 0, []):
            return _claimed(folder, key)
    return None


def _claimed(folder: Path, key: str) -> Scheduling | None:
    data = lockdir.read_json(folder / f"{key}.json")
    try:
        return Scheduling.from_dict(data) if data else None
    except (KeyError, TypeError, ValueError, RpycdlError):
        return None


def want(ticket: int, entry: Mapping[str, Any], info: Mapping[str, Any]) -> Want:
    """A request as the policies see it, from its queue entry (or queuedir.Need.entry()) and info."""
    sizes = [size for uuid, size in entry.get("sizes_mib", {}).items() if uuid in entry["candidates"]]
    share = entry["share_mib"] / max(sizes) if entry["share_mib"] and sizes else None
    return Want(ticket, entry["ngpus"], entry["share_mib"], tuple(entry["candidates"]), entry.get("seconds"),
                info.get("account", ""), share, info.get("priority") or 0, info.get("place"))


def board(records: Records, sizes: Mapping[str, int], now: float) -> Board:
    """What holds the GPUs of `sizes` (MiB) until when, by the grants' records: a grant ends at the latest when
    its declared timeout has passed; one that declared none, or ran past it, at an unknown time."""
    holds = []
    for uuid, entries in records.items():
        for _, record in entries if uuid in sizes else ():
            seconds = record.get("seconds")
            end = math.inf if seconds is None else record["since"] + seconds
            holds.append(Hold(uuid, sum(length for _, length in record.get("ranges") or ()),
                              end if end > now else math.inf))
    return Board(sizes, tuple(holds))


def usage(root: Path, records: Records, settings: FairShare, now: float) -> dict[str, float]:
    """Each account's weighted usage for fair share: the host's snapshot, and the grants running now."""
    running = limits.running_grants(record for entries in records.values() for _, record in entries)
    return fairshare.usage(fairshare.read_snapshot(root), running, settings, now)


def in_order(root: Path, scheduling: Scheduling, queue: list[dict[str, Any]], records: Records,
             plan: bool = False) -> list[dict[str, Any]]:
    """The waiting requests (in ticket order) in the order the policy grants them (higher priorities first): with
    each one's `usage` (its account's, weighted) under fair share; with `plan`, under backfill, the `planned_start`
    of each of the first PLAN_MAX (None: unknown), the first one's being the start its place reserves."""
    policy, now = scheduling.policy, time.time()
    queue = with_reasons(root, queue, records, now)
    if policy != FAIR and not (plan and policy == BACKFILL):  # the tickets' order within each priority
        return sorted(queue, key=in_line)
    used = usage(root, records, scheduling.fair_share, now) if policy == FAIR else None
    wants = {waiter["ticket"]: want(waiter["ticket"], waiter, waiter) for waiter in queue}
    ordered = policies.order(list(wants.values()), policy, used)
    by_ticket = {waiter["ticket"]: dict(waiter) for waiter in queue}
    if used is not None:
        for each in ordered:
            by_ticket[each.ticket]["usage"] = used.get(each.account, 0.0)
    else:  # a prefix of the queue is planned exactly: those behind never take what those ahead reserve
        sizes = {uuid: size for waiter in queue for uuid, size in waiter.get("sizes_mib", {}).items()}
        first = ordered[:policies.PLAN_MAX]
        starts = policies.plan(board(records, sizes, now), now, first, Rules(policy, scheduling.placement))
        for each, start in zip(first, starts, strict=True):
            by_ticket[each.ticket]["planned_start"] = None if start == math.inf else start
    return [by_ticket[each.ticket] for each in ordered]


def with_reasons(root: Path, queue: list[dict[str, Any]], records: Records, now: float) -> list[dict[str, Any]]:
    """The waiting requests, each whose owner's limits hold it back with its `reason` (rpycdl.scheduler.limits),
    judged by what is held and used now."""
    tally = limits.tally(root, records, now)
    if tally is None:
        return queue
    found = []
    for waiter in queue:
        reason = tally.over(waiter.get("account", ""), want(waiter["ticket"], waiter, waiter).counts)
        found.append({**waiter, "reason": reason} if reason else waiter)
    return found
