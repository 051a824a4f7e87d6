"""The `rpycdl` command: `main(argv)` parses the arguments and runs one of the subcommands (serving:
registry, serve, demo, selftest; status; run; jobs: submit, jobs, logs, wait, result, cancel, delete;
site: certs, up, down), which print one line when they fail and exit with the codes of rpycdl.cli.common."""

from __future__ import annotations

import argparse
import logging
import platform
import signal
import sys
from typing import Any

from rpycdl import __version__
from rpycdl.cli import jobs, monitor, run, serving, status
from rpycdl.cli.common import EXIT_FAILED, EXIT_INTERRUPTED, exit_code, in_flags, os_error
from rpycdl.errors import InvalidRequestError, RpycdlError
from rpycdl.site import cli as site_cli

COMMANDS = {**serving.COMMANDS, **monitor.COMMANDS, **status.COMMANDS, **run.COMMANDS, **jobs.COMMANDS,
            **site_cli.COMMANDS}

INTERRUPTED = {"run": "interrupted: the job is cancelled", "demo": "interrupted: the servers and the registry stopped",
               "submit": "interrupted: the job may have been submitted (see rpycdl jobs)",
               **{name: "interrupted: the job goes on" for name in ("logs", "wait", "result")}}
"""What Ctrl-C prints, by subcommand (default: interrupted)."""


def parser() -> argparse.ArgumentParser:
    """The parser of `rpycdl` and of every subcommand."""
    verbose = argparse.ArgumentParser(add_help=False)  # -v after a subcommand too: rpycdl status -v
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log what rpycdl does (INFO)")
    top = argparse.ArgumentParser(
        prog="rpycdl", description="Run Python functions on shared GPU servers, first come, first served.",
        epilog="`rpycdl COMMAND --help` tells more; the docs tell everything (docs/, or `mkdocs serve`).")
    top.add_argument("-v", "--verbose", action="store_true", default=False, help="log what rpycdl does (INFO)")
    top.add_argument("--version", action="version",
                     version=f"rpycdl {__version__} (Python {platform.python_version()})")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, description: str, **options: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=description, parents=[verbose], **options)
        sub.set_defaults(subparser=sub)  # for main's word on arguments it does not know
        return sub

    serving.add_commands(command)
    monitor.add_commands(command)
    status.add_commands(command)
    run.add_commands(command)
    jobs.add_commands(command)
    site_cli.add_commands(command, [verbose])
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the rpycdl command; returns the exit code (rpycdl.cli.common)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser().parse_known_args(argv[:split])
    args.argv = argv[split + 1:]  # `rpycdl run`'s and `rpycdl submit`'s command
    if unknown:
        _unrecognized(args, unknown)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # its terminal closed (not under nohup): as SIGTERM
        signal.signal(signal.SIGHUP, _terminate)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(f"rpycdl {args.command}: {INTERRUPTED.get(args.command, 'interrupted')}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RpycdlError as exc:
        print(f"rpycdl {args.command}: {in_flags(str(exc)) if isinstance(exc, InvalidRequestError) else exc}",
              file=sys.stderr)
        return exit_code(exc)
    except (OSError, EOFError) as exc:  # the network or the machine, not a bug of ours: one line
        if args.verbose:
            logging.getLogger("rpycdl.cli").exception("rpycdl %s failed", args.command)
        print(f"rpycdl {args.command}: {os_error(exc)}", file=sys.stderr)
        return EXIT_FAILED


def _unrecognized(args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit with the usage of the subcommand given arguments it does not know (argparse's exit code 2); for run
    and submit without `--`, saying that the command goes after one."""
    words = " ".join(unknown)
    if args.command in ("run", "submit") and not args.argv:
        args.subparser.error(f"unrecognized arguments: {words}; put -- before the command to run: "
                             f"rpycdl {args.command} {args.service} [options] -- {words}")
    args.subparser.error(f"unrecognized arguments: {words}")


def _terminate(*_: Any) -> None:
    raise KeyboardInterrupt


def serve_service(service: str) -> None:
    """Entry point of servers/*_server.py: `rpycdl serve --service SERVICE` with this process's arguments."""
    sys.exit(main(["serve", "--service", service, *sys.argv[1:]]))
