"""Issue 29: rpycdl in a Jupyter notebook. A real ipykernel, driven by nbclient as Jupyter drives it (tests/
notebook.py), against real servers on simulated GPUs: a connection interrupted or closed for idleness is opened
again by the next call; a waiting call says so at once, and when it starts; an interrupted wait leaves its
handle ready; tracebacks show the job's own frames with their source lines and nothing of rpycdl's or RPyC's;
jobs, job lists and the GPU status show as tables; a download draws a bar; a module beside the notebook is
named with `working_dir="."`; cancel() says the state after it, a partial line comes before its newline, and
a refusal names the Python argument. No mocks: Kernel > Interrupt is the kernel manager's SIGINT."""

from __future__ import annotations

import getpass
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from helpers import Background, gate_job, open_gate, wait_idle, wait_until
from notebook import Cell, Notebook

import rpycdl
from rpycdl.site.local import LocalCluster, Process

SETUP = """
import os, time
import rpycdl

conn = rpycdl.connect(host="127.0.0.1", port={port})
idle = rpycdl.connect(host="127.0.0.1", port={idle_port})

def hold(gate):
    print("holding", flush=True)
    while not os.path.exists(gate):
        time.sleep(0.01)
    return "released"

def f(x):
    y = 1
    return y / x

def save(size):
    path = os.path.join(rpycdl.output_dir(), "weights.bin")
    with open(path, "wb") as out:
        out.write(os.urandom(size))
    return size

def partial(seconds):
    print("loading...", end="")
    time.sleep(seconds)
    print("done")
"""


@dataclass
class Site:
    port: int  # a fake:1 server
    idle_server: Process  # a fake:1 server of another host (its own lock directory) with --idle-timeout 1
    cwd: Path  # the notebook's directory

    @property
    def idle_port(self) -> int:
        return int(self.idle_server.wait_for(r"127\.0\.0\.1:(\d+) as").group(1))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    with LocalCluster(str(tmp_path_factory.mktemp("nb-locks"))) as main, \
            LocalCluster(str(tmp_path_factory.mktemp("nb-idle-locks"))) as other:
        cwd = tmp_path_factory.mktemp("notebook")
        (cwd / "mylib.py").write_text("def double(x):\n    return 2 * x\n")
        yield Site(main.add_server("pytorch", "fake:1")[1],
                   other.add_server("pytorch", "fake:1", "--idle-timeout", "1", "-v")[0], cwd)


@pytest.fixture(scope="module")
def notebook(site) -> Iterator[Notebook]:
    with Notebook(str(site.cwd)).started() as started:
        setup = started.run(SETUP.format(port=site.port, idle_port=site.idle_port).strip())
        assert not [m for m in setup.messages if m.kind == "error"], setup.messages
        yield started


@pytest.fixture
def mine(site, connect) -> rpycdl.Connection:
    """The test's own connection to the notebook's server."""
    return connect(site.port)


def _holders(conn: rpycdl.Connection) -> list[dict]:
    return [holder for gpu in conn.root.gpu_status()["gpus"] for holder in gpu["holders"]]


def _no_internal_frames(shown: str) -> None:
    """A traceback as the notebook shows it has no frame of rpycdl's or RPyC's code."""
    files = re.findall(r"^File (\S+?):\d+", shown, re.M) + re.findall(r'File "([^"]+)"', shown)
    assert not [file for file in files if "/rpycdl/" in file or "/rpyc/" in file], shown


def _interrupted(notebook: Notebook, source: str, once: str, pause: float = 0.0) -> str:
    """Run a cell and interrupt its kernel once it printed `once` (and `pause` seconds more): it raises
    KeyboardInterrupt, shown without a frame of rpycdl's or RPyC's; its message."""
    def interrupt(cell: Cell) -> bool:
        if once not in cell.stream():
            return False
        time.sleep(pause)
        notebook.interrupt()
        return True

    name, value, shown = notebook.run(source, watch=interrupt).error
    assert name == "KeyboardInterrupt", shown
    _no_internal_frames(shown)
    return value


