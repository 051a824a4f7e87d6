"""`rpycdl demo`, as scripts/quickstart.sh ends: what it prints as next steps runs, as printed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "PYTHONUNBUFFERED": "1"}
"""The test's environment, its interpreter's bin first, as `source .venv/bin/activate` makes it (outside a venv
the demo prints no such step)."""

pytestmark = pytest.mark.slow


def _demo(*args: str) -> subprocess.Popen[str]:
    """`rpycdl demo ARGS` in a process group of its own (as a shell starts it), so that a test that fails can
    take its registry, server and monitor down with it (`_kill_group`); SIGHUP at its default, as in a terminal,
    whatever the tests inherited (under nohup, ignored: the demo rightly stays ignoring it then)."""
    return subprocess.Popen([sys.executable, "-m", "rpycdl", "demo", *args], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def _kill_group(demo: subprocess.Popen[str]) -> None:
    """Kill a demo's whole process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(demo.pid, signal.SIGKILL)


def _bash(commands: list[str]) -> subprocess.CompletedProcess[str]:
    """Run commands as a user types them, one after another, in one shell in the checkout."""
    return subprocess.run(["bash", "-c", "set -e\n" + "\n".join(commands)], cwd=REPO, env=ENV, text=True,
                          capture_output=True, timeout=180)


def test_the_demos_next_steps_run_as_printed():
    demo = _demo()
    out, _ = demo.communicate(timeout=180)
    assert demo.returncode == 0, out
    assert re.search(r"^\[job3\] waiting", out, re.M) and "job3 returned" in out, out  # the example ran
    steps = out[out.index("\nNext steps:\n"):].splitlines()[2:]
    commands = [line.partition("#")[0].strip() for line in steps if line.startswith("  ")]
    assert commands[-2:] == ["rpycdl demo --client clients/first_job.py", "rpycdl demo --keep"], steps
    assert all(command.startswith("source ") for command in commands[:-2]), steps  # the PATH, in a venv
    first = _bash(commands[:-1])
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"^hello attached, from .+, on GPU 0$", first.stdout, re.M), first.stdout
    assert re.search(r"^detached, job \w+: SUCCEEDED; it printed: hello detached", first.stdout, re.M), first.stdout
    assert "rpycdl demo: client exited with 0" in first.stdout


def _read_until_kept(demo: subprocess.Popen[str], lines: list[str]) -> None:
    """Read a kept demo's output into `lines` up to the last line it prints before it waits."""
    assert demo.stdout is not None
    for line in demo.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("or in a notebook"):
            return


def test_a_kept_demo_serves_what_it_prints_until_ctrl_c():
    demo = _demo("--keep")
    lines: list[str] = []
    try:
        _read_until_kept(demo, lines)
        told = lines[lines.index("rpycdl demo: running until Ctrl-C. From another terminal:") + 1:-1]
        ran = _bash([line.strip() for line in told])
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert "and returned: {'gpus': '0'" in ran.stdout, ran.stdout
        address = re.search(r"registry_address='([\d.:]+)'", lines[-1]).group(1)
        snippet = ("import rpycdl\n"
                   f"print(rpycdl.connect('pytorch', registry_address={address!r}).root.run_code(abs, -3))")
        assert subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60,
                              env=ENV).stdout == "3\n"
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            rest, _ = demo.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # it ignored Ctrl-C: take it down, and say so
            _kill_group(demo)
            raise
    assert demo.returncode == 130, "\n".join(lines) + rest  # as a shell says of Ctrl-C
    assert "rpycdl demo: stopping the server and the registry" in rest
    assert "rpycdl demo: interrupted: the servers and the registry stopped" in rest


def _started(pid: int, marker: str) -> list[int]:
    """The live processes, but `pid`, whose command line holds `marker`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if int(entry) != pid and marker in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry))
    return found


def test_a_kept_demo_whose_terminal_closes_leaves_no_process_and_no_directory():
    demo = _demo("--keep")
    lines: list[str] = []
    try:
        _read_until_kept(demo, lines)
        locks = re.search(r"\(lock directory (\S+)\)", "\n".join(lines)).group(1)
        assert Path(locks).is_dir() and len(_started(demo.pid, locks)) >= 3  # its server, forkserver, monitor
        demo.send_signal(signal.SIGHUP)  # what closing its terminal sends
        rest, _ = demo.communicate(timeout=60)
    finally:
        _kill_group(demo)
    assert demo.returncode == 130 and "stopping the server and the registry" in rest, "\n".join(lines) + rest
    assert not _started(demo.pid, locks) and not Path(locks).exists()
