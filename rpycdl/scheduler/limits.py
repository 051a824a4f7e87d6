"""Per-user and per-group limits (`rpycdl serve --limits FILE`): the file's tables checked, their copy in the lock
directory that every process granting from it reads (`limits.json`), each account's GPUs held and GPU-hours used
against them (`Tally`), and the reason a job over its owner's limit waits.

A job over a limit is not refused (but for `pending`, checked at submit): it waits without holding the line, and
the requests behind it go first (rpycdl.scheduler.policies.decide skips it). Limits bind the account a request
counts against (its owner's user name: verified on a server that runs jobs as their owners, declared on a
one-account server).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpycdl.defaults import PRIORITY_HIGHEST
from rpycdl.errors import InvalidRequestError, LimitError
from rpycdl.scheduler import fairshare, lockdir, tomlfiles
from rpycdl.scheduler.ledger import Ledger

if TYPE_CHECKING:  # holders needs fasteners, which a client-only install lacks (the CLI reaches this module)
    from rpycdl.scheduler.holders import Records

IN_FORCE = "limits.json"
"""The lock directory's copy of the limits in force: {"source": the file, "limits": Limits.to_dict()}."""
CLAIMS = "limits"
"""The lock directory's folder where each live server given --limits share-locks `in-force`."""
USAGE = "limits-usage.json"
"""Each account's GPU-seconds in the last day and week as of `at`, by the servers from the ledger (refresh_usage)."""

DAY, WEEK = 24 * 3600.0, 7 * 24 * 3600.0
WINDOWS = {"gpu_hours_day": (DAY, "day"), "gpu_hours_week": (WEEK, "week")}


@dataclass(frozen=True)
class Limit:
    """One table of the file: GPUs held at once (a share counts as its fraction), jobs waiting at once, GPU-hours in
    a rolling day and week, jobs kept from --idle-reclaim at once; None: no limit (keep_idle: 0). `priority` is no limit
    of use but the highest priority its users may ask (rpycdl.scheduler.priorities; None: 0)."""

    gpus: float | None = None
    pending: int | None = None
    gpu_hours_day: float | None = None
    gpu_hours_week: float | None = None
    keep_idle: int | None = None  # jobs kept from --idle-reclaim at once (idle_reclaim=False): rpycdl.server.reclaim
    priority: int | None = None


WHOLE = ("pending", "keep_idle", "priority")
"""The keys that take whole numbers."""
KEYS = tuple(Limit.__dataclass_fields__)


@dataclass(frozen=True)
class Bound:
    """A limit that binds an account: its `value`, where the file says it (`users.alice.gpus`) and the accounts it
    counts together (the user alone, or a group's members)."""

    value: float
    where: str
    members: tuple[str, ...]
    who: str


@dataclass(frozen=True)
class Limits:
    """A site's limits: `[default]`, `[users.NAME]` (its keys override the default's) and `[groups.NAME]` (with
    `members`: their jobs together)."""

    default: Limit = field(default_factory=Limit)
    users: Mapping[str, Limit] = field(default_factory=dict)
    groups: Mapping[str, tuple[tuple[str, ...], Limit]] = field(default_factory=dict)

    def bounds(self, account: str, key: str) -> list[Bound]:
        """The limits of `key` (KEYS) that bind `account`: its own (or the default's), each of its groups'."""
        found = []
        own = self.own(account, key)
        if own is not None:
            found.append(Bound(*own, (account,), account))
        for name, (members, limit) in sorted(self.groups.items()):
            if account in members and getattr(limit, key) is not None:
                found.append(Bound(getattr(limit, key), f"groups.{name}.{key}", members,
                                   f"group {name} ({', '.join(members)})"))
        return found

    def own(self, account: str, key: str) -> tuple[float, str] | None:
        """The limit of `key` that binds `account` alone, and where the file says it: its own table's, else the
        default's (None: neither sets it)."""
        if getattr(self.users.get(account, Limit()), key) is not None:
            return getattr(self.users[account], key), f"users.{account}.{key}"
        if getattr(self.default, key) is not None:
            return getattr(self.default, key), f"default.{key}"
        return None

    def has(self, *keys: str) -> bool:
        """Whether any table sets one of `keys`."""
        tables = [self.default, *self.users.values(), *(limit for _, limit in self.groups.values())]
        return any(getattr(table, key) is not None for table in tables for key in keys)

    def to_dict(self) -> dict[str, Any]:
        return {"default": _table(self.default), "users": {name: _table(limit) for name, limit in self.users.items()},
                "groups": {name: {"members": list(members), **_table(limit)}
                           for name, (members, limit) in self.groups.items()}}