def test_an_interrupt_cancels_the_job_in_one_line_and_the_next_call_on_the_same_conn_runs(notebook, mine, tmp_path):
    gate = str(tmp_path / "gate")
    held: list[str] = []

    def interrupt_once_it_runs(cell: Cell) -> bool:
        # once the job's output is in the cell: the client has read what came before it, the job's id among it
        # (the server's holder record alone comes a moment before the client is told)
        if "holding" not in cell.stream():
            return False
        held.extend(holder["job_id"] for holder in _holders(mine))
        if held:
            notebook.interrupt()
        return bool(held)

    cell = notebook.run(f"conn.root.run_code(hold, {gate!r})", watch=interrupt_once_it_runs)
    interrupted = time.time()
    name, value, shown = cell.error
    assert name == "KeyboardInterrupt" and held, cell.messages
    assert re.fullmatch(rf"job {held[0]} was cancelled: the interrupt closed the connection to 127\.0\.0\.1:\d+ "
                        r"\(the next call opens it again\)", value), value
    _no_internal_frames(shown)
    assert "conn.root.run_code(hold" in shown and len(shown.splitlines()) < 15, shown
    wait_idle(mine, 1.0)  # promise 3: its GPU is free within a second
    assert time.time() - interrupted < 2.0
    assert mine.root.job(held[0]).info["state"] == "CANCELLED"
    assert notebook.run("conn.root.run_code(lambda x: x + 1, 1)").result == "2"


def test_after_an_idle_timeout_the_next_call_on_the_same_conn_runs(notebook, site):
    first = notebook.run("idle.root.run_code(lambda x: x + 1, 1)")
    assert first.result == "2"

    def closed_for_idleness() -> bool:  # the server's log (-v) says when it closed a connection, to the ms
        return any("closing a connection idle" in line
                   and datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() > first.ended - 0.01
                   for line in list(site.idle_server.lines))

    wait_until(closed_for_idleness, 10, "the server to close the idle connection")
    assert notebook.run("idle.root.run_code(lambda x: x * 2, 21)").result == "42"


def test_a_waiting_call_says_at_once_what_it_waits_for_then_when_it_runs(notebook, site, mine, connect, tmp_path):
    gate = str(tmp_path / "gate")
    holder = Background(connect(site.port), gate_job(gate), None)
    holder_id = holder.wait_state("running")["job_id"]
    queued: list[float] = []

    def release_once_it_says_so(cell: Cell) -> bool:
        if not queued:  # when the request took its place in line, by the server's clock
            queued.extend(waiter["since"].timestamp() for waiter in mine.root.gpu_status()["queue"])
        if "waiting for" not in cell.stream("stderr"):
            return False
        if not queued:
            queued.extend(waiter["since"].timestamp() for waiter in mine.root.gpu_status()["queue"])
        open_gate(gate)
        return True

    cell = notebook.run("conn.root.run_code(lambda x: x * 3, 5)", watch=release_once_it_says_so)
    assert cell.result == "15" and queued, cell.messages
    waiting = cell.first("waiting for")
    assert re.fullmatch(rf"rpycdl: job \w{{12}} waiting for 1 GPU: 1 job ahead; GPU 0 held by job {holder_id} "
                        rf"of {getpass.getuser()} \(unverified\) since \d\d:\d\d\n", waiting.text), waiting.text
    assert waiting.at - queued[0] < 0.5, f"the waiting line came {waiting.at - queued[0]:.2f} s after the wait began"
    running = cell.first("running on")
    assert re.fullmatch(r"rpycdl: job \w{12} running on GPU 0 after \d+\.\d s\n", running.text), running.text
    assert running.at >= waiting.at and holder.result() is None


def test_an_interrupted_wait_leaves_the_handle_answering_at_once(notebook, mine, tmp_path):
    gate = str(tmp_path / "gate")
    notebook.run(f"job = conn.root.submit(hold, {gate!r})")
    wait_until(lambda: _holders(mine), 20, "the job to run")

    value = _interrupted(notebook, "print('waiting', flush=True)\njob.wait()", once="waiting", pause=0.3)
    assert value.startswith("interrupted: waiting for job ") and "goes on: job.cancel() stops it" in value, value
    after = notebook.run("began = time.monotonic()\nstatus = job.status()\nprint(time.monotonic() - began)\nstatus")
    assert float(after.stream()) < 0.5, f"status() took {after.stream()} s after the interrupted wait"
    assert after.result.startswith("JobStatus(state=RUNNING"), after.result
    open_gate(gate)
    assert notebook.run("job.result()").result == "'released'"


