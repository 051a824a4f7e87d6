"""Preemption on paper (rpycdl.scheduler.preemption): which jobs a waiting job of a higher priority preempts (the
fewest, youngest, of lower priorities only, none marked by another), decided once per waiting job, and the marks'
life in the lock directory."""

from __future__ import annotations

from pathlib import Path

from rpycdl.scheduler import preemption
from rpycdl.scheduler.policies import OFF, REQUEUE, Decision, Scheduling

ON = Scheduling(preempt=REQUEUE, preempt_grace=2.0)


def _held(*grants: tuple[str, str, int, float]) -> dict:
    """Records by GPU of grants (uuid, job id, priority, since)."""
    found: dict = {}
    for ticket, (uuid, job_id, priority, since) in enumerate(grants, 1):
        found.setdefault(uuid, []).append((Path(f"{uuid}.{ticket}.json"), {
            "job_id": job_id, "priority": priority, "since": since, "ticket": ticket}))
    return found


def test_the_fewest_youngest_lower_priority_holders_are_chosen_for_the_gpus_it_lacks():
    held = _held(("A", "old", 0, 10.0), ("B", "young", 0, 50.0), ("C", "two-a", 0, 60.0), ("C", "two-b", 0, 70.0),
                 ("D", "high", 5, 80.0))
    assert list(preemption.choose(held, ["A", "B", "C", "D"], 1, 3, set())) == ["young"]
    assert sorted(preemption.choose(held, ["A", "B", "C", "D"], 2, 3, set())) == ["old", "young"]
    assert sorted(preemption.choose(held, ["A", "B", "C", "D"], 3, 3, set())) == ["old", "two-a", "two-b", "young"]
    assert preemption.choose(held, ["A", "B", "C", "D"], 4, 3, set()) == {}  # D's holder is of a higher priority
    assert preemption.choose(held, ["A", "E"], 1, 3, set()) == {}  # E is free: nothing to preempt
    assert list(preemption.choose(held, ["A", "B"], 1, 3, {"young"})) == ["old"]  # young is someone else's victim


def test_nothing_of_an_equal_or_higher_priority_is_ever_chosen():
    held = _held(("A", "same", 3, 10.0), ("B", "higher", 4, 20.0))
    assert preemption.choose(held, ["A", "B"], 1, 3, set()) == {}


def test_a_waiting_job_marks_its_victims_once_and_a_mark_whose_job_let_go_is_removed(tmp_path):
    held = _held(("A", "victim", 0, 10.0))
    me, entry = {"job_id": "urgent", "user": "alice", "priority": 5}, {"candidates": ["A"], "ngpus": 1}
    assert preemption.consider(tmp_path, Scheduling(preempt=OFF), lambda: held, me, entry, Decision()) == []
    assert preemption.consider(tmp_path, ON, lambda: held, me, entry, Decision(ahead=1)) == []  # not its turn
    assert preemption.consider(tmp_path, ON, lambda: held, me, entry, Decision()) == ["victim"]
    mark = preemption.mark_of(tmp_path, "victim")
    assert (mark["by"], mark["priority"], mark["ticket"], mark["grace"], mark["mode"]) == ("urgent", 5, 1, 2.0,
                                                                                           REQUEUE)
    assert preemption.consider(tmp_path, ON, lambda: held, me, entry, Decision()) == []  # decided already
    other = {"job_id": "second", "priority": 7}
    assert preemption.consider(tmp_path, ON, lambda: held, other, entry, Decision()) == []  # marked: not twice
    assert preemption.consider(tmp_path, ON, dict, other, entry, Decision()) == []  # the victim let go
    assert preemption.mark_of(tmp_path, "victim") is None
