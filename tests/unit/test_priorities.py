"""Priorities on paper (rpycdl.scheduler.priorities, policies.order and decide): a request's priority checked, each
user's ceiling from the limits file, and every policy ordering by priority first, so that a later request of a higher
priority goes before earlier ones of lower priorities, while those of one priority keep their order."""

from __future__ import annotations

import pytest

from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import limits, priorities
from rpycdl.scheduler.planning import Room
from rpycdl.scheduler.policies import BACKFILL, FAIR, FCFS, Rules, Want, decide, order
from rpycdl.scheduler.queuedir import QueueDir, in_line

GPUS = ("GPU-0",)


@pytest.mark.parametrize("value", [True, 2.0, "3", 11, -11, [1]])
def test_a_priority_that_is_no_whole_number_from_minus_10_to_10_is_refused_by_name(value):
    with pytest.raises(InvalidRequestError) as refused:
        priorities.check(value)
    assert f"priority={value!r}: must be a whole number from -10 to 10" in str(refused.value)


def test_a_priority_in_range_is_taken_as_it_is_and_none_is_0():
    assert [priorities.check(value) for value in (None, -10, 0, 7, 10)] == [0, -10, 0, 7, 10]


def test_the_ceiling_is_the_users_own_else_the_default_raised_by_their_groups_and_0_without_a_file():
    lab = limits.load({"default": {"priority": 1}, "users": {"alice": {"priority": 3}, "dan": {"gpus": 2}},
                       "groups": {"deadline": {"members": ["bob"], "priority": 6}}}, "lab.toml")
    assert priorities.ceiling(lab, "alice") == (3, "users.alice.priority")
    assert priorities.ceiling(lab, "dan") == (1, "default.priority")
    assert priorities.ceiling(lab, "bob") == (6, "groups.deadline.priority")
    assert priorities.ceiling(None, "alice")[0] == 0


def test_a_priority_above_the_ceiling_is_refused_naming_it_and_where_it_is_set(tmp_path):
    limits.publish(tmp_path, limits.load({"users": {"alice": {"priority": 3}}}, "lab.toml"), "lab.toml")
    priorities.allow(tmp_path, "alice", 3)
    priorities.allow(tmp_path, "bob", -5)  # below the default: anyone
    priorities.allow(tmp_path, "bob", 9, admin=True)
    with pytest.raises(LimitError) as refused:
        priorities.allow(tmp_path, "alice", 4)
    assert "priority=4: alice may ask at most 3 (users.alice.priority)" in str(refused.value)
    with pytest.raises(LimitError, match=r"bob may ask at most 0 \(the default"):
        priorities.allow(tmp_path, "bob", 1)


@pytest.mark.parametrize("value", [-1, 11, 2.5, True])
def test_a_limits_file_priority_is_a_whole_number_from_0_to_10(value):
    with pytest.raises(InvalidRequestError, match="users.alice.priority must be a whole number, 0 up to 10"):
        limits.load({"users": {"alice": {"priority": value}}}, "lab.toml")


@pytest.mark.parametrize("policy", [FCFS, BACKFILL, FAIR])
def test_every_policy_orders_by_priority_first_then_as_without(policy):
    wants = [Want(1, 1, 0, GPUS, account="a"), Want(2, 1, 0, GPUS, account="b", priority=5),
             Want(3, 1, 0, GPUS, account="a", priority=-2), Want(4, 1, 0, GPUS, account="a", priority=5)]
    assert [want.ticket for want in order(wants, policy, {"a": 0.0, "b": 10.0})] == [4, 2, 1, 3] \
        if policy == FAIR else [2, 4, 1, 3]


@pytest.mark.parametrize("policy", [FCFS, BACKFILL, FAIR])
def test_a_later_request_of_a_higher_priority_is_granted_before_the_earlier_ones(policy):
    earlier = [Want(ticket, 1, 0, GPUS, account="a") for ticket in (1, 2, 3)]
    urgent = Want(4, 1, 0, GPUS, account="b", priority=5)
    waiting = order([*earlier, urgent], policy)
    rooms = {"GPU-0": Room(True, 16)}
    assert decide(rooms, waiting, urgent, Rules(policy)).uuids == GPUS
    assert all(not decide(rooms, waiting, want, Rules(policy)).uuids for want in earlier)


def test_a_requeued_job_is_ordered_at_its_place_among_its_priority_and_marked_for_fcfs(tmp_path):
    wants = [Want(5, 1, 0, GPUS), Want(9, 1, 0, GPUS, place=3), Want(7, 1, 0, GPUS, priority=1)]
    assert [want.ticket for want in order(wants, FCFS)] == [7, 9, 5]  # priority first, then place or ticket
    queue = QueueDir(tmp_path)
    for folder in ("queue", "rows", "ranked"):
        (tmp_path / folder).mkdir()
    for ticket, extra in ((5, {}), (9, {"place": 3}), (11, {"priority": 2}), (12, {})):
        queue.write(ticket, {"job_id": f"job{ticket}", "row": True, **extra})
    assert sorted(path.name for path in (tmp_path / "ranked").iterdir()) == [f"{9:016d}", f"{11:016d}"]
    assert [entry["ticket"] for entry in queue.competing(5, in_line({"ticket": 5}), everyone=False)] == [9, 11]
    assert [entry["ticket"] for entry in queue.competing(12, in_line({"ticket": 12}), everyone=False)] == [5, 9, 11]
    assert queue.placed(9, {"job_id": "job9"})["place"] == 3 and "place" not in queue.placed(5, {})
    queue.remove(9)
    assert sorted(path.name for path in (tmp_path / "ranked").iterdir()) == [f"{11:016d}"]
