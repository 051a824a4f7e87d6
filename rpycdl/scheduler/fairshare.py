"""Fair share: each account's recent use of GPUs (GPU-seconds, each second counting less as it ages, halved
every half-life), divided by its weight from the site's file, read from the job ledger into a snapshot in
the lock directory (`fair-share.json`) and from the grants running now.

The snapshot is made by the host's servers (`refresh`, every FAIR_SHARE_REFRESH seconds, a step each: the
usage it had, decayed, plus what ran since), so that every process that grants reads the same figures
under the queue lock, and no grant waits for the ledger. Between two refreshes, `usage` adds what the
running grants used since the snapshot.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler import lockdir, tomlfiles
from rpycdl.scheduler.ledger import Ledger
from rpycdl.units import parse_duration

SNAPSHOT = "fair-share.json"
DEFAULT_HALF_LIFE = 24 * 3600.0
HISTORY = 10
"""Half-lives of the ledger a first snapshot reads: what is older counts less than a thousandth."""


@dataclass(frozen=True)
class FairShare:
    """A site's fair-share settings: the half-life of usage (seconds) and each account's weight (1 if not
    named; an account of weight 2 may use twice the GPU-seconds of one of weight 1 before it waits behind it)."""

    half_life: float = DEFAULT_HALF_LIFE
    weights: Mapping[str, float] = field(default_factory=dict)

    def weight(self, account: str) -> float:
        return self.weights.get(account, 1.0)

    def fingerprint(self) -> str:
        """Words that tell two settings apart (every server sharing a lock directory must agree)."""
        named = ",".join(f"{account}={weight:g}" for account, weight in sorted(self.weights.items()))
        return f"half-life={self.half_life:g}s;weights={named or 'none'}"


def read_settings(path: str | os.PathLike[str]) -> FairShare:
    """The settings of the site's fair-share file at `path` (see load_settings).

    Raises:
        InvalidRequestError: the file cannot be read, is not TOML, or holds a bad setting; named.
    """
    data = tomlfiles.read(path, "the fair-share file")
    return load_settings(data, str(path))


def load_settings(data: Mapping[str, Any], source: str) -> FairShare:
    """The settings of a site's fair-share file (TOML: `half_life = "1d"` and a `[weights]` table of
    account = number), `source` naming it in errors.

    Raises:
        InvalidRequestError: an unknown key, a bad half-life or weight.
    """
    unknown = set(data) - {"half_life", "weights"}
    if unknown:
        raise InvalidRequestError(f"{source}: unknown setting(s) {', '.join(sorted(unknown))} (half_life, weights)")
    try:
        half_life = parse_duration(str(data.get("half_life", f"{DEFAULT_HALF_LIFE:g}")))
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{source}: half_life: {exc}") from None
    if not half_life > 0:
        raise InvalidRequestError(f"{source}: half_life must be a positive duration, such as 1d or 12h")
    weights = data.get("weights", {})
    if not isinstance(weights, Mapping):
        raise InvalidRequestError(f"{source}: [weights] is a table of account = weight")
    for account, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise InvalidRequestError(f"{source}: the weight of {account!r} must be a positive number, not {weight!r}")
    return FairShare(half_life, {str(account): float(weight) for account, weight in weights.items()})


def used(started: float, ended: float | None, gpus: float, until: float, half_life: float) -> float:
    """The decayed GPU-seconds at `until` of `gpus` GPUs used from `started` to `ended` (None: still in use
    at `until`): each second counts 2 ** -(its age at `until` / half_life); all alike with an infinite half-life."""
    end = until if ended is None else min(ended, until)
    if end <= started:
        return 0.0
    if half_life == math.inf:
        return gpus * (end - started)
    rate = math.log(2) / half_life
    return gpus / rate * math.exp(-rate * (until - end)) * -math.expm1(-rate * (end - started))


def decayed(value: float, since: float, until: float, half_life: float) -> float:
    """`value` decayed from `since` to `until`."""
    return value * 2.0 ** (-(until - since) / half_life)


@dataclass(frozen=True)
class Snapshot:
    """Each account's decayed GPU-seconds at time `at`."""

    at: float
    usage: Mapping[str, float]


def read_snapshot(lock_dir: str | os.PathLike[str]) -> Snapshot | None:
    """The host's snapshot, or None (none made yet, or unreadable)."""
    data = lockdir.read_json(Path(lock_dir) / SNAPSHOT)
    try:
        return Snapshot(float(data["at"]), {str(k): float(v) for k, v in data["usage"].items()})  # type: ignore[index]
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def step(previous: Snapshot | None, jobs: Iterable[tuple[str, float, float | None, float]], now: float,
         half_life: float) -> Snapshot:
    """The snapshot at `now`: `previous` decayed, plus what `jobs` used since it was made (all of what they
    used, with no previous one). `jobs` are (account, started, ended or None, GPUs): at least every job that
    ran after `previous.at`."""
    since = previous.at if previous is not None else -math.inf
    usage = {account: decayed(value, since, now, half_life) for account, value in (previous.usage if previous
                                                                                  else {}).items()}
    for account, started, ended, gpus in jobs:
        if ended is not None and ended <= since:
            continue
        usage[account] = usage.get(account, 0.0) + used(max(started, since), ended, gpus, now, half_life)
    return Snapshot(now, {account: value for account, value in usage.items() if value > 1e-9})


def refresh(lock_dir: str | os.PathLike[str], ledger: Ledger, settings: FairShare,
            now: float | None = None) -> Snapshot:
    """Make the host's snapshot anew: the last one stepped to now with what the ledger says ran since (with
    none, the last HISTORY half-lives of the ledger), written whole (readers see the old or the new)."""
    now = time.time() if now is None else now
    previous = read_snapshot(lock_dir)
    since = previous.at if previous is not None else now - HISTORY * settings.half_life
    snapshot = step(previous, ledger.usage_since(since), now, settings.half_life)
    lockdir.write_json(Path(lock_dir) / SNAPSHOT, {"at": snapshot.at, "usage": dict(snapshot.usage)})
    return snapshot


def usage(snapshot: Snapshot | None, running: Iterable[tuple[str, float, float]], settings: FairShare,
          now: float | None = None) -> dict[str, float]:
    """Each account's weighted usage now: the snapshot decayed to now, plus what the `running` grants
    (account, since, GPUs) used since the snapshot, divided by the account's weight."""
    now = time.time() if now is None else now
    at = snapshot.at if snapshot is not None else -math.inf
    totals = {account: decayed(value, at, now, settings.half_life)
              for account, value in (snapshot.usage if snapshot else {}).items()}
    for account, since, gpus in running:
        totals[account] = totals.get(account, 0.0) + used(max(since, at), None, gpus, now, settings.half_life)
    return {account: value / settings.weight(account) for account, value in totals.items()}
