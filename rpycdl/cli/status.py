"""`rpycdl status`, `rpycdl jobs` and `rpycdl cancel`: what the servers' GPUs, queues and jobs are."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rpycdl.cli.common import EXIT_FAILED, Command, each_server, server_flags, servers
from rpycdl.errors import AuthFailedError, LimitError, NotAllowedError, RpycdlError
from rpycdl.security.auth import Identity
from rpycdl.units import MiB, format_size


def add_commands(command: Command) -> None:
    """Add status, jobs and cancel to the `rpycdl` parser."""
    unreachable = f"Exits with {EXIT_FAILED} if a server could not be reached (the others are shown all the same)."
    for name, text, description in (
            ("status", "show each GPU, who holds it, and who waits",
             "Show every GPU of every server the registry knows (or of one service, or of the server at --host): "
             "its memory, who holds it or a share of it, and who waits for GPUs, in order. " + unreachable),
            ("jobs", "list a server's jobs",
             "List the recent jobs of every server the registry knows (or of one service, or of the server at "
             "--host): state, GPUs or share, owner, client. " + unreachable),
            ("cancel", "cancel a job",
             "Cancel a pending or running job by its id, on whichever server knows it: your own job, or anyone's "
             "with an admin certificate.")):
        sub = command(name, text, description)
        if name == "cancel":
            sub.add_argument("job_id", help="the job's id (see `rpycdl jobs`)")
        sub.add_argument("service", nargs="?", default=None,
                         help="only servers of this service (default: every server the registry knows)")
        sub.add_argument("--json", action="store_true", help="print JSON")
        server_flags(sub)



def _status(args: argparse.Namespace) -> int:
    results = each_server(args, "gpu_status")
    if args.json:
        print(json.dumps([r if not isinstance(r, Exception) else {"address": list(a), "error": str(r)}
                          for a, r in results], indent=2))
    else:
        for address, status in results:
            print(format_status(address, status))
    return _reached(args, results)


def _reached(args: argparse.Namespace, results: list[tuple[tuple[str, int], Any]]) -> int:
    """0 if every server answered; else say which did not, and EXIT_FAILED."""
    failed = [f"{host}:{port}" for (host, port), result in results if isinstance(result, Exception)]
    if not failed:
        return 0
    print(f"rpycdl {args.command}: {len(failed)} of {len(results)} server(s) could not be reached: "
          f"{', '.join(failed)}", file=sys.stderr)
    return EXIT_FAILED


def format_status(address: tuple[str, int], status: dict[str, Any] | Exception) -> str:
    """Human-readable status of one server."""
    if isinstance(status, Exception):
        return f"{address[0]}:{address[1]}  {_unreachable(status)}\n"
    now = status["time"]
    server = status["server"]
    kind = "simulated " + server["inventory"] if server["simulated"] else "NVML"
    lines = [f"{server['name']} @ {address[0]}:{address[1]}  [{', '.join(server['aliases'])}]  {kind}"]
    lines.append(f"  {'GPU':<4}{'UUID':<42}{'NAME':<24}{'MEMORY USED':<22}HELD BY")
    for gpu in status["gpus"]:
        used = "?" if gpu["memory_used"] is None else format_size(gpu["memory_used"])
        memory = f"{used} / {format_size(gpu['memory_total'])}"
        holders = gpu["holders"]
        if not holders:
            who = "free"
        elif not holders[0]["share_bytes"]:
            who = "whole: " + _holder(holders[0], now)
        else:
            granted = format_size(sum(holder["share_bytes"] for holder in holders))
            who = f"shared: {granted} of {format_size(gpu['memory_total'])} granted to {len(holders)} job(s)"
        lines.append(f"  {gpu['index']:<4}{gpu['uuid']:<42}{gpu['name'][:23]:<24}{memory:<22}{who}")
        if holders and holders[0]["share_bytes"]:
            lines.extend(f"      {format_size(holder['share_bytes'])}: {_holder(holder, now)}" for holder in holders)
    if status["queue"]:
        lines.append(f"  waiting ({len(status['queue'])}), first come first served:")
        for place, waiter in enumerate(status["queue"], 1):
            wants = _need(waiter["ngpus"], waiter["share_mib"] * MiB)
            lines.append(f"    {place}. job {waiter['job_id']} of {waiter.get('user', 'unknown')} wants {wants}, "
                         f"from {waiter['client']} ({waiter['server']}), waiting {_ago(now - waiter['since'])}")
    else:
        lines.append("  nobody waiting")
    return "\n".join(lines) + "\n"


def _need(ngpus: int, share_bytes: int) -> str:
    """What a request asks for, in words: '2 GPU(s)', 'all GPUs', or '4 GiB of one GPU'."""
    if share_bytes:
        return f"{format_size(share_bytes)} of one GPU"
    return "all GPUs" if ngpus < 0 else f"{ngpus} GPU(s)"


def _holder(holder: dict[str, Any], now: float) -> str:
    return (f"job {holder['job_id']} of {holder.get('user', 'unknown')} from {holder['client']} ({holder['server']}) "
            f"since {time.strftime('%H:%M:%S', time.localtime(holder['since']))} ({_ago(now - holder['since'])})")


def _unreachable(exc: Exception) -> str:
    return f"{'REFUSED' if isinstance(exc, RpycdlError) else 'UNREACHABLE'} ({exc})"


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _jobs(args: argparse.Namespace) -> int:
    results = each_server(args, "jobs")
    if args.json:
        print(json.dumps({f"{a[0]}:{a[1]}": (r if not isinstance(r, Exception) else str(r)) for a, r in results},
                         indent=2))
        return _reached(args, results)
    for (host, port), jobs in results:
        print(f"{host}:{port}")
        if isinstance(jobs, Exception):
            print(f"  {_unreachable(jobs)}")
            continue
        for job in jobs:
            when = time.strftime("%H:%M:%S", time.localtime(job["submitted"]))
            user = Identity(job["user"], job["user_verified"]).label
            print(f"  {job['job_id']}  {job['state']:<10} {_need(job['ngpus'], job['share_bytes']):<18} "
                  f"{user:<24} from {job['client']:<22} "
                  f"submitted {when}  {job['error']}")
    return _reached(args, results)


def _cancel(args: argparse.Namespace) -> int:
    unreachable = []
    for (host, port), open_connection in servers(args):
        try:
            with open_connection() as conn:
                if any(job["job_id"] == args.job_id for job in conn.root.jobs()):
                    state = conn.root.cancel(args.job_id)
                    print(f"job {args.job_id} ({state}) on {host}:{port}: cancel requested as "
                          f"{conn.identity['label']}")
                    return 0
        except NotAllowedError:  # a PermissionError, but the server's answer
            raise
        except (OSError, EOFError, AuthFailedError, LimitError) as exc:  # perhaps another server knows it
            unreachable.append(f"{host}:{port} ({exc})")
    unasked = f"; could not ask {', '.join(unreachable)}" if unreachable else ""
    raise RpycdlError(f"no server knows job {args.job_id}{unasked}")


COMMANDS = {"status": _status, "jobs": _jobs, "cancel": _cancel}
