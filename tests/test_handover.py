"""An array's elements run in turn by the supervisors of the elements before them (issue 37's makespan,
rpycdl.server.handover): the GPUs an element frees go to its array's next element in line without a new supervisor,
never while anything of the last one runs, and never past a request that heads the line; a supervisor killed while
it hands them over loses its own elements alone, and leaves nothing behind. Real registry, servers, supervisors
and clients on loopback; only the GPUs are simulated."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path

from helpers import children, open_gate, wait_until

import rpycdl
from rpycdl.defaults import STATE_SUBDIR
from rpycdl.scheduler.ledger import Ledger

END = 60.0
"""Seconds a test gives an array to end (generous: a busy two-core machine)."""


def _made():
    """The jobs, made in a function so that dill sends them by value."""

    def nap(x):
        import time

        time.sleep(0.2)
        return x

    def gated(args):
        import os
        import time

        gate, value = args
        while not os.path.exists(gate):
            time.sleep(0.02)
        return value

    def kept(args):
        import os
        import time

        folder, index = args
        with open(f"{folder}/keeper{index}", "w") as told:
            told.write(str(os.getppid()))
        while not os.path.exists(f"{folder}/gate{index}"):
            time.sleep(0.02)
        return index

    return nap, gated, kept


nap, gated, kept = _made()


def _kill_keeper(keeper: int) -> None:
    """kill -9 of a keeper once it keeps a job process; returns once both are gone."""
    kept = wait_until(lambda: children(keeper), END, "the keeper's job process")
    os.kill(keeper, signal.SIGKILL)
    wait_until(lambda: not any(_alive(pid) for pid in (keeper, *kept)), END, "the keeper and its job process to die")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _rows(conn: rpycdl.Connection, array: rpycdl.ArrayJob) -> list[dict]:
    return [job.refresh() for job in array]


def test_elements_run_in_turn_by_few_supervisors_never_two_at_once_on_a_gpu(two):
    _, conn = two
    array = conn.root.submit_array(nap, list(range(12)))
    assert array.results(timeout=END) == list(range(12))
    rows = _rows(conn, array)
    owners = {row["owner_pid"] for row in rows}
    assert len(owners) < len(rows) / 2, owners  # two GPUs: two supervisors, and one more for each refused handover
    by_gpu = defaultdict(list)
    for row in rows:
        assert len(row["gpu_uuids"]) == 1, row
        by_gpu[row["gpu_uuids"][0]].append((row["started"].timestamp(), row["ended"].timestamp()))
    for spans in by_gpu.values():
        spans.sort()
        for (_, last_end), (next_start, _) in zip(spans, spans[1:], strict=False):
            assert next_start >= last_end, spans  # the next element's grant came after the last one's end


def test_a_request_that_heads_the_line_goes_before_the_next_element(cluster, connect, tmp_path):
    """fcfs: an array limited to two at a time on one GPU queues its third element once its first has ended, after a
    job submitted meanwhile; the second element's supervisor does not hand the GPU to the third, the job goes
    first (the ledger's times)."""
    conn = connect(cluster.add_server("pytorch", "fake:1")[1])
    gate = str(tmp_path / "gate")
    array = conn.root.submit_array(gated, [(gate, i) for i in range(4)], max_running=2)
    first = wait_until(lambda: next((job for job in array if job.info["state"] == "RUNNING"), None), END,
                       "the first element to run")
    other = conn.root.submit(gated, (gate, "other"))
    wait_until(lambda: len(conn.root.gpu_status()["queue"]) >= 2, END, "the job to wait behind the second element")
    open_gate(gate)
    assert array.results(timeout=END) == list(range(4)) and other.result(timeout=END) == "other"
    rows = sorted(_rows(conn, array), key=lambda row: row["array_index"])
    started = other.refresh()["started"]
    assert first.id == rows[0]["job_id"]
    assert rows[1]["ended"] <= started <= rows[2]["started"], (rows, started)
    assert rows[1]["owner_pid"] == rows[0]["owner_pid"]  # the first handed the GPU to the second


def test_a_supervisor_killed_after_it_handed_over_loses_its_element_alone(cluster, connect, tmp_path):
    """Element i waits for gate i: the first ends, its supervisor runs the second, and is killed then; the second
    ends LOST, the first kept its result, and the others run (other supervisors), leaving nothing behind."""
    process, port = cluster.add_server("pytorch", "fake:1")
    conn = connect(port)
    gates = [str(tmp_path / f"gate{i}") for i in range(5)]
    array = conn.root.submit_array(gated, [(gate, i) for i, gate in enumerate(gates)], name="handed")
    elements = list(array)
    wait_until(lambda: elements[0].status().state is rpycdl.JobState.RUNNING, END, "the first element to run")
    supervisor = elements[0].refresh()["owner_pid"]
    open_gate(gates[0])
    wait_until(lambda: elements[0].status().state is rpycdl.JobState.SUCCEEDED and
               elements[1].status().state is rpycdl.JobState.RUNNING, END, "the second element to run")
    assert elements[1].refresh()["owner_pid"] == supervisor  # handed over, not started by a dispatcher
    os.kill(supervisor, signal.SIGKILL)
    for gate in gates[1:]:
        open_gate(gate)
    assert array.wait(timeout=END).finished
    rows = [job.refresh() for job in elements]
    assert [row["state"] for row in rows] == ["SUCCEEDED", "LOST", "SUCCEEDED", "SUCCEEDED", "SUCCEEDED"], rows
    assert f"supervisor (pid {supervisor})" in rows[1]["error"], rows[1]["error"]
    assert array.results(errors="return")[0] == 0
    lock_dir = Path(cluster.lock_dir)
    wait_until(lambda: not os.listdir(lock_dir / "held") and not os.listdir(lock_dir / "rows"), END,
               "the GPU's record and the queue to be empty")
    assert not Ledger(lock_dir / STATE_SUBDIR).unfinished(), "rows left unfinished"
    assert process.popen.poll() is None


def test_an_arrays_elements_are_kept_by_two_keepers_in_turn_and_a_dead_one_costs_nothing(cluster, connect, tmp_path):
    """One GPU, elements run in turn by one supervisor: element i's job process is kept by the keeper of element i - 2
    (the last element's is busy with it, the one before is idle: forklink.ForkServerLink.rest), so no keeper is forked
    per element. The first is the supervisor's own (it forks its first job process itself): the third gets a new one.
    kill -9 of the keeper that holds the next element's job process, waiting for its GPU, costs that element nothing
    once it is dead (a new keeper keeps it); and once the array has ended, no keeper of it is left. (A keeper that
    dies as its job process is handed the GPUs ends that job, its own, as any keeper's death does.)"""
    conn = connect(cluster.add_server("pytorch", "fake:1")[1])
    count = 6
    array = conn.root.submit_array(kept, [(str(tmp_path), i) for i in range(count)])
    keepers: list[int] = []
    for index in range(count):
        told = tmp_path / f"keeper{index}"
        keepers.append(int(wait_until(lambda told=told: told.exists() and told.read_text(), END,
                                      f"element {index} to run")))
        if index == 3:  # element 4's job process waits, kept by element 2's keeper: it dies, and its job process
            _kill_keeper(keepers[2])
        open_gate(str(tmp_path / f"gate{index}"))
    assert array.results(timeout=END) == list(range(count))
    owners = [row["owner_pid"] for row in sorted(_rows(conn, array), key=lambda row: row["array_index"])]
    assert owners[:4] == [keepers[0]] * 4, (owners, keepers)  # the first's supervisor, its own first job process's
    assert keepers[3] == keepers[1] and len({keepers[0], keepers[1], keepers[2]}) == 3, keepers
    assert keepers[4] not in keepers[:4], keepers  # a new keeper, not the dead one
    assert owners[4:] == [owners[0]] * 2 and keepers[5] == keepers[3], (owners, keepers)  # and the fourth's the sixth
    wait_until(lambda: not any(_alive(pid) for pid in set(keepers)), END, "the array's keepers to leave")
