"""The `rpycdl` command keeps its word (issue 25): exit codes as its help says, a failed job's result exits
non-zero, tables whose columns never run together, a hint for a forgotten `--`, refusals in the words of
its flags, and a waiting job that says what it waits behind. Each against a real registry and server in
subprocesses; only the GPUs are simulated."""

from __future__ import annotations

import re
from datetime import datetime

import pytest
from helpers import TALKER, Background, cli_env, gate_job, open_gate, rpycdl_cli

import rpycdl
from rpycdl import JobState
from rpycdl.cli.common import EXIT_QUEUE_TIMEOUT, EXIT_USAGE


@pytest.fixture
def host(cluster, connect) -> tuple[list[str], rpycdl.Connection]:
    """A fake:2 server whose shares go by the MiB: the flags that reach it, and a connection to it."""
    port = cluster.add_server("pytorch", "fake:2", "--gpu-unit", "1MiB")[1]
    return ["--host", "127.0.0.1", "--port", str(port)], connect(port)


def exit_codes(command: str) -> dict[int, str]:
    """The exit codes `rpycdl COMMAND --help` lists, with what each means (continuation lines joined)."""
    shown = rpycdl_cli(command, "--help")
    assert shown.returncode == 0, shown.stderr
    codes: dict[int, str] = {}
    last = None
    for line in shown.stdout.split("exit codes")[1].splitlines()[1:]:
        listed = re.match(r"  (\d+)\s+(.*)", line)
        if listed:
            last = int(listed.group(1))
            codes[last] = listed.group(2)
        elif line.startswith("        ") and last is not None:
            codes[last] += " " + line.strip()
    return codes


def test_wait_result_and_download_exit_as_their_help_says(host):
    flags, conn = host
    for command in ("wait", "result", "download"):
        unknown = rpycdl_cli(command, "no-such-job", *flags)
        assert unknown.returncode == EXIT_USAGE, unknown.stderr
        assert "no server knows job 'no-such-job'" in unknown.stderr
        assert "no server knows the job" in exit_codes(command)[EXIT_USAGE], command
    failed = conn.root.submit_command(["sh", "-c", "exit 3"], name="exits-3")
    assert failed.wait(30).state is JobState.FAILED and failed.info["exit_code"] == 3
    waited = rpycdl_cli("wait", "exits-3", *flags)
    assert waited.returncode == 3, waited.stderr
    result = rpycdl_cli("result", "exits-3", *flags)
    assert (result.returncode, result.stdout) == (3, "3\n"), result.stderr
    assert "so non-zero for one that failed" in " ".join(rpycdl_cli("result", "--help").stdout.split())
    saved = rpycdl_cli("result", "exits-3", "--no-wait", "-o", "/dev/null", *flags)
    assert saved.returncode == 3, saved.stderr
    succeeded = conn.root.submit_command(["true"], name="exits-0")
    assert succeeded.wait(30).state is JobState.SUCCEEDED
    assert (rpycdl_cli("result", "exits-0", *flags).returncode, rpycdl_cli("wait", "exits-0", *flags).returncode) == (
        0, 0)
    raised = conn.root.submit(TALKER, {"dir": "/tmp", "raise": "diverged"})
    assert raised.wait(30).state is JobState.FAILED
    assert rpycdl_cli("result", raised.id, *flags).returncode == 1 == rpycdl_cli("wait", raised.id, *flags).returncode
    assert "the job failed" in exit_codes("result")[1]


def columns_apart(lines: list[str]) -> None:
    """Every line of a table has each column where its header's begins, two spaces after the one before (the
    last one may be empty)."""
    header, *rows = lines
    starts = [match.start() for match in re.finditer(r"(?<=  )\S", header)]
    assert starts, header
    for line in [header, *rows]:
        for start in starts:
            if start == starts[-1] and len(line) <= start:
                continue
            assert line[start - 2:start] == "  " and line[start:start + 1] != " ", (start, line)


