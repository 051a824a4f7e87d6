"""A job process or load check that the forkserver could not fork: the forkserver's reply is read when the
process is first needed (forklink.Launched), so its failure is told then, and what holds it closes cleanly."""

from __future__ import annotations

import os
import socket

import pytest

from rpycdl.errors import LimitError
from rpycdl.server import child, forklink, loadcheck, runner


class CouldNotFork:
    """A launcher whose forkserver fails to fork: it lets go of the child's descriptors and closes the control
    socket without a reply, as the forkserver does then (forkserver._Server._fork)."""

    def launch(self, kind: str, fds: list[int]) -> forklink.Launched:
        ours, control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        control.close()
        for fd in fds:
            os.close(fd)
        return forklink.Launched(ours)


def test_a_job_process_never_forked_takes_no_payload_says_why_when_asked_and_closes():
    job = runner.JobProcess(CouldNotFork())  # returns at once: nothing waits for the forkserver here
    assert not job.give(b"payload")  # the job's flow starts one of its own instead
    with pytest.raises(LimitError, match="could not start a process for the job"):
        assert job.identity is None  # never reached: the reply says it could not fork
    job.close()
    job.close()  # twice: harmless


def test_a_load_check_never_forked_closes_without_error():
    check = loadcheck.LoadCheck(CouldNotFork(), child.Go({}, None, b"payload"))
    check.close()
