"""Grants planned on paper, for rpycdl.locks: which GPUs a request would get now, and which MiB
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


def pick(rooms: dict[str, Room], count: int, memory: int, candidates: Sequence[str]) -> list[str]:
    """The GPUs a request would get now ([] if none): the first idle ones for whole GPUs; for a
    share, the fullest GPU already shared that has room, else the first idle one large enough."""
    if not memory:
        idle = [uuid for uuid in candidates if rooms[uuid].idle]
        return idle[:count] if len(idle) >= count else []
    shared = [uuid for uuid in candidates if not rooms[uuid].idle and rooms[uuid].free >= memory]
    if shared:
        return [min(shared, key=lambda uuid: rooms[uuid].free)]
    idle = [uuid for uuid in candidates if rooms[uuid].idle and rooms[uuid].free >= memory]
    return idle[:1]


def take(rooms: dict[str, Room], uuids: list[str], memory: int) -> None:
    for uuid in uuids:
        rooms[uuid] = Room(False, rooms[uuid].free - memory if memory else 0)


def fit(taken: list[Range], size: int, memory: int) -> list[Range]:
    """Free ranges of a GPU of `size` MiB to lock for `memory` MiB: the smallest gap that fits,
    else gaps in order."""
    gaps, at = [], 0
    for start, length in sorted(taken):
        if start > at:
            gaps.append((at, start - at))
        at = max(at, start + length)
    if at < size:
        gaps.append((at, size - at))
    fitting = [gap for gap in gaps if gap[1] >= memory]
    if fitting:
        start, _ = min(fitting, key=lambda gap: gap[1])
        return [(start, memory)]
    ranges, left = [], memory
    for start, length in gaps:
        ranges.append((start, min(length, left)))
        left -= ranges[-1][1]
        if not left:
            return ranges
    raise InvalidRequestError(f"no room for {memory} MiB")  # pick checked the room: cannot happen

