"""`rpycdl serve`'s scheduling flags: how the host's GPUs are handed out (policy, placement, fair share, limits,
preemption), the same on every server of a lock directory."""

from __future__ import annotations

import argparse
import os

from rpycdl.defaults import PREEMPT_GRACE
from rpycdl.errors import InvalidRequestError, RpycdlError
from rpycdl.scheduler.fairshare import FairShare, read_settings
from rpycdl.scheduler.planning import PACK, PLACEMENTS
from rpycdl.scheduler.policies import FAIR, FCFS, OFF, POLICIES, PREEMPTS, Scheduling
from rpycdl.units import format_duration, parse_duration


def add_flags(serve: argparse.ArgumentParser) -> None:
    """How the host's GPUs are handed out: the same on every server of the lock directory."""
    serve.add_argument("--policy", default=FCFS, choices=POLICIES,
                       help="who goes next: fcfs, first come, first served; fcfs-backfill, a request that declared a "
                            "timeout may go first onto free GPUs if that delays nobody ahead; fair, the user who used "
                            "the fewest GPU-seconds lately (see --fair-share) (default: %(default)s)")
    serve.add_argument("--placement", default=PACK, choices=PLACEMENTS,
                       help="where a share of a GPU goes: pack, the fullest GPU with room; spread, the emptiest; "
                            "least-busy, the one whose measured SM and memory-bandwidth use is lowest (NVML) "
                            "(default: %(default)s)")
    serve.add_argument("--fair-share", default=None, metavar="FILE",
                       help="with --policy fair: a TOML file of half_life (default 1d) and [weights] (user = number, "
                            "default 1)")
    serve.add_argument("--limits", default=None, metavar="FILE", type=os.path.abspath,
                       help="per-user and per-group limits, for every server of the lock directory: a TOML file of "
                            "[default], [users.NAME] and [groups.NAME] (members = [...]) tables of gpus (held at "
                            "once), pending (waiting at once), gpu_hours_day, gpu_hours_week; a job over its owner's "
                            "limit waits while others go first; and priority, the highest priority= each may ask. Read "
                            "again on SIGHUP or change (docs/limits.md)")
    serve.add_argument("--preempt", default=OFF, choices=PREEMPTS,
                       help="when a waiting job cannot start because jobs of a lower priority hold the GPUs it needs: "
                            "off, it waits; requeue, the fewest, youngest of them are stopped (SIGTERM: their "
                            "rpycdl.on_preempt handler runs; SIGKILL after --preempt-grace), a detached one requeued "
                            "to resume from what it saved, an attached one or a session ended with PreemptedError; "
                            "cancel, every one ended so. The same on every server of the lock directory "
                            "(default: %(default)s; docs/sharing.md)")
    serve.add_argument("--preempt-grace", default=format_duration(PREEMPT_GRACE), metavar="DURATION",
                       help="how long a preempted job has to save a checkpoint between its SIGTERM and its SIGKILL "
                            "(default: %(default)s)")


def scheduling(args: argparse.Namespace) -> Scheduling:
    """The host's scheduling from the flags (a bad --fair-share file is a start failure)."""
    if args.fair_share is not None and args.policy != FAIR:
        raise InvalidRequestError("--fair-share is for --policy fair")
    try:
        fair = read_settings(args.fair_share) if args.fair_share else FairShare()
    except InvalidRequestError as exc:
        raise RpycdlError(str(exc)) from None
    return Scheduling(args.policy, args.placement, fair, args.preempt, parse_duration(args.preempt_grace))
