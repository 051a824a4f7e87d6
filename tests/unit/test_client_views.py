"""What the client gives and shows of rows (issue 29): times as datetimes and `ahead` counting the holders
(client_row), a waiting job's words, JobStatus's repr, the HTML tables and `rpycdl jobs`' table with what jobs
used; whether a person looks; the remote traceback's frames rebuilt, and the source lines of a script's functions
sent with a call."""

from __future__ import annotations

import json
import linecache
import sys
import traceback
from datetime import datetime

from rpycdl.cli.jobs import format_jobs
from rpycdl.client import failures
from rpycdl.client.displays import GPUStatus, JobList, client_row, cpu_text
from rpycdl.client.jobs import Job, JobStatus
from rpycdl.client.notices import Notices, looking
from rpycdl.errors import InvalidRequestError
from rpycdl.states import JobState, held_by, need_text, waiting_behind
from rpycdl.wire import codec, tracebacks

NOW = 1_700_000_000.0
HOLDERS = [{"gpu": 0, "uuid": "GPU-a", "job_id": "3f2a", "user": "alice", "share_bytes": 0, "since": NOW},
           {"gpu": 1, "uuid": "GPU-b", "job_id": "3f2a", "user": "alice", "share_bytes": 0, "since": NOW}]


def test_a_row_gets_datetimes_and_ahead_counts_the_jobs_holding_its_gpus():
    row = client_row({"job_id": "77b1", "state": "PENDING", "submitted": NOW, "started": None, "ahead": 2,
                      "holders": HOLDERS, "request": {"timeout": 5.0}})
    assert row["submitted"] == datetime.fromtimestamp(NOW).astimezone() and row["started"] is None
    assert row["holders"][0]["since"].timestamp() == NOW and row["request"] == {"timeout": 5.0}
    assert (row["ahead"], row["queued"]) == (3, 2)  # one job holds both GPUs, two requests are queued
    assert client_row(row) == row  # applied twice, the same
    old_server = client_row({"job_id": "77b1", "state": "PENDING", "ahead": 2})  # no holders told
    assert old_server["ahead"] == 2 and "queued" not in old_server
    status = client_row({"time": NOW, "queue": [{"since": NOW}], "gpus": [{"holders": HOLDERS}]})
    assert isinstance(status["time"], datetime) and isinstance(status["gpus"][0]["holders"][0]["since"], datetime)


def test_a_waiting_job_in_words():
    since = datetime.fromtimestamp(NOW).astimezone().strftime("%Y-%m-%d %H:%M")  # not today: with its date
    assert need_text(1, 0) == "1 GPU" and need_text(2, 0) == "2 GPUs" and need_text(-1, 0) == "all GPUs"
    assert need_text(1, 4 << 30) == "4 GiB of one GPU"
    assert held_by(HOLDERS).endswith(f"GPUs 0, 1 held by job 3f2a of alice since {since}")
    assert waiting_behind(3, client_row(HOLDERS)) == "behind 1 running job and 2 queued requests"
    assert waiting_behind(2, None) == "2 queued request(s) ahead"
    row = client_row({"state": "PENDING", "ahead": 0, "holders": HOLDERS})
    status = JobStatus(JobState.PENDING, row["ahead"], holders=tuple(row["holders"]),
                       read_at=datetime(2024, 5, 1, 10, 2, 5), queued=row["queued"])
    assert str(status) == "PENDING (behind 1 running job and 0 queued requests)"
    assert repr(status).startswith("JobStatus(state=PENDING, ahead=1, holders=(GPUs 0, 1 held by job 3f2a of alice")
    assert repr(status).endswith(", read at 10:02:05)")


def test_job_lists_and_gpu_status_are_html_tables_with_their_cells_escaped():
    rows = JobList([client_row({"job_id": "3f2a", "name": "<b>x</b>", "state": "RUNNING", "user": "alice",
                                "user_verified": True, "ngpus": 1, "share_bytes": 0, "gpu_uuids": ["GPU-a"],
                                "submitted": NOW, "started": NOW + 2, "ended": None})])
    html = rows._repr_html_()
    assert html.startswith("<table") and "<td>3f2a</td>" in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert "<td>2s</td>" in html or "<td>2 s</td>" in html or "2s" in html
    status = GPUStatus(client_row({"server": {"name": "pytorch", "host": "h", "port": 1}, "time": NOW,
                                   "gpus": [{"index": 0, "name": "Simulated GPU", "memory_total": 1 << 30,
                                             "memory_used": 0, "holders": HOLDERS[:1]}], "queue": []}))
    assert "<td>job 3f2a of alice since" in status._repr_html_() and "nobody waiting" in status._repr_html_()


def ended_row(**fields) -> dict:
    """A finished job's row as conn.root.jobs() gives it to its owner."""
    return client_row({"job_id": "3f2a", "name": "train", "state": "SUCCEEDED", "user": "alice",
                       "user_verified": True, "service": "pytorch", "detached": True, "ngpus": 1, "share_bytes": 0,
                       "gpu_uuids": ["GPU-a"], "submitted": NOW, "started": NOW + 2, "ended": NOW + 62,
                       "exit_code": 0, "error": "", **fields})


