"""`rpycdl serve --idle-reclaim DURATION`: the flag, its help and its check (rpycdl.server.reclaim does the rest)."""

from __future__ import annotations

import argparse
from typing import Any

from rpycdl.errors import InvalidRequestError
from rpycdl.units import parse_duration


def add_flags(serve: argparse.ArgumentParser) -> None:
    """Add --idle-reclaim to the serve subcommand."""
    serve.add_argument("--idle-reclaim", default="off", metavar="DURATION",
                       help="end a job or session whose GPUs show no utilization (NVML) for this long, such as 30m, "
                            "warning it on its output first, so that others get them; a detached job with retries= "
                            "left is requeued. A request keeps its GPUs with idle_reclaim=False, within its owner's "
                            "keep_idle of the --limits file (0 by default) (default: %(default)s)")


def limits(args: argparse.Namespace) -> dict[str, Any]:
    """--idle-reclaim as context.Limits' field, checked."""
    if args.idle_reclaim in ("off", "0"):
        return {"idle_reclaim": 0.0}
    seconds = parse_duration(args.idle_reclaim)
    if not seconds > 0:
        raise InvalidRequestError("--idle-reclaim must be a duration (30m, 2h) or off")
    return {"idle_reclaim": float(seconds)}
