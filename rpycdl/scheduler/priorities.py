"""Job priorities (`priority=`, `--priority`): a whole number from LOWEST to HIGHEST, DEFAULT unless asked. Every
policy orders the waiting requests by priority first, then as it does without (rpycdl.scheduler.policies.order:
the documented exception to first come, first served). How high a user may ask is their ceiling, the `priority`
key of the limits file (rpycdl.scheduler.limits: their own table's, else `[default]`'s, raised by any of their
groups'; DEFAULT where none says), or any for an admin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rpycdl.defaults import PRIORITY_HIGHEST, PRIORITY_LOWEST
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import limits

LOWEST, DEFAULT, HIGHEST = PRIORITY_LOWEST, 0, PRIORITY_HIGHEST


def check(value: Any) -> int:
    """A request's `priority=` (None: DEFAULT), checked.

    Raises:
        InvalidRequestError: not a whole number from LOWEST to HIGHEST (a bool is none).
    """
    if value is None:
        return DEFAULT
    if isinstance(value, bool) or not isinstance(value, int) or not LOWEST <= value <= HIGHEST:
        raise InvalidRequestError(f"priority={value!r}: must be a whole number from {LOWEST} to {HIGHEST} "
                                  f"(default {DEFAULT}; higher goes first)")
    return value


def ceiling(found: limits.Limits | None, account: str) -> tuple[int, str]:
    """The highest priority `account` may ask under the limits `found` (None: none in force), and where that is said
    (`users.alice.priority`, `groups.vision.priority`, or that no file says it)."""
    if found is None:
        return DEFAULT, "the default: no --limits file is in force"
    best, where = DEFAULT, "the default: the --limits file gives none"
    for bound in found.bounds(account, "priority"):  # their own (or the default's) first, then their groups'
        if bound.value >= best:
            best, where = int(bound.value), bound.where
    return best, where


def allow(root: str | os.PathLike[str], account: str, priority: int, *, admin: bool = False, label: str = "") -> None:
    """Refuse a request of `account` (`label` in words) at `priority` above their ceiling in the lock directory
    `root`'s limits in force; an `admin` may ask any.

    Raises:
        LimitError: the ceiling, and where it is set.
    """
    if priority <= DEFAULT or admin:
        return
    most, where = ceiling(limits.in_force(Path(root)), account)
    if priority > most:
        raise LimitError(f"priority={priority}: {label or account} may ask at most {most} ({where}); an admin may "
                         "ask more, or raise their `priority` in the --limits file")
