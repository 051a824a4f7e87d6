"""Arrays take every option of submit (issue 37): `after=` for a whole array, for one element (`sweep[3]`), and element
by element (`ok:sweep[*]`: element i after element i), a dependency that can never be met ending the elements that
wait for it with DependencyError; `retries=` per element, rpycdl.attempt() in it; `working_dir=` stored once for the
array and copied for each element; `exists=` "return" and "replace" by the array's name; the CLI's --array with
them; and held arrays survive kill -9 of their server. Real registry, servers, supervisors and clients on loopback;
only the GPUs are simulated."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers import TALKER, open_gate, rpycdl_cli, running, wait_until

import rpycdl
from rpycdl import JobState

END = 60.0
"""Seconds a test gives an array to end (generous: a busy two-core machine)."""


def _made():
    """The jobs, made in a function so that dill sends them by value."""

    def fails_at(args):
        import os
        import time

        import rpycdl

        gate, bad = args
        while gate and not os.path.exists(gate):
            time.sleep(0.05)
        if rpycdl.array_index() == bad:
            raise ValueError(f"element {bad} fails")
        return rpycdl.array_index()

    def killed_first(directory):
        """Its first attempt writes its pid and waits to be killed; its second returns its attempt and index."""
        import os
        import time

        import rpycdl

        index, attempt = rpycdl.array_index(), rpycdl.attempt()
        if attempt == 1:
            path = os.path.join(directory, f"{index}.pid")
            with open(path + ".tmp", "w") as file:
                file.write(str(os.getpid()))
            os.rename(path + ".tmp", path)
            while True:
                time.sleep(0.05)
        return attempt, index

    def reads_workdir(_):
        import os

        import rpycdl

        with open("data.txt") as file:
            seen = file.read()
        with open("data.txt", "a") as file:  # its own copy: no other element sees this
            file.write(f" {rpycdl.array_index()}")
        return seen, os.getcwd()

    return fails_at, killed_first, reads_workdir


fails_at, killed_first, reads_workdir = _made()


def held_a_while(array: rpycdl.ArrayJob) -> None:
    """Check that no element of `array` starts through several of its server's sweeps (twice a second)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert all(job.info["state"] == "PENDING" and job.info["started"] is None for job in array), list(array)
        time.sleep(0.2)


def test_a_whole_array_waits_after_a_job_then_runs(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "first"}, name="first")
    array = conn.root.submit_array(fails_at, [(None, -1)] * 3, after="ok:first", name="later")
    element = array[1]
    assert element.info["request"]["after"] == f"ok:{first.id}", element.info  # resolved to its id at submit
    held_a_while(array)  # a GPU is free: only the dependency holds them
    assert str(element.status()) == f"PENDING (after ok:{first.id})"
    open_gate(gate)
    assert array.results(timeout=END) == [0, 1, 2]
    ended = first.refresh()["ended"]
    assert all(job.info["started"] >= ended for job in array)


def test_an_array_after_a_failed_job_ends_failed_naming_it_and_one_refused_at_submit(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    first = conn.root.submit(fails_at, (gate, None), name="first")  # outside an array: array_index() is None
    array = conn.root.submit_array(fails_at, [(None, -1)] * 3, after="ok:first")
    open_gate(gate)
    with pytest.raises(ValueError):
        first.result(timeout=END)
    values = array.results(timeout=END, errors="return")
    assert all(isinstance(value, rpycdl.DependencyError) for value in values), values
    said = str(values[0])
    assert f"after=ok:{first.id} cannot be met: job {first.id} FAILED (ValueError: element None fails)" in said, said
    assert all(job.info["started"] is None for job in array)  # never ran
    with pytest.raises(rpycdl.DependencyError, match="not submitted"):
        conn.root.submit_array(fails_at, [(None, -1)], after=f"ok:{first.id}")
    assert len([row for row in conn.root.jobs() if row["array_id"]]) == 3  # nothing more was submitted


def test_element_by_element_each_after_its_peer_and_one_element_by_name(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    sweep = conn.root.submit_array(fails_at, [(gate, 1)] * 3, name="sweep", max_running=1)
    after = conn.root.submit_array(fails_at, [(None, -1)] * 3, name="after", after="ok:sweep[*]")
    assert [job.info["request"]["after"] for job in after] == [f"ok:{sweep.id}[*]"] * 3
    one = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": "one"}, after="ok:sweep[2]")
    assert one.refresh()["request"]["after"] == f"ok:{sweep.info['job_ids'][2]}"  # the element's own id
    held_a_while(after)
    open_gate(gate)
    values = after.results(timeout=END * 2, errors="return")
    assert values[0] == 0 and values[2] == 2, values
    peer = sweep.info["job_ids"][1]
    assert isinstance(values[1], rpycdl.DependencyError) and (
        f"after=ok:{peer} cannot be met: job {peer} FAILED (ValueError: element 1 fails)") in str(values[1]), values
    for mine, theirs in zip(after, sweep, strict=True):  # each after its own peer
        if mine.info["state"] == "SUCCEEDED":
            assert mine.info["started"] >= theirs.info["ended"], (mine.info, theirs.info)
    assert one.result(timeout=END) == "one" and one.refresh()["started"] >= sweep[2].info["ended"]
    for size, dependency, said in ((2, "ok:sweep[*]", "has 3 elements and this one 2"),
                                   (3, "ok:sweep[*],after[*]", "for one array at most"),
                                   (3, "ok:nothing[*]", "no array 'nothing' here")):
        with pytest.raises(rpycdl.InvalidRequestError, match=said):
            conn.root.submit_array(fails_at, [(None, -1)] * size, after=dependency)
    with pytest.raises(rpycdl.InvalidRequestError, match=r"sweep\[\*\] waits element by element, which only an array"):
        conn.root.submit(TALKER, {"dir": str(tmp_path)}, after="ok:sweep[*]")


def test_each_element_retries_on_its_own_and_sees_its_attempt(two, tmp_path):
    _, conn = two
    array = conn.root.submit_array(killed_first, [str(tmp_path)] * 2, retries=1, max_running=1)
    assert array[0].info["request"]["retries"] == 1
    for index in range(2):
        path = tmp_path / f"{index}.pid"
        wait_until(path.exists, END, f"element {index}'s first attempt")
        os.kill(int(path.read_text()), signal.SIGKILL)  # as the OOM killer would
    assert array.results(timeout=END * 2) == [(2, 0), (2, 1)]
    assert [[attempt["state"] for attempt in job.attempts()] for job in array] == [["FAILED", "SUCCEEDED"]] * 2
    with pytest.raises(rpycdl.InvalidRequestError, match="retry_on_failure=True needs retries="):
        conn.root.submit_array(killed_first, [str(tmp_path)], retry_on_failure=True)


def test_a_working_directory_is_stored_once_and_each_element_runs_in_its_own_copy(two, tmp_path, cluster):
    _, conn = two
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "data.txt").write_text("shared")
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "first"})
    array = conn.root.submit_array(reads_workdir, [None] * 4, working_dir=str(workdir), after=f"ok:{first.id}")
    jobs = Path(next(iter(cluster.state_dirs))) / "jobs"
    assert (jobs / array.id / "work" / "tree" / "data.txt").read_text() == "shared"  # once, for the array
    assert not any((jobs / job_id / "work").exists() for job_id in array.info["job_ids"])  # none per element
    open_gate(gate)
    values = array.results(timeout=END)
    assert [seen for seen, _ in values] == ["shared"] * 4, values
    assert len({where for _, where in values}) == 4, values  # a copy each
    wait_until(lambda: not (jobs / array.id / "work").exists(), END, "the array's copy to go with the array")