def _table(limit: Limit) -> dict[str, Any]:
    return {key: value for key, value in asdict(limit).items() if value is not None}


def read(path: str | os.PathLike[str]) -> Limits:
    """The limits of the file at `path` (TOML; see load).

    Raises:
        InvalidRequestError: the file cannot be read, is not TOML, or holds a bad table or value; named.
    """
    data = tomlfiles.read(path, "the limits file")
    return load(data, str(path))


def load(data: Mapping[str, Any], source: str) -> Limits:
    """The limits of a parsed file (`source` names it in errors): `[default]`, `[users.NAME]`, `[groups.NAME]` with
    `members = [...]`, each with any of KEYS (`pending` and `keep_idle` whole numbers, the others numbers, none
    negative).

    Raises:
        InvalidRequestError: an unknown table or key, a wrong type, a negative number.
    """
    unknown = set(data) - {"default", "users", "groups"}
    if unknown:
        raise InvalidRequestError(f"{source}: unknown table(s) {', '.join(sorted(unknown))} (default, users, groups)")
    users, groups = _tables(data, "users", source), _tables(data, "groups", source)
    default = _limit(data.get("default", {}), "default", source)
    for name, table in groups.items():
        members = table.get("members")
        if not isinstance(members, list) or not all(isinstance(member, str) for member in members):
            raise InvalidRequestError(f"{source}: groups.{name}.members must be a list of user names")
    return Limits(default, {name: _limit(table, f"users.{name}", source) for name, table in users.items()},
                  {name: (tuple(table["members"]), _limit({k: v for k, v in table.items() if k != "members"},
                                                          f"groups.{name}", source)) for name, table in groups.items()})


def _tables(data: Mapping[str, Any], kind: str, source: str) -> dict[str, Mapping[str, Any]]:
    tables = data.get(kind, {})
    if not isinstance(tables, Mapping) or not all(isinstance(table, Mapping) for table in tables.values()):
        raise InvalidRequestError(f"{source}: [{kind}] holds one table per name, such as [{kind}.alice]")
    return dict(tables)


def _limit(table: Any, where: str, source: str) -> Limit:
    if not isinstance(table, Mapping):
        raise InvalidRequestError(f"{source}: [{where}] must be a table")
    unknown = set(table) - set(KEYS)
    if unknown:
        raise InvalidRequestError(f"{source}: unknown key(s) {', '.join(sorted(unknown))} in [{where}] "
                                  f"({', '.join(KEYS)})")
    for key, value in table.items():
        whole = key in WHOLE
        kinds = int if whole else (int, float)
        top = PRIORITY_HIGHEST if key == "priority" else math.inf
        if isinstance(value, bool) or not isinstance(value, kinds) or not 0 <= value <= top or value == math.inf:
            kind = "a whole number" if whole else "a number"
            most = f" up to {top}" if top < math.inf else " or more"
            raise InvalidRequestError(f"{source}: {where}.{key} must be {kind}, 0{most}, not {value!r}")
    return Limit(**{key: int(value) if key in WHOLE else float(value) for key, value in table.items()})


def from_dict(data: Mapping[str, Any]) -> Limits:
    """Limits.to_dict() read back."""
    return load(data, IN_FORCE)


# -- the lock directory's copy ---------------------------------------------------------------


def publish(root: Path, limits: Limits, source: str) -> None:
    """Make `limits` (read from `source`) the ones in force for every process granting from the lock directory."""
    lockdir.write_json(root / IN_FORCE, {"source": source, "limits": limits.to_dict()})


def in_force(root: Path) -> Limits | None:
    """The limits in force in the lock directory `root` (None: none)."""
    data = lockdir.read_json(root / IN_FORCE)
    try:
        return from_dict(data["limits"]) if data else None
    except (KeyError, TypeError, InvalidRequestError):
        return None


