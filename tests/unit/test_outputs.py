"""What clients see of a job's outputs (rpycdl.server.jobdirs.outputs) on a real ledger, state directory and
store: "uploading" from the job's end until its owner has uploaded them, "failed" when the owner died first."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from rpycdl.gpu.inventory import FakeInventory
from rpycdl.scheduler import procs
from rpycdl.scheduler.ledger import JobRecord, JobState, new_job_id
from rpycdl.server import jobdirs
from rpycdl.server.context import Limits, ServerContext


@pytest.fixture
def context(tmp_path) -> ServerContext:
    return ServerContext(name="pytorch", aliases=("PYTORCH",), inventory=FakeInventory("fake:2"),
                         lock_dir=str(tmp_path), state_dir=str(tmp_path / "state"), server_id="test")


def dead_pid() -> tuple[int, int]:
    """A process that ran and is gone (reaped): its pid, and a start time no process started since has."""
    child = subprocess.Popen(["true"])
    assert child.wait() == 0
    return child.pid, 1


def ended(context: ServerContext, owner: tuple[int, int], *outputs: str) -> JobRecord:
    """A job's row ended (SUCCEEDED) with `owner` as its owning process, and `outputs` in its output directory."""
    record = JobRecord(job_id=new_job_id(), server_id="test", client="127.0.0.1:40000", ngpus=1,
                       owner_pid=owner[0], owner_start=owner[1], user="alice")
    context.ledger.save(record)
    output = context.files.output_dir(record.job_id)
    output.mkdir(parents=True)
    for name in outputs:
        (output / name).write_text(name)
    record.state, record.ended = JobState.SUCCEEDED, time.time()
    context.ledger.save(record)
    return record


def me() -> tuple[int, int]:
    found = procs.stat(os.getpid())
    assert found is not None
    return os.getpid(), found.start


def test_outputs_are_uploading_from_the_jobs_end_until_its_owner_uploaded_them(context):
    record = ended(context, me(), "model.pt")
    assert context.ledger.artifacts(record.job_id) is None  # the row has ended, the upload not begun
    assert jobdirs.outputs(context, record)["state"] == "uploading"
    jobdirs.upload(context, record)
    entry = jobdirs.outputs(context, record)
    assert (entry["state"], entry["files"]) == ("uploaded", [{"name": "model.pt", "size": 8}])


def test_outputs_left_by_an_owner_that_died_are_failed_and_a_retry_sends_them(context):
    record = ended(context, dead_pid(), "model.pt")
    entry = jobdirs.outputs(context, record)
    assert entry["state"] == "failed" and f"rpycdl artifacts {record.job_id} --retry" in entry["error"]
    jobdirs.upload(context, record)  # what `rpycdl artifacts --retry` does
    assert jobdirs.outputs(context, record)["state"] == "uploaded"


def test_no_outputs_and_an_unfinished_job_are_as_the_ledger_says(context):
    empty = ended(context, dead_pid())  # its owner died after its end, leaving an empty directory
    assert jobdirs.outputs(context, empty) == {"state": "none", "files": [], "error": ""}
    running = JobRecord(job_id=new_job_id(), server_id="test", client="127.0.0.1:40000", ngpus=1,
                        state=JobState.RUNNING, owner_pid=me()[0], owner_start=me()[1])
    context.ledger.save(running)
    context.files.output_dir(running.job_id).mkdir(parents=True)
    assert jobdirs.outputs(context, running)["state"] == "none"  # it writes its outputs: nothing uploads yet


def test_the_output_quota_measures_at_most_once_a_second_and_names_its_limit(tmp_path):
    context = ServerContext(name="pytorch", aliases=(), inventory=FakeInventory("fake:1"), lock_dir=str(tmp_path),
                            state_dir=str(tmp_path / "state"), server_id="test", limits=Limits(max_output=100_000))
    now = [0.0]
    quota = jobdirs.OutputQuota(context, "job1", clock=lambda: now[0])
    assert quota.over() is None  # no output directory (yet): nothing
    output = context.files.output_dir("job1")
    output.mkdir(parents=True)
    (output / "a").write_bytes(b"a" * 50_000)
    now[0] = 1.0
    assert quota.over() is None
    (output / "b").write_bytes(b"b" * 60_000)
    now[0] = 1.5
    assert quota.over() is None  # not due: measured a second after the last
    assert "97.7 KiB" in (quota.over(now=True) or "")  # at the job's end, at once
    now[0] = 3.0
    assert quota.over() == ("the job wrote more than 97.7 KiB into its output directory, the server's "
                            "--max-output")
    (output / "b").unlink()
    (output / "link").symlink_to(tmp_path / "state")  # what it names is not the job's
    now[0] = 5.0
    assert quota.over() is None