def test_a_remote_error_shows_the_jobs_frames_with_their_source_and_no_rpycdl_frame(notebook):
    for call in ("conn.root.run_code(f, 0)", "conn.root.submit(f, 0).result()",
                 "with conn.root.session() as s:\n    s.run(f, 0)"):
        name, value, shown = notebook.run(call).error
        assert (name, value) == ("ZeroDivisionError", "division by zero"), shown
        _no_internal_frames(shown)
        assert "return y / x" in shown and "in f" in shown and call.splitlines()[-1].strip() in shown, shown
        assert "skipping hidden" in shown or "rpyc" not in shown


def test_a_session_goes_on_after_an_interrupted_call(notebook):
    notebook.run("s = conn.root.session().open()")

    value = _interrupted(notebook, "s.run(lambda _: print('sleeping', flush=True) or time.sleep(30))", once="sleeping")
    assert value.startswith("interrupted: the call in session ") and "the session goes on" in value, value
    assert notebook.run("s.run(lambda x: x + 1, 1)").result == "2"
    assert notebook.run("s.close()").result == "2"


def test_jobs_job_lists_and_the_gpu_status_show_as_tables_read_now(notebook, mine):
    notebook.run("job = conn.root.submit(lambda x: x, 1)")
    job_id = notebook.run("job.id").result.strip("'")
    wait_until(lambda: mine.root.job(job_id).info["state"] == "SUCCEEDED", 20, "the job to end")
    shown = notebook.run("job")  # displayed after its end, without a call of the cell's own: read now
    assert f"<rpycdl.Job {job_id} SUCCEEDED, read at " in shown.result, shown.result
    (table,) = shown.data("text/html")
    assert table.startswith("<table") and f"<td>{job_id}</td>" in table and "<td>SUCCEEDED</td>" in table, table
    (listed,) = notebook.run("conn.root.jobs()").data("text/html")
    assert "<table" in listed and f"<td>{job_id}</td>" in listed, listed
    (status,) = notebook.run("conn.root.gpu_status()").data("text/html")
    assert "<table" in status and "<td>Simulated GPU</td>" in status, status
    assert notebook.run("job.status()").result.startswith("JobStatus(state=SUCCEEDED, read at ")
    kinds = notebook.run("[type(conn.root.jobs()[0][key]).__name__ for key in ('submitted', 'started', 'ended')], "
                         "type(conn.root.gpu_status()['time']).__name__")
    assert kinds.result == "(['datetime', 'datetime', 'datetime'], 'datetime')"


def test_download_draws_a_bar(notebook):
    cell = notebook.run("job = conn.root.submit(save, 3 << 20)\njob.result()\n"
                        "[path.stat().st_size for path in job.download('downloaded')]")
    assert cell.result == "[3145728]", cell.messages
    widgets = cell.data("application/vnd.jupyter.widget-view+json")
    assert widgets or "100%" in cell.stream("stderr"), cell.messages


def test_a_module_beside_the_notebook_is_named_with_working_dir(notebook):
    name, value, shown = notebook.run("import mylib\nconn.root.run_code(mylib.double, 2)").error
    assert name == "InvalidRequestError" and "No module named 'mylib'" in value, value
    _no_internal_frames(shown)  # an rpycdl error: the cell's line, and the message
    assert 'pass working_dir="." to send its directory with the job' in value, value
    assert notebook.run("conn.root.run_code(mylib.double, 2, working_dir='.')").result == "4"


def test_cancel_says_the_state_after_it_and_a_refusal_names_the_python_argument(notebook, mine, tmp_path):
    gate = str(tmp_path / "gate")
    notebook.run(f"job = conn.root.submit(hold, {gate!r}, name='only-one')")
    name, value, _ = notebook.run(f"conn.root.submit(hold, {gate!r}, name='only-one')").error
    assert name == "InvalidRequestError" and "choose another name=, or cancel it first" in value, value
    assert "--name" not in value
    assert notebook.run("job.cancel()").result.startswith("JobStatus(state=CANCELLED"), "the state after the cancel"


def test_a_partial_line_shows_before_its_newline(notebook):
    cell = notebook.run("conn.root.run_code(partial, 2)")
    loading, done = cell.first(r"^loading\.\.\.$"), cell.first(r"done")
    assert done.at - loading.at > 1.0, f"'loading...' came {done.at - loading.at:.2f} s before its line's end"
