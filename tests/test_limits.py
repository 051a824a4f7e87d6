"""Server limits: each refusal is a clear error naming the limit, and the server goes on serving."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    Background,
    connection_processes,
    gate_job,
    open_gate,
    refusal,
    server_pid,
    wait_until,
    write_user_map,
)

import rpycdl
from rpycdl import JobState
from rpycdl.site.local import LocalCluster


def test_a_payload_over_the_limit_is_refused_by_name(server, connect):
    conn = connect(server("pytorch", "fake:1", "--max-payload", "1MiB"))
    with pytest.raises(rpycdl.LimitError, match="--max-payload"):
        conn.root.run_code(lambda blob: len(blob), b"x" * (2 << 20))
    assert conn.root.run_code(lambda blob: len(blob), b"x" * 1000) == 1000


def test_a_frame_over_the_limit_drops_only_that_connection(server, connect):
    port = server("pytorch", "fake:1", "--max-payload", "1MiB")
    raw = connect(port)
    with pytest.raises(EOFError):
        raw._conn.root.run(b"x" * (3 << 20), 1)  # what a client that does not check would send
    assert connect(port).root.run_code(lambda x: x, "still serving") == "still serving"


def test_a_full_queue_refuses_by_name(server, connect, tmp_path):
    port = server("pytorch", "fake:1", "--max-queued", "1")
    gate = str(tmp_path / "gate")
    holder = Background(connect(port), gate_job(gate), "held")
    holder.wait_state("running")
    waiter = Background(connect(port), lambda x: x, "waited")
    waiter.wait_state("pending")
    with pytest.raises(rpycdl.LimitError, match=r"queue is full.*--max-queued"):
        connect(port).root.run_code(lambda x: x, "refused")
    open_gate(gate)
    assert holder.result() == "held" and waiter.result() == "waited"


def test_an_idle_connection_is_closed_and_others_are_served(server, cluster, connect):
    port = server("pytorch", "fake:1", "--idle-timeout", "1")
    pid = server_pid(cluster, port)
    idle = connect(port)
    first = idle._conn  # its RPyC connection now
    wait_until(lambda: len(connection_processes(pid)) == 1, what="the connection process")
    wait_until(lambda: not connection_processes(pid), 30, "the server to close the idle connection")
    assert idle.root.run_code(lambda x: x, 1) == 1  # the server closed it: the next call opened it again
    assert first.closed and idle._conn is not first
    busy = connect(port)
    assert busy.root.run_code(lambda seconds: __import__("time").sleep(seconds) or "long job", 2) == "long job"


def test_a_users_full_share_of_the_queue_refuses_by_name_and_others_still_wait(server, team, tmp_path):
    port = server("pytorch", "fake:1", "--max-queued-per-user", "1", *team.server_args())

    def as_user(name: str) -> rpycdl.Connection:
        return rpycdl.connect(host="127.0.0.1", port=port, **team.user(name))

    gate = str(tmp_path / "gate")
    holder = Background(as_user("alice"), gate_job(gate), "held")
    holder.wait_state("running")
    waiting = Background(as_user("alice"), lambda x: x, "alice waited")
    waiting.wait_state("pending")
    with as_user("alice") as third:
        with pytest.raises(rpycdl.LimitError, match=r"alice has 1 requests.*--max-queued-per-user"):
            third.root.run_code(lambda x: x, "refused")
    other = Background(as_user("bob"), lambda x: x, "bob waited")
    other.wait_state("pending")
    open_gate(gate)
    assert (holder.result(), waiting.result(), other.result()) == ("held", "alice waited", "bob waited")


def _auth(mode: str, team, tmp_path) -> tuple[list[str], dict[str, str]]:
    """`rpycdl serve` flags and rpycdl.connect() arguments for an authentication mode."""
    if mode == "tls":
        return team.server_args(), team.user("alice")
    if mode == "secret":
        path = tmp_path / "secret"
        path.write_text("the team's shared secret, long enough")
        path.chmod(0o600)
        return ["--secret-file", str(path)], {"secret_file": str(path)}
    return [], {}


@pytest.mark.parametrize("mode", ["none", "secret", "tls"])
def test_connections_over_the_limit_are_refused_at_once_by_name(mode, server, cluster, team, tmp_path):
    flags, client = _auth(mode, team, tmp_path)
    port = server("pytorch", "fake:1", "--max-connections", "2", *flags)
    pid = server_pid(cluster, port)

    def open_() -> rpycdl.Connection:
        return rpycdl.connect(host="127.0.0.1", port=port, **client)

    silent = socket.create_connection(("127.0.0.1", port))  # has not authenticated: does not count
    first, second = open_(), open_()
    wait_until(lambda: len(connection_processes(pid)) == 2, what="two connection processes")
    for _ in range(3):
        error = refusal(open_)
        assert isinstance(error, rpycdl.LimitError) and not isinstance(error, rpycdl.ConnectionDroppedError) and \
            "at most 2 authenticated connections at once (--max-connections)" in str(error), repr(error)
    second.close()
    wait_until(lambda: len(connection_processes(pid)) == 1, what="the second client's process to exit")
    with open_() as third:
        assert third.root.run_code(lambda x: x, "served") == "served"
    assert first.root.run_code(lambda x: x, "still served") == "still served"
    first.close()
    silent.close()


def _sent_unread(port: int) -> int:
    """The bytes that clients of a loopback port have sent and nobody has read yet (/proc/net/tcp: the rx_queue
    of the port's established sockets, a connection not yet accepted among them)."""
    unread = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "01":  # 127.0.0.1:port, ESTABLISHED
            unread += int(fields[4].partition(":")[2], 16)
    return unread


def test_a_place_freed_before_the_server_noticed_goes_to_the_client_that_took_it(server, cluster):
    # A busy machine may leave the server parent asleep while a connection process ends and a client
    # comes: once it wakes, the client is served in the place that ended, not refused as over the limit.
    port = server("pytorch", "fake:1", "--max-connections", "2")
    pid = server_pid(cluster, port)
    first, second = (rpycdl.connect(host="127.0.0.1", port=port) for _ in range(2))
    wait_until(lambda: len(connection_processes(pid)) == 2, what="two connection processes")
    os.kill(pid, signal.SIGSTOP)  # the parent sleeps: what follows waits for it
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        try:
            second.close()
            wait_until(lambda: len(connection_processes(pid)) == 1, what="the second client's process to exit")
            later = thread.submit(rpycdl.connect, host="127.0.0.1", port=port)
            wait_until(lambda: _sent_unread(port), what="the later client's first bytes to wait for the server")
        finally:
            os.kill(pid, signal.SIGCONT)
        third = later.result(60)
    with third:
        assert third.root.run_code(lambda x: x, "served") == "served"
    assert first.root.run_code(lambda x: x, "still served") == "still served"
    first.close()


def _make_writer() -> Any:
    """A job that writes `chunks` pieces of 256 KiB into its output directory, `pause` seconds apart (made in a
    function: dill sends it by value)."""

    def write_outputs(args: dict[str, Any]) -> str:
        import os
        import time

        import rpycdl

        for number in range(args["chunks"]):
            with open(os.path.join(rpycdl.output_dir(), f"part-{number:02d}"), "wb") as part:
                part.write(b"o" * (256 << 10))
            time.sleep(args["pause"])
        return "wrote them all"

    return write_outputs


write_outputs = _make_writer()
OVER = {"chunks": 16, "pause": 0.25}  # 4 MiB in 4 s: past 1 MiB after a second or so
"""What the jobs over the output quota below write."""


def _artifacts(job: rpycdl.Job) -> dict[str, Any]:
    return wait_until(lambda: (entry := job.artifacts())["state"] in ("uploaded", "failed") and entry, 20,
                      f"job {job.id}'s outputs to be uploaded")


def test_a_detached_job_past_the_output_quota_fails_by_name_and_keeps_what_it_wrote(server, connect):
    conn = connect(server("pytorch", "fake:1", "--max-output", "1MiB"))
    job = conn.root.submit(write_outputs, OVER)
    assert job.wait(30).state is JobState.FAILED
    assert job.info["error_type"] == "OutputLimitError"
    assert "wrote more than 1 MiB into its output directory, the server's --max-output" in job.info["error"]
    with pytest.raises(rpycdl.OutputLimitError, match="--max-output"):
        job.result()
    kept = _artifacts(job)
    assert kept["state"] == "uploaded" and kept["files"][0] == {"name": "part-00", "size": 256 << 10}
    assert (1 << 20) < sum(entry["size"] for entry in kept["files"]) < (4 << 20)  # stopped before its end


def test_an_attached_job_past_the_output_quota_raises_and_one_under_it_succeeds(server, connect):
    conn = connect(server("pytorch", "fake:1", "--max-output", "1MiB"))
    seen: list[str] = []
    with pytest.raises(rpycdl.OutputLimitError, match=r"job \w+: the job wrote more than 1 MiB .*--max-output"):
        conn.root.run_code(write_outputs, OVER, on_state=lambda state, info: seen.append(info["job_id"]))
    job = conn.root.job(seen[-1])
    assert job.info["state"] == "FAILED" and job.info["error_type"] == "OutputLimitError"
    assert _artifacts(job)["state"] == "uploaded"
    with pytest.raises(rpycdl.OutputLimitError):  # written at once, just before its end: measured at its end
        conn.root.run_code(write_outputs, {"chunks": 8, "pause": 0})
    assert conn.root.run_code(write_outputs, {"chunks": 3, "pause": 0.1}) == "wrote them all"  # 768 KiB


def _make_hider() -> Any:
    """A job that puts 2 MiB in a directory of its output directory that only root could enter after (mode 000),
    beside a link to a big file of root's (made in a function: dill sends it by value)."""

    def hide_outputs(args: dict[str, Any]) -> str:
        import os
        import time

        import rpycdl

        out = rpycdl.output_dir()
        os.symlink(args["big"], os.path.join(out, "big"))  # a link: counted as one
        os.makedirs(os.path.join(out, "hidden", "deeper"))
        with open(os.path.join(out, "hidden", "deeper", "blob"), "wb") as blob:
            blob.write(b"h" * args["size"])
        os.chmod(os.path.join(out, "hidden"), 0)
        time.sleep(args["sleep"])
        return "hid it"

    return hide_outputs


hide_outputs = _make_hider()


def test_a_root_server_measures_a_users_output_directory_whatever_he_hides(team, accounts, passable_dir, tmp_path):
    write_user_map(passable_dir / "users.toml")
    big = tmp_path / "big"  # root's, beyond the link
    big.write_bytes(b"b" * (4 << 20))
    with LocalCluster(str(passable_dir / "locks")) as cluster:
        port = cluster.add_server("pytorch", "fake:1", *team.server_args("localhost"), "--user-map",
                                  str(passable_dir / "users.toml"), "--max-output", "1MiB", isolated=True)[1]
        with rpycdl.connect(host="127.0.0.1", port=port, **team.user("bob")) as bob:
            assert bob.root.run_code(hide_outputs, {"big": str(big), "size": 100_000, "sleep": 0}) == "hid it"
            job = bob.root.submit(hide_outputs, {"big": str(big), "size": 2 << 20, "sleep": 30})
            assert job.wait(20).state is JobState.FAILED and job.info["error_type"] == "OutputLimitError"
