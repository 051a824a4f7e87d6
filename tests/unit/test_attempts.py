"""A detached job's attempts (submit's retries=, rpycdl.scheduler.attempts): which ends requeue it, the checks of
its options, and the ledger's requeue: one transaction that only the row's owner of that attempt wins, once."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest

import rpycdl
from rpycdl.defaults import ATTEMPT_VARIABLE, MAX_RETRIES
from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import attempts
from rpycdl.scheduler.ledger import JobRecord, JobState, Ledger, new_job_id


def job(retries: int = 1, on_failure: bool = False, **fields) -> JobRecord:
    return JobRecord(job_id=new_job_id(), server_id="s", client="c", ngpus=1, detached=True,
                     request={"retries": retries, "retry_on_failure": on_failure}, **fields)


def test_options_are_checked_saying_what_they_take():
    assert attempts.check(None, None) == (0, False)
    assert attempts.check(3, True) == (3, True)
    assert attempts.check(MAX_RETRIES, False) == (MAX_RETRIES, False)
    for retries, on_failure, said in ((-1, None, "from 0 to 100"), (MAX_RETRIES + 1, None, "from 0 to 100"),
                                      (1.5, None, "whole number"), (True, None, "whole number"),
                                      ("2", None, "whole number"), (1, "yes", "True or False"),
                                      (0, True, "needs retries= of 1 or more")):
        with pytest.raises(InvalidRequestError, match=said):
            attempts.check(retries, on_failure)


def test_which_ends_requeue_a_job():
    killed = job(state=JobState.FAILED, error_type="JobCrashedError")
    assert attempts.cause(killed, crashed=True, signaled=True) == attempts.KILLED
    assert attempts.cause(killed, crashed=True, signaled=False) == attempts.FAILED  # it exited by itself
    raised = job(state=JobState.FAILED, error_type="ValueError")
    assert attempts.cause(raised, crashed=False, signaled=False) == attempts.FAILED
    command = job(state=JobState.FAILED, error_type="CommandFailed", exit_code=-9)
    assert attempts.cause(command, crashed=False, signaled=False) == attempts.KILLED
    for error_type in ("HostMemoryExceededError", "GPUMemoryExceededError", "OutputLimitError", "LimitError",
                       "JobTimeoutError", "JobCancelledError"):
        assert attempts.cause(job(state=JobState.FAILED, error_type=error_type), True, True) is None, error_type
    for state in (JobState.SUCCEEDED, JobState.CANCELLED, JobState.TIMED_OUT):
        assert attempts.cause(job(state=state), crashed=True, signaled=True) is None
    assert attempts.retryable(job(), attempts.KILLED) and attempts.retryable(job(), attempts.LOST)
    assert not attempts.retryable(job(), attempts.FAILED)  # raised: only with retry_on_failure
    assert attempts.retryable(job(on_failure=True), attempts.FAILED)
    assert not attempts.retryable(job(), None)
    assert not attempts.retryable(job(retries=0), attempts.LOST)
    assert not attempts.retryable(job(attempt=2), attempts.LOST)  # retries=1: its second attempt is its last
    assert attempts.retryable(job(retries=2, attempt=2), attempts.LOST)
    assert not attempts.retryable(job(cancel_requested=True), attempts.LOST)
    assert attempts.said(job(retries=3, attempt=2)) == "attempt 2 of 4" and attempts.said(job(retries=0)) == ""


def test_a_requeue_keeps_the_attempt_and_puts_the_row_back_in_waiting_once(tmp_path):
    ledger = Ledger(tmp_path / "state")
    running = job(state=JobState.RUNNING, owner_pid=10, owner_start=20, pgid=30, leader_start=40, started=100.0,
                  gpu_uuids=["GPU-0"], gpus=1.0, log_bytes=5)
    assert ledger.save(running)
    ended = dataclasses.replace(running, state=JobState.LOST, error="its supervisor died", error_type="JobLostError",
                                ended=200.0)
    assert not ledger.requeue(dataclasses.replace(ended, owner_pid=11))  # not the row's owner
    won = []
    threads = [threading.Thread(target=lambda: won.append(Ledger(tmp_path / "state").requeue(ended)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(won) == [False, False, False, True]  # several sweeps at once: one requeue
    row = ledger.get(running.job_id)
    assert (row.state, row.owner_pid, row.pgid, row.started, row.gpu_uuids, row.attempt, row.error) == (
        JobState.PENDING, 0, 0, None, [], 2, "")
    assert row.log_bytes == 5 and row.submitted == running.submitted  # its log and place in history stay
    assert [record.job_id for record in ledger.requeued()] == [running.job_id]
    assert ledger.attempts(running.job_id) == [
        {"attempt": 1, "state": "LOST", "started": 100.0, "ended": 200.0, "error": "its supervisor died",
         "error_type": "JobLostError", "exit_code": None, "gpu_uuids": ["GPU-0"]}]
    assert not ledger.requeue(ended)  # that attempt is over
    ledger.request_cancel(running.job_id)
    assert ledger.end(running.job_id, JobState.CANCELLED, "cancelled", unowned=True)
    assert ledger.requeued() == []
    ledger.delete(running.job_id)
    assert ledger.attempts(running.job_id) == []  # its history goes with its row


def test_a_cancel_asked_stops_a_requeue(tmp_path):
    ledger = Ledger(tmp_path / "state")
    running = job(state=JobState.RUNNING, owner_pid=10, owner_start=20)
    ledger.save(running)
    ledger.request_cancel(running.job_id)
    assert not ledger.requeue(dataclasses.replace(running, state=JobState.FAILED))
    assert ledger.get(running.job_id).state is JobState.RUNNING


def test_attempt_outside_a_job_is_1_and_inside_says_the_variable(monkeypatch):
    monkeypatch.delenv(ATTEMPT_VARIABLE, raising=False)
    assert rpycdl.attempt() == 1
    monkeypatch.setenv(ATTEMPT_VARIABLE, "3")
    assert rpycdl.attempt() == 3 == int(os.environ[ATTEMPT_VARIABLE])
    monkeypatch.setenv(ATTEMPT_VARIABLE, "garbage")
    assert rpycdl.attempt() == 1
