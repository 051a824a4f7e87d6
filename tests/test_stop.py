"""Stopping a server like a daemon (issue 35, item 3): SIGTERM to `rpycdl serve` stops it accepting; the
connections it served refuse new jobs (ServerStoppingError, "server stopping"), what runs on them finishes, or
is cancelled once --drain-timeout has passed, and detached jobs are not touched. Real servers and clients."""

from __future__ import annotations

import pytest
from helpers import Background, gate_job, open_gate, refusal, wait_until

import rpycdl

pytestmark = pytest.mark.slow


def test_a_stopped_servers_connections_refuse_new_jobs_and_finish_what_runs(cluster, tmp_path):
    server, port = cluster.add_server("pytorch", "fake:2")
    gate, detached_gate = tmp_path / "gate", tmp_path / "detached-gate"
    with rpycdl.connect(host="127.0.0.1", port=port) as idle, rpycdl.connect(host="127.0.0.1", port=port) as busy:
        assert idle.root.run_code(lambda x: x + 1, 1) == 2  # a connection that ran a job, open and idle
        detached = idle.root.submit(gate_job(str(detached_gate)), "detached")
        wait_until(lambda: detached.status().state is rpycdl.JobState.RUNNING, what="the detached job to run")
        running = Background(busy, gate_job(str(gate)), "attached")
        running.wait_state("running")
        server.stop()  # SIGTERM, and its exit waited for
        assert server.popen.returncode == 0 and any("stopped" in line for line in server.lines), server.lines[-3:]
        for new_job in (lambda: idle.root.run_code(lambda x: x, 3), lambda: idle.root.submit(lambda x: x, 4),
                        lambda: idle.root.session().open()):
            with pytest.raises(rpycdl.ServerStoppingError, match="server stopping"):
                new_job()
        assert not running.done  # what runs goes on
        open_gate(str(gate))
        assert running.result() == "attached"
        open_gate(str(detached_gate))
        assert detached.wait(60).state is rpycdl.JobState.SUCCEEDED and detached.result() == "detached"


def test_what_runs_past_the_drain_timeout_is_cancelled_and_its_gpus_go_back(cluster, tmp_path):
    server, port = cluster.add_server("pytorch", "fake:1", "--drain-timeout", "1s")
    with rpycdl.connect(host="127.0.0.1", port=port) as busy:
        running = Background(busy, gate_job(str(tmp_path / "never")), None)  # it would wait for ever
        running.wait_state("running")
        server.stop()
        error = refusal(lambda: running.result(timeout=120))
    assert isinstance(error, rpycdl.JobCancelledError) and "--drain-timeout" in str(error), repr(error)
    _, other = cluster.add_server("pytorch", "fake:1")  # the server started in its place runs the next job
    with rpycdl.connect(host="127.0.0.1", port=other) as after:
        assert after.root.run_code(lambda x: x * 2, 21, queue_timeout=30) == 42