def test_the_columns_of_jobs_and_status_never_run_together(host, tmp_path):
    flags, conn = host
    long_name, long_user = "a-name-longer-than-its-column-" + "x" * 20, "a-user-with-a-long-name-" + "y" * 20
    conn.root.identify(long_user)
    as_user = cli_env(USER=long_user, LOGNAME=long_user)  # the command as the same user: it sees the jobs' names
    shared = conn.root.submit(TALKER, {"dir": str(tmp_path)}, gpu_memory="5.8GiB", name=long_name)
    whole = conn.root.submit(TALKER, {"dir": str(tmp_path)}, ngpus=2)
    assert shared.wait(30).finished and whole.wait(30).finished
    listed = rpycdl_cli("jobs", "--all", *flags, env=as_user)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    columns_apart(lines)
    row = next(line for line in lines if line.startswith(shared.id))
    assert "5.8 GiB of one GPU  20" in row  # the share, two spaces, the date it was submitted (20YY-...)
    assert long_name not in row and long_name[:23] + "~" in row  # cut to its column, with a marker
    wide = rpycdl_cli("jobs", "--all", "--long", *flags, env=as_user)  # with what they used (or "-")
    assert wide.returncode == 0, wide.stderr
    columns_apart(wide.stdout.splitlines())
    assert wide.stdout.split()[9:15] == ["PRIO", "MEM", "CPU", "PROCS", "TRY", "INFO"]
    status = rpycdl_cli("status", *flags)
    assert status.returncode == 0, status.stderr
    table = [line for line in status.stdout.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    columns_apart([line for line in table if not line.strip().startswith(("waiting", "nobody"))])


@pytest.mark.parametrize("command", ["submit", "run"])
def test_a_forgotten_double_dash_gets_a_hint_naming_the_fix(command):
    forgot = rpycdl_cli(command, "pytorch", "--ngpus", "1", "python", "train.py", "--lr", "0.1")
    assert forgot.returncode == EXIT_USAGE
    last = forgot.stderr.splitlines()[-1]
    assert last == (f"rpycdl {command}: error: unrecognized arguments: python train.py --lr 0.1; put -- before the "
                    f"command to run: rpycdl {command} pytorch [options] -- python train.py --lr 0.1"), forgot.stderr
    assert forgot.stderr.startswith(f"usage: rpycdl {command} SERVICE [options] -- COMMAND")  # its own usage
    other = rpycdl_cli("status", "--no-such-flag")
    assert other.returncode == EXIT_USAGE and other.stderr.startswith("usage: rpycdl status")
    assert other.stderr.splitlines()[-1] == "rpycdl status: error: unrecognized arguments: --no-such-flag"


def test_refusals_on_the_command_line_name_its_flags(host):
    flags, conn = host
    too_large = rpycdl_cli("run", "pytorch", *flags, "--gpu-memory", "200GiB", "--", "true")
    assert too_large.returncode == EXIT_USAGE
    assert too_large.stderr.splitlines()[-1] == (
        "rpycdl run: --gpu-memory 200GiB asks for 200 GiB of one GPU, but the largest GPU here has 16 GiB; for "
        "several GPUs use --ngpus"), too_large.stderr
    submitted = rpycdl_cli("submit", "pytorch", *flags, "--gpus", "1.5", "--", "true")
    assert submitted.returncode == EXIT_USAGE and "rpycdl submit: --gpus 1.5 is neither a share" in submitted.stderr
    for flag, value in (("--timeout", "-1"), ("--queue-timeout", "0"), ("--ngpus", "0")):
        refused = rpycdl_cli("submit", "pytorch", *flags, flag, value, "--", "true")
        assert refused.returncode == EXIT_USAGE and f"rpycdl submit: {flag} {value}" in refused.stderr, refused.stderr
    named = rpycdl_cli("submit", "pytorch", *flags, "--name", "two words", "--", "true")
    assert "rpycdl submit: --name 'two words': not a job name" in named.stderr, named.stderr
    for stderr in (too_large.stderr, submitted.stderr, named.stderr):
        assert not re.search(r"\b(gpu_memory|ngpus|gpus|name|timeout)=", stderr), stderr
    with pytest.raises(rpycdl.InvalidRequestError, match=re.escape("gpu_memory='200GiB' asks for 200 GiB")) as info:
        conn.root.submit(TALKER, {}, gpu_memory="200GiB")  # Python callers read Python's words
    assert str(info.value).endswith("use ngpus=")


def test_a_waiting_job_says_what_it_waits_behind_everywhere(host, connect, tmp_path):
    flags, conn = host
    gate = str(tmp_path / "gate")
    holder = Background(connect(conn.address[1]), gate_job(gate), None, ngpus=2)
    holder_id = holder.wait_state("running")["job_id"]
    waiting = Background(connect(conn.address[1]), gate_job(gate), None, ngpus=1)
    info = waiting.wait_state("pending")
    assert info["ahead"] == 1 and info["queued"] == 0  # the job holding both GPUs, nobody queued
    assert [(held["job_id"], held["gpu"], held["share_bytes"]) for held in info["holders"]] == [
        (holder_id, 0, 0), (holder_id, 1, 0)]
    assert all(held["user"] and held["since"] <= datetime.now().astimezone() for held in info["holders"])
    detached = rpycdl_cli("submit", "pytorch", *flags, "--", "true")
    assert detached.returncode == 0, detached.stderr
    assert detached.stdout.endswith(": PENDING (behind 1 running job and 1 queued request)\n"), detached.stdout
    job = rpycdl.job(re.search(r"job (\w+)", detached.stdout).group(1), host="127.0.0.1", port=conn.address[1])
    status = job.status()
    assert (status.ahead, str(status)) == (2, "PENDING (behind 1 running job and 1 queued request)")
    assert {held["job_id"] for held in status.holders} == {holder_id}
    rows = {line.split()[0]: line for line in rpycdl_cli("jobs", *flags).stdout.splitlines()[1:]}
    assert rows[job.id].endswith("behind 1 running job and 1 queued request"), rows
    assert rows[waiting.job_id].endswith("behind 1 running job and 0 queued requests"), rows
    run = rpycdl_cli("run", "pytorch", *flags, "--queue-timeout", "1", "--", "true")
    assert run.returncode == EXIT_QUEUE_TIMEOUT, run.stderr
    assert re.search(r"rpycdl run: job \w+ waits for its GPUs, behind 1 running job and 2 queued requests\n",
                     run.stderr), run.stderr
    open_gate(gate)
    holder.result()
    waiting.result()
    assert job.wait(30).state is JobState.SUCCEEDED