def claim(root: Path, limits: Limits | None, source: str | None) -> None:
    """At a server's start: with `limits` (read from `source`), make them the ones in force and mark them so while
    this process lives; without, remove those in force unless a live server marks them (they were left by a
    server started with --limits that has stopped).

    Raises:
        RpycdlError: a live server enforces other limits (every server must be given the same file).
    """
    folder = root / CLAIMS
    if limits is None:
        if not _live(folder):
            (root / IN_FORCE).unlink(missing_ok=True)
        return
    theirs = in_force(root)
    if _live(folder) and theirs is not None and theirs != limits:
        where = (lockdir.read_json(root / IN_FORCE) or {}).get("source")
        raise InvalidRequestError(f"the lock directory {root} is used by servers that enforce other limits (from "
                                  f"{where}) than {source} says: give every server of a lock directory the same "
                                  "--limits file")
    publish(root, limits, str(source))
    lockdir.claim(folder, "in-force")


def _live(folder: Path) -> bool:
    return folder.is_dir() and bool(lockdir.others(lockdir.open_once(str(folder / "in-force")), 0, 0, []))


# -- use against the limits -------------------------------------------------------------------


def refresh_usage(root: Path, ledger: Ledger, now: float) -> None:
    """Write each account's GPU-seconds in the last day and week as the ledger has them at `now` (its running jobs'
    up to `now`), for Tally (which adds what running grants used since)."""
    lockdir.write_json(root / USAGE, {"at": now, **windows(ledger, now)})


def windows(ledger: Ledger, now: float) -> dict[str, dict[str, float]]:
    """Each account's GPU-seconds in each window (WINDOWS' keys) up to `now`, as the ledger has them."""
    jobs = ledger.usage_since(now - WEEK)
    return {key: window_usage(jobs, now - span, now) for key, (span, _) in WINDOWS.items()}


def window_usage(jobs: Iterable[tuple[str, float, float | None, float]], since: float,
                 until: float) -> dict[str, float]:
    """Each account's GPU-seconds between `since` and `until`, of `jobs` as Ledger.usage_since gives them (account,
    started, ended or None: running, GPUs)."""
    found: dict[str, float] = {}
    for account, started, ended, gpus in jobs:
        found[account] = found.get(account, 0.0) + fairshare.used(max(started, since), ended, gpus, until, math.inf)
    return {account: seconds for account, seconds in found.items() if seconds > 0}


@dataclass
class Tally:
    """What each account holds and used, against `limits`, on paper while one decision walks the queue.

    Attributes:
        held: GPUs each account holds now (a share as its fraction), with what the walk plans to grant added.
        used: GPU-seconds of each account in each window (WINDOWS' keys).
    """

    limits: Limits
    held: dict[str, float] = field(default_factory=dict)
    used: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def over(self, account: str, gpus: float) -> str:
        """Why a request of `account` for `gpus` GPUs must wait for its owner's limits ("" if it need not)."""
        for bound in self.limits.bounds(account, "gpus"):
            holds = sum(self.held.get(member, 0.0) for member in bound.members)
            if holds + gpus > bound.value + 1e-9:
                asks = "" if holds >= bound.value else f" and asks {_gpus(gpus)} more"
                return f"{bound.who} holds {_gpus(holds)}{asks}, the limit of {bound.where} = {bound.value:g}"
        for key, (_, span) in WINDOWS.items():
            for bound in self.limits.bounds(account, key):
                hours = sum(self.used.get(key, {}).get(member, 0.0) for member in bound.members) / 3600
                if hours >= bound.value:
                    return (f"{bound.who} used {hours:.1f} GPU-hours in the last {span}, "
                            f"the limit of {bound.where} = {bound.value:g}")
        return ""

    def take(self, account: str, gpus: float) -> None:
        """Plan `gpus` more GPUs as held by `account`."""
        self.held[account] = self.held.get(account, 0.0) + gpus


def _gpus(count: float) -> str:
    return f"{count:g} GPU{'' if count == 1 else 's'}"


def tally(root: Path, records: Records, now: float) -> Tally | None:
    """The Tally of the limits in force in the lock directory `root` (None: none), from the grants' `records` (each
    GPU's holders: account, GPUs, since) and the servers' usage snapshot."""
    limits = in_force(root)
    if limits is None:
        return None
    running = running_grants(record for entries in records.values() for _, record in entries)
    held = holding(running)
    used: dict[str, dict[str, float]] = {}
    if limits.has(*WINDOWS):
        snapshot = lockdir.read_json(root / USAGE) or {}
        at = float(snapshot.get("at", now))
        for key in WINDOWS:
            used[key] = dict(snapshot.get(key, {}))
            for account, seconds in window_usage([(a, s, None, g) for a, s, g in running], at, now).items():
                used[key][account] = used[key].get(account, 0.0) + seconds
    return Tally(limits, held, used)


