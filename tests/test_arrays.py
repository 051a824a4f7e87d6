"""Job arrays (issue 37 item 1): submit_array hands over every element in one request, each an ordinary detached job
with its own id and row; results come back in order, a failing element raising or standing as its exception; an
array's `max_running` is never exceeded (checked from the ledger's start and end times); `rpycdl submit --array`
with `{index}`; an array found again by name, one element by `name[i]`; a cancel of the whole array; bad input
refused with nothing submitted; an array survives kill -9 of its server and runs when a restarted one is up (promise
8). Real registry, servers, supervisors and clients on loopback; only the GPUs are simulated."""

from __future__ import annotations

import re
import signal
import time

import dill
import pytest
from helpers import open_gate, rpycdl_cli, running, wait_until

import rpycdl
from rpycdl.cli.common import EXIT_FAILED, EXIT_QUEUE_TIMEOUT

END = 60.0
"""Seconds a test gives an array to end (generous: a busy two-core machine)."""


def _made():
    """The jobs, made in a function so that dill sends them by value."""

    def square(x):
        import os

        import rpycdl

        if x == 3:
            raise ValueError(f"bad element {x}")
        return x * x, rpycdl.array_index(), os.environ["RPYCDL_ARRAY_INDEX"]

    def gated(args):
        import os
        import time

        gate, value = args
        while not os.path.exists(gate):
            time.sleep(0.05)
        return value

    def nap(x):
        import time

        time.sleep(0.3)
        return x

    return square, gated, nap


square, gated, nap = _made()


def test_results_in_order_with_a_failing_element_under_both_error_modes(two):
    _, conn = two
    array = conn.root.submit_array(square, list(range(6)), name="squares")
    assert len(array) == 6 and array.name == "squares" and len(set(array.info["job_ids"])) == 6
    values = array.results(timeout=END, errors="return")
    assert [value for index, value in enumerate(values) if index != 3] == [
        (i * i, i, str(i)) for i in range(6) if i != 3]
    assert isinstance(values[3], ValueError) and str(values[3]) == "bad element 3", values[3]
    with pytest.raises(ValueError, match="bad element 3"):
        array.results(timeout=END)
    status = array.status()
    assert status.finished and status.counts["SUCCEEDED"] == 5 and status.counts["FAILED"] == 1, status
    jobs = list(array)
    assert [job.info["array_index"] for job in jobs] == list(range(6))
    assert [job.name for job in jobs] == [f"squares[{i}]" for i in range(6)]
    assert conn.root.job("squares[4]").result() == (16, 4, "4")  # one element by its array's name and index
    assert conn.root.job(f"{array.id}[5]").result() == (25, 5, "5")
    again = rpycdl.job("squares", host="127.0.0.1", port=two[0])  # the array again, by its name
    assert isinstance(again, rpycdl.ArrayJob) and again.id == array.id
    assert again.results(errors="return")[:3] == values[:3]


def test_max_running_is_never_exceeded_from_the_ledgers_times(cluster, connect, tmp_path):
    port = cluster.add_server("pytorch", "fake:4")[1]
    conn = connect(port)
    array = conn.root.submit_array(nap, list(range(10)), max_running=2)
    assert array.results(timeout=END * 2) == list(range(10))
    rows = [job.refresh() for job in array]
    events = sorted([(row["started"].timestamp(), 1) for row in rows] + [(row["ended"].timestamp(), -1)
                                                                         for row in rows])
    running_now = most = 0
    for _, step in events:  # an end at the same moment as a start counts first
        running_now += step
        most = max(most, running_now)
    assert most == 2, (most, events)  # the limit reached, never passed, though 4 GPUs were free


