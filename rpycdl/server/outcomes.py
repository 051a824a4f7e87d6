"""How a job's end reads in its ledger row and to its client: the state and error of a job that did not finish
(STATES, ERRORS), and the state, exit code and error of one that ran to its end (judge)."""

from __future__ import annotations

from rpycdl.errors import (
    GPUMemoryExceededError,
    GPUNotGrantedError,
    HostMemoryExceededError,
    IdleReclaimedError,
    JobCancelledError,
    JobCrashedError,
    JobTimeoutError,
    OutputLimitError,
    RemoteError,
)
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.server import commands
from rpycdl.server.runner import Ending
from rpycdl.states import JobState
from rpycdl.wire import codec, untrusted

STATES = {Ending.TIMED_OUT: JobState.TIMED_OUT, Ending.CANCELLED: JobState.CANCELLED, Ending.CRASHED: JobState.FAILED,
          Ending.OVER_MEMORY: JobState.FAILED, Ending.ELSEWHERE: JobState.FAILED, Ending.OVER_OUTPUT: JobState.FAILED,
          Ending.OVER_HOST_MEMORY: JobState.FAILED, Ending.IDLE: JobState.FAILED}
ERRORS = {Ending.TIMED_OUT: JobTimeoutError, Ending.CANCELLED: JobCancelledError, Ending.CRASHED: JobCrashedError,
          Ending.OVER_MEMORY: GPUMemoryExceededError, Ending.ELSEWHERE: GPUNotGrantedError,
          Ending.OVER_OUTPUT: OutputLimitError, Ending.OVER_HOST_MEMORY: HostMemoryExceededError,
          Ending.IDLE: IdleReclaimedError}
"""How a job that did not finish ends: its record's state, and the error its client gets."""


def judge(record: JobRecord, outcome: bytes, command: bool) -> None:
    """Set the row's state, exit code and error from the outcome of a job that ran to its end: a `command` fails
    unless it exits with 0; a callable, if it raised."""
    if not codec.succeeded(outcome):
        record.state = JobState.FAILED
        record.error_type, record.error = untrusted.failure(outcome)
        return
    if command:
        record.exit_code = _exit_code(outcome)  # run_command's own value, read as plain data
        if record.exit_code is None:
            record.state, record.error_type = JobState.FAILED, "UnreadableResult"
            record.error = "the command's exit code could not be read from its job process"
            return
        if record.exit_code:
            record.state, record.error_type = JobState.FAILED, "CommandFailed"
            record.error = commands.describe_exit(record.exit_code)
            return
    record.state = JobState.SUCCEEDED


def _exit_code(outcome: bytes) -> int | None:
    """A command job's exit code from its outcome, None if it holds no int (read as plain data only)."""
    try:
        code = untrusted.outcome(outcome)
    except RemoteError:
        return None
    return code if type(code) is int else None
