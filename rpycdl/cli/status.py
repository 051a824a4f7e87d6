"""`rpycdl status`: what the servers' GPUs are, who holds them, and who waits for them."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timedelta
from typing import Any

from rpycdl.cli.common import EXIT_FAILED, Command, each_server, iso, report_unreached, server_flags, table
from rpycdl.client.displays import STANDING_HEADER, seconds, standing_cells
from rpycdl.errors import RpycdlError
from rpycdl.states import need_text
from rpycdl.units import MiB, format_duration, format_size


def add_commands(command: Command) -> None:
    """Add status to the `rpycdl` parser."""
    sub = command("status", "show each GPU, who holds it, and who waits",
                  "Show every GPU of every server the registry knows (or of one service, or of the server at "
                  "--host): its memory, who holds it or a share of it, and who waits for GPUs, in order. Exits with "
                  f"{EXIT_FAILED} if a server could not be reached (the others are shown all the same).")
    sub.add_argument("service", nargs="?", default=None,
                     help="only servers of this service (default: every server the registry knows)")
    sub.add_argument("--json", action="store_true", help="print JSON")
    server_flags(sub)


def _status(args: argparse.Namespace) -> int:
    results = each_server(args, "gpu_status")
    if args.json:
        print(json.dumps([r if not isinstance(r, Exception) else {"address": list(a), "error": str(r)}
                          for a, r in results], indent=2, default=iso))
    else:
        for address, status in results:
            print(format_status(address, status))
    return report_unreached(args, results)


def format_status(address: tuple[str, int], status: dict[str, Any] | Exception) -> str:
    """Human-readable status of one server (as conn.root.gpu_status() gives it: times as datetimes)."""
    if isinstance(status, Exception):
        return f"{address[0]}:{address[1]}  {_unreachable(status)}\n"
    now = status["time"]
    server = status["server"]
    kind = "simulated " + server["inventory"] if server["simulated"] else "NVML"
    scheduling = server.get("scheduling") or {"policy": "fcfs", "placement": "pack"}  # a server before policies
    isolation = server.get("isolation", "one account")  # a server before isolation ran every job as itself
    preloaded = ", ".join(server.get("preload", [])) or "nothing"
    fencing = server.get("fencing", "none")  # a server before fencing fenced nothing
    lines = [f"{server['name']} @ {address[0]}:{address[1]}  [{', '.join(server['aliases'])}]  {kind}  "
             f"policy {scheduling['policy']}, placement {scheduling['placement']}, isolation: {isolation}, "
             f"fencing: {fencing}, preloaded: {preloaded}"]
    rows = []
    for gpu in status["gpus"]:
        used = "?" if gpu["memory_used"] is None else format_size(gpu["memory_used"])
        holders = gpu["holders"]
        if not holders:
            who = "free"
        elif not holders[0]["share_bytes"]:
            who = "whole: " + _holder(holders[0], now)
        else:
            granted = format_size(sum(holder["share_bytes"] for holder in holders))
            who = f"shared: {granted} of {format_size(gpu['memory_total'])} granted to {len(holders)} job(s)"
        rows.append([str(gpu["index"]), gpu["uuid"], gpu["name"], f"{used} / {format_size(gpu['memory_total'])}", who])
    header, *shown = table(["GPU", "UUID", "NAME", "MEMORY USED", "HELD BY"], rows, indent="  ")
    lines.append(header)
    for gpu, line in zip(status["gpus"], shown, strict=True):
        lines.append(line)
        if gpu["holders"] and gpu["holders"][0]["share_bytes"]:
            lines.extend(f"      {format_size(holder['share_bytes'])}: {_holder(holder, now)}"
                         for holder in gpu["holders"])
    if status["queue"]:
        lines.append(f"  waiting ({len(status['queue'])}), {ORDERS.get(scheduling['policy'], 'in order')}:")
        for place, waiter in enumerate(status["queue"], 1):
            wants = need_text(waiter["ngpus"], waiter["share_mib"] * MiB)
            waited = format_duration(seconds(waiter["since"], now) or 0.0)
            why = f"; held back: {waiter['reason']}" if waiter.get("reason") else ""
            lines.append(f"    {place}. job {waiter['job_id']} of {waiter.get('user', 'unknown')} wants {wants}, "
                         f"{_source(waiter)}, waiting {waited}{_plan(waiter, place, now)}{why}")
    else:
        lines.append("  nobody waiting")
    lines.extend(_limits(status.get("limits")))
    return "\n".join(lines) + "\n"


def _limits(standing: list[dict[str, Any]] | None) -> list[str]:
    """The lines of each user's and group's use of the host against the limits in force (none while none are)."""
    if standing is None:
        return []
    if not standing:
        return ["  limits in force: nobody holds, waits or used GPUs this week"]
    rows = [standing_cells(row) for row in standing]
    return ["  use against the limits in force:", *table([cell.upper() for cell in STANDING_HEADER], rows,
                                                         indent="    ")]


ORDERS = {"fcfs": "first come first served", "fcfs-backfill": "first come first served, with backfill",
          "fair": "fair share: least recent GPU use first"}


def _holder(holder: dict[str, Any], now: float) -> str:
    since = _clock(holder["since"])
    until = "" if holder.get("seconds") is None else \
        f", until {_clock(holder['since'] + timedelta(seconds=holder['seconds']))} at most"
    backfilled = ", backfilled" if holder.get("backfilled") else ""
    return (f"job {holder['job_id']} of {holder.get('user', 'unknown')} {_source(holder)} "
            f"since {since} ({format_duration(seconds(holder['since'], now) or 0.0)}{until}{backfilled})")


def _source(entry: dict[str, Any]) -> str:
    """Where a holder's or waiter's request came from: its client, which only its owner and admins see
    (security.visibility), and its server."""
    return f"from {entry['client']} ({entry['server']})" if "client" in entry else f"on {entry['server']}"


def _plan(waiter: dict[str, Any], place: int, now: float) -> str:
    """What the policy says of a waiting request: its planned start under backfill (the first one's is
    reserved), its user's recent GPU use under fair share."""
    if "usage" in waiter:
        return f"; its user's recent use {waiter['usage'] / 3600:.2f} GPU-hours"
    if "planned_start" not in waiter:
        return ""
    if waiter["planned_start"] is None:
        return "; start unknown (a job ahead declared no timeout)"
    start = waiter["planned_start"]
    return (f"; {'reserved start' if place == 1 else 'planned start'} {_clock(start)} "
            f"(in {format_duration(max(0.0, seconds(now, start) or 0.0))})")


def _clock(when: datetime) -> str:
    return when.strftime("%H:%M:%S")


def _unreachable(exc: Exception) -> str:
    refused = isinstance(exc, RpycdlError) and not isinstance(exc, (OSError, EOFError))  # not ConnectionFailedError
    return f"{'REFUSED' if refused else 'UNREACHABLE'} ({exc})"


COMMANDS = {"status": _status}
