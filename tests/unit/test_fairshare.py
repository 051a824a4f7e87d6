"""Fair share's arithmetic and its snapshot: decayed GPU-seconds, a site's settings, and snapshots made
from a real ledger in steps that add up to one made at once."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import fairshare
from rpycdl.scheduler.fairshare import FairShare, Snapshot
from rpycdl.scheduler.ledger import JobRecord, JobState, Ledger


def test_usage_decays_by_half_every_half_life():
    assert fairshare.used(0, 10, 2, 10, 1e12) == pytest.approx(20)  # no decay to speak of: GPU-seconds
    recent = fairshare.used(0, 10, 1, 10, 100)
    assert fairshare.used(0, 10, 1, 110, 100) == pytest.approx(recent / 2)
    assert fairshare.used(0, None, 1, 10, 100) == pytest.approx(recent)  # still running at 10
    assert fairshare.used(5, 3, 1, 10, 100) == 0  # nothing between an end before the start
    assert fairshare.decayed(8, 0, 300, 100) == pytest.approx(1)


@settings(max_examples=2 * settings.default.max_examples, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.floats(0, 90), st.floats(0, 30), st.sampled_from([0.25, 1, 2])),
                max_size=12),
       st.lists(st.floats(0, 120), min_size=1, max_size=4))
def test_snapshots_made_in_steps_add_up_to_one_made_at_once(jobs, moments):
    half_life = 60.0
    runs = [(account, start, start + length, gpus) for account, start, length, gpus in jobs]
    end = 130.0
    at_once = fairshare.step(None, runs, end, half_life)
    previous = None
    for moment in sorted(moments) + [end]:
        seen = [(account, start, stop if stop <= moment else None, gpus) for account, start, stop, gpus in runs
                if start < moment]  # what a ledger says at `moment`: running ones have no end yet
        previous = fairshare.step(previous, seen, moment, half_life)
    assert previous.usage == pytest.approx(at_once.usage)


def test_a_snapshot_from_a_real_ledger(tmp_path):
    ledger = Ledger(tmp_path / "state")
    rows = [("alice", 1000.0, 1100.0, 2.0, JobState.SUCCEEDED), ("bob", 1050.0, None, 0.5, JobState.RUNNING),
            ("alice", 900.0, None, 1.0, JobState.CANCELLED)]  # cancelled while it waited: it never ran
    for user, started, ended, gpus, state in rows:
        ledger.save(JobRecord(f"{user}{started:.0f}", "s", "c", 1, user=user, state=state, gpus=gpus,
                              started=started if state is not JobState.CANCELLED else None, ended=ended or
                              (1200.0 if state.finished else None)))
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    settings_ = FairShare(half_life=3600.0)
    first = fairshare.refresh(lock_dir, ledger, settings_, now=1150.0)
    assert fairshare.read_snapshot(lock_dir) == first
    assert first.usage["alice"] == pytest.approx(fairshare.used(1000, 1100, 2, 1150, 3600))
    assert first.usage["bob"] == pytest.approx(fairshare.used(1050, None, 0.5, 1150, 3600))
    bob = ledger.get("bob1050")
    bob.state, bob.ended = JobState.SUCCEEDED, 1180.0
    ledger.save(bob)
    second = fairshare.refresh(lock_dir, ledger, settings_, now=1200.0)
    assert second.usage["bob"] == pytest.approx(fairshare.used(1050, 1180, 0.5, 1200, 3600))
    assert second.usage["alice"] == pytest.approx(fairshare.used(1000, 1100, 2, 1200, 3600))
    # and with grants running since the snapshot, weighted
    usage = fairshare.usage(second, [("carol", 1190.0, 1.0), ("bob", 1150.0, 1.0)],
                            FairShare(3600.0, {"bob": 2.0}), now=1210.0)
    assert usage["carol"] == pytest.approx(fairshare.used(1200, None, 1, 1210, 3600))
    assert usage["bob"] == pytest.approx((fairshare.decayed(second.usage["bob"], 1200, 1210, 3600)
                                          + fairshare.used(1200, None, 1, 1210, 3600)) / 2)


def test_a_sites_settings_are_checked():
    assert fairshare.load_settings({"half_life": "12h", "weights": {"alice": 2}}, "f") == FairShare(
        43200.0, {"alice": 2.0})
    assert fairshare.load_settings({}, "f") == FairShare()
    for data, words in (({"halflife": "1d"}, "unknown setting"), ({"half_life": "soon"}, "half_life"),
                        ({"weights": {"bob": 0}}, "weight of 'bob'"), ({"weights": {"bob": True}}, "weight"),
                        ({"weights": [1]}, "table"), ({"weights": {"bob": math.inf}}, "weight")):
        with pytest.raises(InvalidRequestError, match=words):
            fairshare.load_settings(data, "site.toml")


def test_a_damaged_snapshot_reads_as_none(tmp_path):
    (tmp_path / fairshare.SNAPSHOT).write_text('{"at": "soon"}')
    assert fairshare.read_snapshot(tmp_path) is None
    assert fairshare.usage(None, [("a", 0.0, 1.0)], FairShare(), now=10.0)["a"] == pytest.approx(10, rel=1e-3)
    assert Snapshot(1.0, {}) == Snapshot(1.0, {})