def running_grants(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, float, float]]:
    """(account, since, GPUs) of each of the grants' records (a job on two GPUs has a record on each, its GPUs
    split among them)."""
    return [(record.get("account", ""), record["since"], record.get("gpus", 1.0)) for record in records]


def holding(running: Iterable[tuple[str, float, float]]) -> dict[str, float]:
    """The GPUs each account holds, of running_grants()."""
    held: dict[str, float] = {}
    for account, _, gpus in running:
        held[account] = held.get(account, 0.0) + gpus
    return held


def standing(root: Path, snapshot: Mapping[str, Any], ledger: Ledger, now: float) -> list[dict[str, Any]] | None:
    """Each user's and group's use against the limits in force in the lock directory `root` (None: none), for
    those who show it (the monitor, `rpycdl status`): from a lock manager's `snapshot` (its grants' records, its
    queue) and the ledger's GPU-hours up to `now`. One dict per user (those the file names, and any who holds,
    waits or ran a job in the last week), then per group of the file: {"kind": "user" or "group", "name",
    "members", "gpus" (held now), "pending" (requests waiting), "gpu_hours_day", "gpu_hours_week" (GPU-hours in
    the rolling windows), "limits": {key: value} of the KEYS that bind it (its own or the default's; a group's
    own)}: users, counts and limits only, which anyone may see."""
    limits = in_force(root)
    if limits is None:
        return None
    held = holding(running_grants(record for records in snapshot["held"].values() for record in records))
    pending: dict[str, float] = {}
    for waiter in snapshot["queue"]:
        pending[waiter.get("account", "")] = pending.get(waiter.get("account", ""), 0) + 1
    used = windows(ledger, now)
    counts = {"gpus": held, "pending": pending,
              **{key: {account: seconds / 3600 for account, seconds in used[key].items()} for key in WINDOWS}}
    users = sorted(set(limits.users).union(*counts.values()) - {""})
    rows = [_standing("user", name, (name,), counts, {key: (limits.own(name, key) or (None,))[0] for key in KEYS})
            for name in users]
    rows += [_standing("group", name, members, counts, _table(limit))
             for name, (members, limit) in sorted(limits.groups.items())]
    return rows


def _standing(kind: str, name: str, members: tuple[str, ...], counts: Mapping[str, Mapping[str, float]],
              bound: Mapping[str, float | None]) -> dict[str, Any]:
    return {"kind": kind, "name": name, "members": list(members),
            **{key: sum(found.get(member, 0) for member in members) for key, found in counts.items()},
            "limits": {key: value for key, value in bound.items() if value is not None}}


def check_request(root: str | os.PathLike[str], account: str, gpus: float,
                  queue: Callable[[], Iterable[Mapping[str, Any]]], job_id: str = "", count: int = 1) -> None:
    """Refuse `count` jobs (an array's elements) of `account` for `gpus` whole GPUs each that its limits would never
    let run at once, or that would wait over a `pending` limit, given the requests waiting now (`queue()`'s
    entries, read only where a limit is in force; `job_id`'s own not counted).

    Raises:
        LimitError: the limit, where the file says it, and how many wait.
    """
    limits = in_force(Path(root))
    if limits is None:
        return
    for bound in limits.bounds(account, "gpus"):
        if gpus > bound.value + 1e-9:
            raise LimitError(f"{account} asks {_gpus(gpus)}, more than the limit of {bound.where} = {bound.value:g} "
                             "(the --limits file) ever lets run at once")
    bounds = limits.bounds(account, "pending")
    accounts = [entry.get("account", "") for entry in queue() if entry.get("job_id") != job_id] if bounds else []
    for bound in bounds:
        waiting = sum(accounts.count(member) for member in bound.members)
        if waiting + count > bound.value:
            more = "" if count == 1 else f", and an array of {count} would pass it (nothing was submitted)"
            raise LimitError(f"{bound.who} has {waiting} job(s) waiting, the limit of {bound.where} = "
                             f"{bound.value:g} (the --limits file){more}; wait for some to start")
