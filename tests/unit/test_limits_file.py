"""The limits file (rpycdl.scheduler.limits): tables checked at load, who a limit binds, why a request over one
waits, GPU-hours over rolling windows by a clock the test sets, and the policies passing over such a request."""

from __future__ import annotations

import pytest

from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import limits, policies
from rpycdl.scheduler.limits import DAY, Limit, Limits, Tally
from rpycdl.scheduler.planning import Room
from rpycdl.scheduler.policies import Rules, Want

LAB = {"default": {"gpus": 2, "pending": 10},
       "users": {"alice": {"gpus": 4}, "carol": {"gpu_hours_day": 10}},
       "groups": {"vision": {"members": ["alice", "bob"], "gpus": 5}}}


def test_a_lab_file_loads_and_binds_each_user_by_their_table_else_the_default_and_their_groups():
    lab = limits.load(LAB, "lab.toml")
    assert [bound.where for bound in lab.bounds("alice", "gpus")] == ["users.alice.gpus", "groups.vision.gpus"]
    assert [bound.where for bound in lab.bounds("bob", "gpus")] == ["default.gpus", "groups.vision.gpus"]
    assert [bound.where for bound in lab.bounds("carol", "gpus")] == ["default.gpus"]  # her table lacks gpus
    assert lab.bounds("bob", "gpus")[1].members == ("alice", "bob")
    assert lab.has("gpu_hours_day") and not lab.has("gpu_hours_week")
    assert limits.from_dict(lab.to_dict()) == lab


@pytest.mark.parametrize(("data", "words"), [
    ({"defaults": {}}, "unknown table(s) defaults"),
    ({"default": {"gpu": 1}}, "unknown key(s) gpu in [default]"),
    ({"users": {"alice": {"gpus": "two"}}}, "users.alice.gpus must be a number"),
    ({"users": {"alice": {"gpus": -1}}}, "users.alice.gpus must be a number, 0 or more, not -1"),
    ({"default": {"pending": 2.5}}, "default.pending must be a whole number"),
    ({"default": {"gpus": True}}, "default.gpus must be a number"),
    ({"groups": {"vision": {"gpus": 4}}}, "groups.vision.members must be a list"),
    ({"users": {"alice": 3}}, "[users] holds one table per name"),
])
def test_a_bad_file_is_refused_naming_what_is_wrong(data, words):
    with pytest.raises(InvalidRequestError) as refused:
        limits.load(data, "lab.toml")
    assert "lab.toml" in str(refused.value) and words in str(refused.value)


def test_a_file_that_is_not_toml_is_refused_by_name(tmp_path):
    bad = tmp_path / "limits.toml"
    bad.write_text("[users.alice\ngpus = 1\n")
    with pytest.raises(InvalidRequestError, match=f"the limits file {bad} is not TOML"):
        limits.read(bad)


def test_a_request_over_its_owners_gpus_or_its_groups_says_why():
    lab = limits.load(LAB, "lab.toml")
    tally = Tally(lab, {"alice": 4.0, "bob": 0.5})
    assert tally.over("alice", 1) == "alice holds 4 GPUs, the limit of users.alice.gpus = 4"
    assert tally.over("bob", 0.5) == ""  # 4.5 of the group's 5 would be held
    assert tally.over("bob", 1) == ("group vision (alice, bob) holds 4.5 GPUs and asks 1 GPU more, the limit of "
                                    "groups.vision.gpus = 5")
    tally.take("dave", 2)
    assert "dave holds 2 GPUs, the limit of default.gpus = 2" == tally.over("dave", 0.25)


def test_gpu_hours_hold_over_a_simulated_day():
    """Carol may use 10 GPU-hours a rolling day: the ledger's rows, read at times the test chooses."""
    lab = limits.load(LAB, "lab.toml")
    start = 1_000_000.0
    ran = [("carol", start, start + 3 * 3600, 4.0), ("bob", start, None, 1.0)]  # 12 GPU-hours, and bob's running
    def reason(now: float) -> str:
        used = {"gpu_hours_day": limits.window_usage(ran, now - DAY, now)}
        return Tally(lab, {}, used).over("carol", 1)
    assert reason(start + 2 * 3600) == ""  # 8 GPU-hours so far
    assert reason(start + 4 * 3600) == ("carol used 12.0 GPU-hours in the last day, the limit of "
                                        "users.carol.gpu_hours_day = 10")
    assert reason(start + DAY + 0.5 * 3600) != ""  # 10 of the 12 still within the day
    assert reason(start + DAY + 3600) == ""  # 8: the first hour left the window
    assert limits.window_usage(ran, start + DAY, start + DAY + 3600)["bob"] == pytest.approx(3600)


def test_a_request_over_its_limit_is_passed_over_and_reserves_nothing():
    gpus = ("a", "b")
    rooms = {"a": Room(True, 100), "b": Room(False, 0)}
    alice, bob = Want(1, 1, 0, gpus, account="alice"), Want(2, 1, 0, gpus, account="bob")
    lab = limits.load({"users": {"alice": {"gpus": 1}}}, "lab.toml")
    without = policies.decide(rooms, [alice, bob], bob, Rules())
    assert not without.uuids  # first come, first served: alice's request goes first
    decision = policies.decide(rooms, [alice, bob], bob, Rules(), limits=Tally(lab, {"alice": 1.0}))
    assert decision.uuids == ("a",) and decision.ahead == 0
    held_back = policies.decide(rooms, [alice, bob], alice, Rules(), limits=Tally(lab, {"alice": 1.0}))
    assert not held_back.uuids and held_back.reason == "alice holds 1 GPU, the limit of users.alice.gpus = 1"


def test_a_users_earlier_request_counts_against_the_later_one_in_the_same_walk():
    gpus = ("a", "b")
    rooms = {"a": Room(True, 100), "b": Room(True, 100)}
    first, second = Want(1, 1, 0, gpus, account="alice"), Want(2, 1, 0, gpus, account="alice")
    lab = limits.load({"users": {"alice": {"gpus": 1}}}, "lab.toml")
    decision = policies.decide(rooms, [first, second], second, Rules(), limits=Tally(lab, {}))
    assert not decision.uuids and "alice holds 1 GPU" in decision.reason


def test_pending_and_impossible_requests_are_refused_at_submit(tmp_path):
    limits.publish(tmp_path, Limits(Limit(gpus=2, pending=1)), "lab.toml")
    queue = [{"job_id": "j1", "account": "alice"}]
    limits.check_request(tmp_path, "alice", 1, lambda: queue, "j1")  # her own entry is not counted
    with pytest.raises(LimitError, match=r"alice has 1 job\(s\) waiting, the limit of default.pending = 1"):
        limits.check_request(tmp_path, "alice", 1, lambda: queue)
    with pytest.raises(LimitError, match="alice asks 3 GPUs, more than the limit of default.gpus = 2"):
        limits.check_request(tmp_path, "alice", 3, lambda: [])
    (tmp_path / limits.IN_FORCE).unlink()
    limits.check_request(tmp_path, "alice", 3, lambda: queue)  # no limits in force
