"""Each user's and group's use against the limits in force (rpycdl.scheduler.limits.standing), from a lock
directory's copy of the limits, a snapshot's grants and queue and a ledger's rows by a clock the test sets; and how
the client shows it and a job held back (rpycdl.client.displays, `rpycdl status`)."""

from __future__ import annotations

from pathlib import Path

from rpycdl.cli.status import _limits
from rpycdl.client import displays
from rpycdl.scheduler import limits
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.states import JobState

LAB = {"default": {"gpus": 2, "pending": 10},
       "users": {"alice": {"gpus": 4, "gpu_hours_week": 300}, "dana": {"gpus": 1}},
       "groups": {"vision": {"members": ["alice", "bob"], "gpus": 5, "gpu_hours_day": 60}}}
NOW = 1_800_000_000.0


def _ledger(tmp_path: Path) -> Ledger:
    """alice ran 2 GPUs for 3 hours ending 2 days ago, and runs 1 GPU since an hour ago; erin ran 8 days ago."""
    ledger = Ledger(str(tmp_path / "state"))
    for job_id, user, gpus, started, ended in (("old", "alice", 2, NOW - 51 * 3600, NOW - 48 * 3600),
                                               ("now", "alice", 1, NOW - 3600, None),
                                               ("gone", "erin", 1, NOW - 9 * 86400, NOW - 8 * 86400)):
        ledger.save(JobRecord(job_id, "pytorch", "127.0.0.1:1", gpus, submitted=started, started=started, ended=ended,
                              state=JobState.RUNNING if ended is None else JobState.SUCCEEDED, user=user,
                              gpus=float(gpus)))
    return ledger


def test_standing_counts_each_user_and_group_against_their_limits(tmp_path):
    root = tmp_path / "locks"
    root.mkdir()
    snapshot = {"held": {"gpu-0": [{"account": "alice", "since": NOW - 3600, "gpus": 1.0}],
                         "gpu-1": [{"account": "carol", "since": NOW - 60, "gpus": 0.5},
                                   {"account": "bob", "since": NOW - 60, "gpus": 0.5}]},
                "queue": [{"account": "bob"}, {"account": "alice"}, {"account": "bob"}]}
    ledger = _ledger(tmp_path)
    assert limits.standing(root, snapshot, ledger, NOW) is None  # no limits in force
    limits.publish(root, limits.load(LAB, "lab.toml"), "lab.toml")
    rows = {f"{row['kind']}:{row['name']}": row for row in limits.standing(root, snapshot, ledger, NOW)}
    assert list(rows) == ["user:alice", "user:bob", "user:carol", "user:dana", "group:vision"]  # erin: too long ago
    alice, bob, vision = rows["user:alice"], rows["user:bob"], rows["group:vision"]
    assert alice["limits"] == {"gpus": 4, "pending": 10, "gpu_hours_week": 300}  # her table, else the default
    assert (alice["gpus"], alice["pending"], alice["gpu_hours_day"], alice["gpu_hours_week"]) == (1, 1, 1, 7)
    assert (bob["gpus"], bob["pending"], bob["limits"]) == (0.5, 2, {"gpus": 2, "pending": 10})
    assert rows["user:dana"]["limits"] == {"gpus": 1, "pending": 10} and rows["user:dana"]["gpus"] == 0
    assert vision["members"] == ["alice", "bob"] and vision["limits"] == {"gpus": 5, "gpu_hours_day": 60}
    assert (vision["gpus"], vision["pending"], vision["gpu_hours_day"]) == (1.5, 3, 1)


def test_the_client_shows_use_against_limits_and_why_a_job_waits():
    alice = {"kind": "user", "name": "alice", "members": ["alice"], "gpus": 1.0, "pending": 2, "gpu_hours_day": 1.25,
             "gpu_hours_week": 7.0, "limits": {"gpus": 1.0, "gpu_hours_week": 300.0}}
    vision = {**alice, "kind": "group", "name": "vision", "members": ["alice", "bob"], "limits": {}}
    assert displays.standing_cells(alice) == ["alice", "1 / 1", "1.2", "7.0 / 300.0", "2"]
    assert displays.standing_cells(vision)[0] == "group vision (alice, bob)"
    assert _limits(None) == [] and "nobody holds" in _limits([])[0]
    header, first = _limits([alice, vision])[1:3]
    assert header.split()[:3] == ["USER", "GPUS", "HELD"] and first.split()[:4] == ["alice", "1", "/", "1"]
    waiting = {"job_id": "3f2a", "state": "PENDING", "reason": "alice holds 1 GPU", "ahead": 0, "holders": []}
    assert displays.held_back(waiting) == "held back: alice holds 1 GPU"
    assert displays.job_cells(waiting)[-1] == "held back: alice holds 1 GPU"
    assert displays.held_back({**waiting, "state": "RUNNING"}) == ""
    assert "<td>held back: alice holds 1 GPU</td>" in displays.jobs_html([waiting])
    status = {"server": {}, "gpus": [], "queue": [{"job_id": "3f2a", "since": None, "reason": "alice holds 1 GPU"}],
              "limits": [alice]}
    shown = displays.status_html(status)
    assert "alice holds 1 GPU" in shown and "<td>1 / 1</td>" in shown
    assert "limits in force" not in displays.status_html({**status, "limits": None})
