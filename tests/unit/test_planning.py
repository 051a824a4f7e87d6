"""Grants planned on paper (rpycdl.scheduler.planning): rooms, picks and the ranges a share locks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rpycdl.scheduler import planning
from rpycdl.scheduler.planning import Room

SIZE = 1024  # MiB


def test_an_untouched_gpu_is_idle_and_a_held_one_is_not():
    rooms = planning.rooms({"a": [], "b": [(0, 0)]}, {"a": SIZE, "b": SIZE}, fractional=False)
    assert rooms == {"a": Room(True, SIZE), "b": Room(False, 0)}


def test_free_mib_are_counted_only_when_a_share_is_involved():
    taken = {"a": [(0, 256), (512, 128)]}
    assert planning.rooms(taken, {"a": SIZE}, fractional=True)["a"] == Room(False, SIZE - 384)
    assert planning.rooms(taken, {"a": SIZE}, fractional=False)["a"] == Room(False, 0)


def test_whole_gpus_go_to_the_first_idle_candidates_or_not_at_all():
    rooms = {"a": Room(False, 0), "b": Room(True, SIZE), "c": Room(True, SIZE)}
    assert planning.pick(rooms, 2, 0, ["a", "b", "c"]) == ["b", "c"]
    assert planning.pick(rooms, 3, 0, ["a", "b", "c"]) == []
    assert planning.pick(rooms, 1, 0, ["c", "b"]) == ["c"]  # candidates' order, not the rooms'


def test_a_share_goes_to_the_fullest_shared_gpu_with_room_before_an_idle_one():
    rooms = {"idle": Room(True, SIZE), "roomy": Room(False, 900), "tight": Room(False, 300), "full": Room(False, 10)}
    assert planning.pick(rooms, 1, 256, list(rooms)) == ["tight"]
    assert planning.pick(rooms, 1, 512, list(rooms)) == ["roomy"]
    assert planning.pick(rooms, 1, 950, list(rooms)) == ["idle"]
    assert planning.pick(rooms, 1, 2048, list(rooms)) == []


def test_take_plans_what_a_grant_takes():
    rooms = {"a": Room(True, SIZE), "b": Room(True, SIZE)}
    planning.take(rooms, ["a"], 256)
    planning.take(rooms, ["b"], 0)
    assert rooms == {"a": Room(False, SIZE - 256), "b": Room(False, 0)}


@given(st.lists(st.integers(1, 200), max_size=8), st.data())
def test_fit_locks_exactly_the_share_in_free_mib_of_the_gpu(lengths, data):
    taken, at = [], 0
    for length in lengths:  # ranges held by others, with gaps between them
        at += data.draw(st.integers(0, 60))
        if at + length > SIZE:
            break
        taken.append((at, length))
        at += length
    free = SIZE - sum(length for _, length in taken)
    if free == 0:
        return
    share = data.draw(st.integers(1, free))
    ranges = planning.fit(taken, SIZE, share)
    assert sum(length for _, length in ranges) == share
    cells = [cell for start, length in ranges for cell in range(start, start + length)]
    held = {cell for start, length in taken for cell in range(start, start + length)}
    assert len(cells) == len(set(cells)) and all(0 <= cell < SIZE for cell in cells)
    assert not held & set(cells)


def test_fit_prefers_the_smallest_gap_that_holds_the_whole_share():
    taken = [(0, 100), (300, 100), (450, 500)]  # gaps: 100 MiB at 100, 50 at 400, 74 at 950
    assert planning.fit(taken, SIZE, 60) == [(950, 60)]
    assert planning.fit(taken, SIZE, 50) == [(400, 50)]
