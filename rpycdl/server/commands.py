"""A command as a job: the callable that runs an argv in the job process (with the job's GPUs, its
output streamed like any job's) and returns its exit code; `rpycdl run` sends it, `submit_command`
runs it, and a detached command fails unless it exits with 0."""

from __future__ import annotations

import signal
import subprocess
import sys

from rpycdl.errors import HostMemoryExceededError
from rpycdl.security import cgroups
from rpycdl.units import format_size


def run_command(argv: list[str]) -> int:
    """Run `argv` and return its exit code (-N if signal N killed it; 127 if it cannot be started).

    Raises:
        HostMemoryExceededError: the kernel killed it at its job's memory limit (its job's cgroup says so).
    """
    try:
        code = subprocess.run(argv, check=False).returncode
    except OSError as exc:  # not found, not executable: say so like a shell would
        print(f"rpycdl: {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    fenced = cgroups.own() if code == -signal.SIGKILL else None
    used = fenced.usage() if fenced is not None else None
    if used is not None and used.oom_kills:
        raise HostMemoryExceededError(
            f"the kernel killed the command (SIGKILL) at its job's memory limit: it used "
            f"{format_size(used.peak_memory or 0)} of host memory, its limit ({format_size(used.memory_limit or 0)});"
            " ask for more with memory= (--memory on the command line)")
    return code


def describe_exit(code: int) -> str:
    """A command's exit code in words."""
    if code < 0:
        try:
            return f"the command was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"the command was killed by signal {-code}"
    return f"the command exited with code {code}"