def test_exists_return_gives_the_same_array_and_replace_submits_anew(two, tmp_path):
    _, conn = two
    gate = str(tmp_path / "gate")
    array = conn.root.submit_array(fails_at, [(gate, -1)] * 2, name="again")
    with pytest.raises(rpycdl.InvalidRequestError, match="unfinished array named 'again'"):
        conn.root.submit_array(fails_at, [(gate, -1)] * 2, name="again")
    same = conn.root.submit_array(fails_at, [(gate, -1)] * 2, name="again", exists="return")
    assert same.id == array.id
    replaced = conn.root.submit_array(fails_at, [(None, -1)] * 3, name="again", exists="replace")
    assert replaced.id != array.id and array.status().counts["CANCELLED"] == 2
    assert replaced.results(timeout=END) == [0, 1, 2]
    finished = conn.root.submit_command_array([["true"]], name="again", exists="return")
    assert finished.id == replaced.id  # finished, and still yours: given back, nothing submitted
    with pytest.raises(rpycdl.InvalidRequestError, match="exists='return' needs name="):
        conn.root.submit_array(fails_at, [(None, -1)], exists="return")


def test_the_cli_array_with_after_retries_and_exists(two, tmp_path):
    port, conn = two
    where = ["--host", "127.0.0.1", "--port", str(port)]
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "first"}, name="first")
    out = tmp_path / "out"
    out.mkdir()
    command = ["--", "sh", "-c", f"echo $RPYCDL_ATTEMPT > {out}/{{index}}"]
    done = rpycdl_cli("submit", "pytorch", *where, "--array", "0-2", "--name", "cli", "--after", "ok:first",
                      "--retries", "1", "-q", *command)
    assert done.returncode == 0, done.stderr
    again = rpycdl_cli("submit", "pytorch", *where, "--array", "0-2", "--name", "cli", "--exists", "return", "-q",
                       *command)
    assert again.returncode == 0 and again.stdout == done.stdout, again.stdout + again.stderr
    array = conn.root.array("cli")
    assert array[0].info["request"]["after"] == f"ok:{first.id}" and array[0].info["request"]["retries"] == 1
    time.sleep(1.0)
    assert not list(out.iterdir())  # held
    open_gate(gate)
    waited = rpycdl_cli("wait", "cli", *where, timeout=END * 2)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert sorted((path.name, path.read_text()) for path in out.iterdir()) == [(str(i), "1\n") for i in range(3)]


def test_held_arrays_survive_kill_9_of_their_server_and_run_after_a_restart(cluster, connect, tmp_path):
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    gate = str(tmp_path / "gate")
    first = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": "first"})
    whole = conn.root.submit_array(fails_at, [(None, -1)] * 2, after=f"ok:{first.id}")
    each = conn.root.submit_array(fails_at, [(None, 0)] * 2, after=f"any:{whole.id}[*]", name="each")
    supervisor = wait_until(lambda: first.refresh()["owner_pid"], END, "the first job's supervisor")
    process.popen.send_signal(signal.SIGKILL)
    process.popen.wait()
    open_gate(gate)  # its dependency ends while no server is up: nobody releases the arrays yet
    wait_until(lambda: not running(supervisor), END, "the first job's supervisor to end")
    again = connect(cluster.add_server("pytorch", "fake:1")[1])
    assert again.root.job(first.id).status().state is JobState.SUCCEEDED
    assert again.root.array(whole.id).results(timeout=END * 2) == [0, 1]
    values = again.root.array(each.id).results(timeout=END * 2, errors="return")
    assert isinstance(values[0], ValueError) and values[1] == 1, values
