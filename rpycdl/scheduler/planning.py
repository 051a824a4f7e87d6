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


def pick(rooms: dict[str, Room], ngpus: int, share_mib: int, candidates: Sequence[str]) -> list[str]:
    """The GPUs a request would get now ([] if none): the first idle ones for whole GPUs; for a
    share, the fullest GPU already shared that has room, else the first idle one large enough."""
    if not share_mib:
        idle = [uuid for uuid in candidates if rooms[uuid].idle]
        return idle[:ngpus] if len(idle) >= ngpus else []
    shared = [uuid for uuid in candidates if not rooms[uuid].idle and rooms[uuid].free >= share_mib]
    if shared:
        return [min(shared, key=lambda uuid: rooms[uuid].free)]
    idle = [uuid for uuid in candidates if rooms[uuid].idle and rooms[uuid].free >= share_mib]
    return idle[:1]


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
