"""`rpycdl run`: a command on a server of a service, with GPUs of its own and its output live (like srun)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rpycdl.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_JOB_TIMEOUT,
    EXIT_QUEUE_TIMEOUT,
    EXIT_USAGE,
    Command,
    server_flags,
    size_flags,
    working_dir_flag,
)
from rpycdl.client import connect
from rpycdl.errors import InvalidRequestError, RpycdlError
from rpycdl.server.commands import run_command
from rpycdl.states import waiting_behind

RUN_EXIT_CODES = f"""exit codes:
  N     the command's own exit code (128+N when signal N killed it)
  {EXIT_FAILED}     the job failed or crashed or was cancelled, or no server could take it (no registry
        answered, none registered or reachable, authentication refused)
  {EXIT_USAGE}     usage error: bad arguments, or a request no server can serve (more GPUs than it has)
  {EXIT_QUEUE_TIMEOUT}    queue timeout: the GPUs were not granted within --queue-timeout; try again later
  {EXIT_JOB_TIMEOUT}   job timeout: the command ran past --timeout and was stopped (like timeout(1))
  {EXIT_INTERRUPTED}   interrupted (Ctrl-C): the job was cancelled
A command that itself exits with one of these codes looks the same: the last line on stderr tells.

example: rpycdl run pytorch --gpu-memory 6GiB --working-dir . -- python train.py --lr 0.01"""


def add_commands(command: Command) -> None:
    """Add run to the `rpycdl` parser."""
    run = command(
        "run", "run a command on a GPU server with GPUs of its own, output live (like srun)",
        "Run COMMAND on a server of SERVICE once its GPUs are granted, with its output streamed here;\n"
        "exit with the command's exit code. The command runs in the server's working directory, or in a\n"
        "copy of --working-dir DIR, as the server's user: paths are the server's. Ctrl-C cancels it.",
        usage="rpycdl run SERVICE [options] -- COMMAND [ARG ...]", epilog=RUN_EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("service", help="service to run on (pytorch, tensorflow, ...; an alias such as pytorch-2.5)")
    size_flags(run)
    working_dir_flag(run)
    run.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help=f"stop the command after this long (exit code {EXIT_JOB_TIMEOUT})")
    run.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                     help=f"give up if the GPUs are not granted within this long (exit code {EXIT_QUEUE_TIMEOUT})")
    server_flags(run)


def _run(args: argparse.Namespace) -> int:
    argv = args.argv
    if not argv:
        raise InvalidRequestError("give the command to run after the service: rpycdl run pytorch -- python train.py")

    def on_state(state: str, info: dict[str, Any]) -> None:
        if state == "pending":
            print(f"rpycdl run: job {info['job_id']} waits for its GPUs, "
                  f"{waiting_behind(info['ahead'], info.get('holders'))}", file=sys.stderr, flush=True)
        else:
            print(f"rpycdl run: job {info['job_id']} runs on GPU {','.join(map(str, info['gpus']))}",
                  file=sys.stderr, flush=True)

    target = {"host": args.host, "port": args.port} if args.host else {"service": args.service}
    with connect(**target, registry_address=args.registry, secret_file=args.secret_file, tls_cert=args.tls_cert,
                 tls_key=args.tls_key, tls_ca=args.tls_ca, quiet=True) as conn:  # it says states itself
        try:
            code = conn.root.run_code(run_command, argv, args.ngpus, gpus=args.gpus, gpu_memory=args.gpu_memory,
                                      timeout=args.timeout, queue_timeout=args.queue_timeout, on_state=on_state,
                                      working_dir=args.working_dir, memory=args.memory, cpus=args.cpus,
                                      priority=args.priority, idle_reclaim=not args.keep_idle)
        except (RpycdlError, OSError, EOFError):
            raise
        except Exception as exc:  # the job raised (not the command: its exit code comes back): it failed
            raise RpycdlError(f"the job failed: {type(exc).__name__}: {exc}") from None
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says


COMMANDS = {"run": _run}