def test_cancel_of_a_whole_array(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    array = conn.root.submit_array(gated, [(gate, i) for i in range(20)], max_running=3)
    wait_until(lambda: array.status().counts["RUNNING"] >= 2, END, "two elements running")
    status = array.cancel(timeout=END)
    assert status.finished and status.counts["CANCELLED"] == 20, status
    values = array.results(errors="return")
    assert all(isinstance(value, rpycdl.JobCancelledError) for value in values), values


def test_another_user_sees_that_an_array_exists_and_can_neither_read_nor_cancel_it(tls_server):
    """On a server of verified users (mutual TLS), bob, given the id of alice's array, sees its counts; its results,
    an element's result and the cancel are refused, and its name is alice's alone."""
    alice, bob = tls_server("alice"), tls_server("bob")
    array = alice.root.submit_array(square, [1, 2], name="alices-sweep")
    assert array.wait(END).finished
    theirs = bob.root.array(array.id)
    assert isinstance(theirs, rpycdl.ArrayJob) and theirs.status().counts["SUCCEEDED"] == 2  # anyone sees it exists
    element = bob.root.job(f"{array.id}[0]")
    for attempt in (theirs.results, theirs.cancel, lambda: element.result(wait=False)):
        with pytest.raises(rpycdl.NotAllowedError, match="belongs to alice and you are bob"):
            attempt()
    with pytest.raises(rpycdl.InvalidRequestError):  # a name is its owner's
        bob.root.array("alices-sweep")
    assert array.results() == [(1, 0, "0"), (4, 1, "1")]


def test_bad_arrays_are_refused_with_nothing_submitted(two):
    _, conn = two
    for args_list, options, said in (([], {}, "non-empty list"), ([1], {"max_running": 0}, "max_running="),
                                     ([1], {"max_running": "8"}, "max_running="), ([1], {"name": "a b"}, "name=")):
        with pytest.raises(rpycdl.InvalidRequestError, match=said):
            conn.root.submit_array(square, args_list, **options)
    with pytest.raises(rpycdl.InvalidRequestError, match="1 to 100000 elements"):
        conn.root.submit_array(square, [0] * 100_001)
    assert conn.root.jobs() == []


def test_the_queue_limit_counts_every_element(cluster, connect):
    conn = connect(cluster.add_server("pytorch", "fake:1", "--max-queued-per-user", "5")[1])
    with pytest.raises(rpycdl.LimitError, match="--max-queued-per-user"):
        conn.root.submit_array(square, list(range(6)))
    assert conn.root.jobs() == []


def test_the_cli_array_with_index(cluster, tmp_path):
    port = cluster.add_server("pytorch", "fake:2")[1]
    where = ["--host", "127.0.0.1", "--port", str(port)]
    out = tmp_path / "out"
    out.mkdir()
    done = rpycdl_cli("submit", "pytorch", *where, "--array", "0-4%2", "--name", "sweep", "-q", "--",
                      "sh", "-c", f"echo {{index}} $RPYCDL_ARRAY_INDEX > {out}/{{index}}")
    assert done.returncode == 0, done.stderr
    waited = rpycdl_cli("wait", "sweep", *where, timeout=END * 2)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert sorted(path.name for path in out.iterdir()) == [str(i) for i in range(5)]
    assert all((out / str(i)).read_text() == f"{i} {i}\n" for i in range(5))
    listed = rpycdl_cli("jobs", *where)
    line = next(line for line in listed.stdout.splitlines() if "sweep" in line)
    assert "5 SUCCEEDED" in line, listed.stdout
    expanded = rpycdl_cli("jobs", *where, "--expand")
    assert sum("sweep[" in line for line in expanded.stdout.splitlines()) == 5, expanded.stdout


def test_rpycdl_result_of_an_array_and_of_one_element(two, tmp_path):
    port, conn = two
    where = ["--host", "127.0.0.1", "--port", str(port)]
    gate = str(tmp_path / "gate")
    waiting = conn.root.submit_array(gated, [(gate, i) for i in range(2)], name="held")
    early = rpycdl_cli("result", "held", *where, "--no-wait")
    assert early.returncode == EXIT_QUEUE_TIMEOUT and "has not ended" in early.stderr, early.stdout + early.stderr
    open_gate(gate)
    assert waiting.results(timeout=END) == [0, 1]
    array = conn.root.submit_array(square, list(range(5)), name="sweep")
    shown = rpycdl_cli("result", "sweep", *where, timeout=END * 2)
    assert shown.returncode == EXIT_FAILED, shown.stdout + shown.stderr
    assert shown.stdout.splitlines() == [repr((i * i, i, str(i))) if i != 3 else "" for i in range(5)], shown.stdout
    assert f"element 3 (sweep[3], job {array.info['job_ids'][3]}) FAILED: ValueError: bad element 3" in shown.stderr
    saved = tmp_path / "values"
    assert rpycdl_cli("result", "sweep", *where, "-o", str(saved)).returncode == EXIT_FAILED
    values = dill.loads(saved.read_bytes())
    assert values[:3] == [(0, 0, "0"), (1, 1, "1"), (4, 2, "2")] and isinstance(values[3], ValueError), values
    one = rpycdl_cli("result", "sweep[4]", *where)
    assert one.returncode == 0 and one.stdout == repr((16, 4, "4")) + "\n", one.stdout + one.stderr
    bad = rpycdl_cli("result", "sweep[3]", *where)
    assert bad.returncode == EXIT_FAILED and "ValueError: bad element 3" in bad.stderr, bad.stdout + bad.stderr


def _cells(shown: str) -> dict[str, int]:
    """The counts of an array's HTML table, by state."""
    header, row = re.findall(r"<th>([^<]*)</th>", shown), re.findall(r"<td>([^<]*)</td>", shown)
    return dict(zip(header, map(int, row), strict=True))


def test_the_notebook_display_shows_the_counts_and_a_bar_read_now(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    array = conn.root.submit_array(gated, [(gate, i) for i in range(3)], name="shown", max_running=1)
    stale = conn.root.array("shown")  # read now, and not again before it is shown below
    bundle = array._repr_mimebundle_()
    assert bundle["text/plain"] == repr(array) and bundle["text/plain"].startswith(
        f"<rpycdl.ArrayJob {array.id} 'shown' 0/3 ended: "), bundle["text/plain"]
    shown = bundle["text/html"]
    assert '<progress value="0" max="3"' in shown and "0/3 ended" in shown, shown
    assert f"array {array.id} &#x27;shown&#x27;, read at " in shown and "&amp;" not in shown, shown  # escaped once
    counts = _cells(shown)
    assert set(counts) == {state.value for state in rpycdl.JobState} and sum(counts.values()) == 3, counts
    assert counts["PENDING"] + counts["RUNNING"] == 3 and counts["RUNNING"] <= 1, counts
    open_gate(gate)
    assert array.wait(END).finished
    again = stale._repr_mimebundle_()["text/html"]  # its info said unfinished: the display reads it again
    assert '<progress value="3" max="3"' in again and "3/3 ended" in again, again
    assert _cells(again)["SUCCEEDED"] == 3 and "3/3 ended: 3 SUCCEEDED" in repr(stale), again


def test_an_array_survives_kill_9_of_its_server_and_runs_after_a_restart(cluster, connect, tmp_path):
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    gate = str(tmp_path / "gate")
    array = conn.root.submit_array(gated, [(gate, i) for i in range(6)], max_running=2, name="survivor")
    first = wait_until(lambda: next((job for job in array if job.info["state"] == "RUNNING"), None), END,
                       "an element running")
    supervisor = first.refresh()["owner_pid"]
    process.popen.send_signal(signal.SIGKILL)
    process.popen.wait()
    open_gate(gate)
    wait_until(lambda: not running(supervisor), END, "the running element's supervisor to end")
    time.sleep(1.0)  # no server: nothing else starts
    again = connect(cluster.add_server("pytorch", "fake:1")[1]).root.array("survivor")
    assert again.results(timeout=END * 2) == list(range(6))