def test_what_an_ended_job_used_is_shown_where_measured_and_a_dash_where_not():
    assert [cpu_text(value) for value in (None, 0.0, 0.44, 12.34, 59.94, 59.96, 185.0, 3725.0)] == [
        "-", "0.0s", "0.4s", "12.3s", "59.9s", "1m", "3m05s", "1h02m"]
    used = ended_row(peak_memory=int(3.5 * 1024**3), cpu_seconds=3725.2, max_procs=17)
    unmeasured = ended_row(job_id="77b1", peak_memory=None, cpu_seconds=None, max_procs=None)
    reduced = {key: value for key, value in ended_row(job_id="99c0").items() if key not in ("name", "error",
                                                                                            "exit_code")}
    header, *lines = format_jobs([used, unmeasured, reduced], long=True).splitlines()
    assert header.split() == ["ID", "NAME", "STATE", "USER", "SERVICE", "GPUS", "SUBMITTED", "WAITED", "RAN",
                              "PRIO", "MEM", "CPU", "PROCS", "TRY", "INFO"]
    assert lines[0].split()[-9:] == ["1m", "0", "3.5", "GiB", "1h02m", "17", "1", "exit", "0"]
    assert lines[1].split()[-8:] == ["1m", "0", "-", "-", "-", "1", "exit", "0"]
    assert lines[2].split()[-6:] == ["1m", "0", "-", "-", "-", "1"]  # another's job: its usage is not shown to them
    retried = format_jobs([ended_row(attempt=2, request={"retries": 3})], long=True).splitlines()[1]
    assert retried.split()[-3:] == ["2/4", "exit", "0"]  # its second attempt of four at most
    assert lines[1].index(" - ") == lines[0].index("3.5 GiB") - 1  # the columns line up
    short = format_jobs([used]).splitlines()  # the default table leaves them out
    assert "MEM" not in short[0] and "GiB" not in short[1] and short[0].split()[-1] == "INFO"
    html = JobList([used, unmeasured])._repr_html_()
    assert "<th>peak memory</th><th>CPU</th><th>info</th>" in html
    assert "<td>1m</td><td>3.5 GiB</td><td>1h02m</td><td>exit 0</td>" in html
    assert "<td>1m</td><td>-</td><td>-</td><td>exit 0</td>" in html
    job = Job({**used, "cpu_seconds": 12.34}, connection=None)  # ended: shown as it is, without asking its server
    shown = job._repr_mimebundle_()["text/html"]
    assert "<td>3.5 GiB</td><td>12.3s</td>" in shown and shown.startswith("<table")


def test_a_person_looks_at_a_terminal_or_a_notebook_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("RPYCDL_QUIET", raising=False)
    assert looking(True) is False and looking(False) is True
    assert looking(None) is sys.stderr.isatty()  # pytest's captured stderr is no terminal
    monkeypatch.setenv("RPYCDL_QUIET", "1")
    assert looking(None) is False and looking(False) is True


def test_the_waiting_line_is_said_again_when_the_place_in_line_or_why_it_waits_changes(capsys):
    """Item 5 of issue 38: once per change of its place or its reason (not per notice), with the reason when there
    is one; below the last line where stderr is no terminal (a notebook's stream, pytest's capture)."""
    notices = Notices(None, quiet=False)
    base = {"job_id": "3f2a", "ngpus": 1, "holders": HOLDERS[:1]}
    reason = "alice holds 4 GPUs, the limit of users.alice.gpus = 4"
    for ahead, why in ((2, ""), (2, ""), (1, ""), (1, reason), (1, reason), (0, "")):
        notices("pending", json.loads(json.dumps({**base, "ahead": ahead, "reason": why})))
    notices("running", {"job_id": "3f2a", "gpus": [0]})
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 2)[2].split(";")[0] for line in lines[:-1]] == [  # the holder counts as ahead
        "3 jobs ahead", "2 jobs ahead", "2 jobs ahead", "1 job ahead"], lines
    assert lines[2].endswith(f"; held back: {reason}") and "held back" not in lines[3], lines
    assert lines[0].startswith("rpycdl: job 3f2a waiting for 1 GPU: 3 jobs ahead; GPU 0 held by job 3f2a of alice")
    assert "running on GPU 0 after" in lines[-1]


def _script_function():
    """A function as a script or a notebook cell defines it (its module __main__), dill sends it as code."""
    namespace = {"__name__": "__main__"}
    source = "def divide(x):\n    y = 1\n    return y / x\n"
    filename = "<notebook cell 7>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace["divide"], filename


def test_the_source_of_a_script_function_goes_with_the_call_and_its_frame_comes_back():
    divide, filename = _script_function()
    payload, _ = codec.encode_call(divide, 0)
    assert tracebacks.client_sources(divide) == {filename: {1: "def divide(x):\n", 2: "    y = 1\n",
                                                            3: "    return y / x\n"}}
    del linecache.cache[filename]  # the server's process has not the client's linecache
    fn, args = codec.load_call(codec.check_payload(payload))  # ... it gets the lines with the call
    try:
        fn(args)
    except ZeroDivisionError as exc:
        text = tracebacks.formatted(exc)
        outcome = codec.encode_error(exc, text)
    assert "rpycdl" not in text and f'File "{filename}", line 3, in divide\n    return y / x' in text, text
    del linecache.cache[filename]  # the client: its own linecache lost the cell (a restarted kernel)
    try:
        codec.decode_outcome(outcome)
    except ZeroDivisionError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
    assert (frames[-1].filename, frames[-1].lineno, frames[-1].name, frames[-1].line) == (
        filename, 3, "divide", "return y / x")


def test_a_module_the_server_lacks_is_named_with_working_dir_when_it_is_beside_the_caller(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused = InvalidRequestError("the callable cannot be loaded on this server: ModuleNotFoundError: No module "
                                  "named 'mylib'")
    assert failures.hinted(refused, None) is refused  # no mylib.py here
    (tmp_path / "mylib.py").write_text("X = 1\n")
    assert 'pass working_dir="." to send its directory' in str(failures.hinted(refused, None))
    assert failures.hinted(refused, ".") is refused  # it sent one: something else is missing
