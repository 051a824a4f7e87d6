"""Grants planned on paper, for rpycdl.scheduler.locks: which GPUs a request would get now, and which MiB
of a GPU's lock file a share would lock, from each GPU's room (`take` updates the plan in place);
nothing is locked here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rpycdl.errors import InvalidRequestError

Range = tuple[int, int]  # (first MiB, MiB count) in a GPU's lock file


@dataclass
class Room:
    """On paper, while planning grants: whether a GPU is untouched, and its free MiB."""

    idle: bool
    free: int


def rooms(taken: Mapping[str, list[Range]], sizes: Mapping[str, int], fractional: bool) -> dict[str, Room]:
    """Each GPU's room, from the ranges `taken` of it (by every holder). Free MiB of a busy GPU are
    counted only when a fractional request is involved (sizes are known for every GPU such a
    request may use)."""
    found = {}
    for uuid, ranges in taken.items():
        size = sizes.get(uuid, 0)
        if not ranges:
            found[uuid] = Room(True, size)
        elif fractional and size:
            found[uuid] = Room(False, size - sum(length for _, length in ranges))
        else:
            found[uuid] = Room(False, 0)
    return found


PACK, SPREAD, LEAST_BUSY = "pack", "spread", "least-busy"
PLACEMENTS = (PACK, SPREAD, LEAST_BUSY)
"""Where a share goes among the GPUs with room for it: the fullest one already shared (pack: whole GPUs stay
free for whole-GPU requests), the emptiest (spread: shares run apart while there is room), or the one whose
measured load leaves it the most room (least-busy; pack where a GPU's load is not known)."""


def pick(rooms: dict[str, Room], ngpus: int, share_mib: int, candidates: Sequence[str], placement: str = PACK,
         load: Mapping[str, float] | None = None) -> list[str]:
    """The GPUs a request would get now ([] if none): the first idle ones for whole GPUs; for a share, one GPU
    with room for it chosen by `placement` (PLACEMENTS), given each GPU's measured `load` (0 idle to 1 busy)."""
    if not share_mib:
        idle = [uuid for uuid in candidates if rooms[uuid].idle]
        return idle[:ngpus] if len(idle) >= ngpus else []
    fits = [uuid for uuid in candidates if rooms[uuid].free >= share_mib]
    if not fits:
        return []
    if placement == LEAST_BUSY and load and all(uuid in load for uuid in fits):
        return [min(fits, key=lambda uuid: (load[uuid], rooms[uuid].idle, rooms[uuid].free))]
    if placement == SPREAD:
        return [max(fits, key=lambda uuid: (rooms[uuid].idle, rooms[uuid].free))]
    shared = [uuid for uuid in fits if not rooms[uuid].idle]
    return [min(shared, key=lambda uuid: rooms[uuid].free)] if shared else fits[:1]


def take(rooms: dict[str, Room], uuids: list[str], share_mib: int) -> None:
    """Plan `uuids` as taken: `share_mib` of each (a share), or the whole of each (0)."""
    for uuid in uuids:
        rooms[uuid] = Room(False, rooms[uuid].free - share_mib if share_mib else 0)


def fit(taken: list[Range], size_mib: int, share_mib: int) -> list[Range]:
    """Free ranges of a GPU of `size_mib` to lock for `share_mib`: the smallest gap that fits,
    else gaps in order."""
    gaps, at = [], 0
    for start, length in sorted(taken):
        if start > at:
            gaps.append((at, start - at))
        at = max(at, start + length)
    if at < size_mib:
        gaps.append((at, size_mib - at))
    fitting = [gap for gap in gaps if gap[1] >= share_mib]
    if fitting:
        start, _ = min(fitting, key=lambda gap: gap[1])
        return [(start, share_mib)]
    ranges, left = [], share_mib
    for start, length in gaps:
        ranges.append((start, min(length, left)))
        left -= ranges[-1][1]
        if not left:
            return ranges
    raise InvalidRequestError(f"no room for {share_mib} MiB")  # pick checked the room: cannot happen
