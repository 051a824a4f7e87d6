"""Who sees what of a job: its owner and admins all of it, everyone else only that it exists (its id, owner,
state, GPUs, times, server and place in line). The one rule for every path that shows jobs: the servers' job
calls and status (rpycdl.server.jobcalls, status), the monitor's JSON (rpycdl.monitor.host, pages), and so the
CLI and the dashboard, which show what those give.

The owner is a user *as proven*: a job of verified `alice` (her client certificate) is not the job of a client
that declares the name alice with the shared secret (`alice (unverified)`), so a declared name never unlocks a
verified user's job. An admin is one by certificate (security.tls.ADMIN_UNIT). docs/authentication.md, "Who sees
what", says this for users."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rpycdl.security.auth import Identity

UNVERIFIED = " (unverified)"
"""How Identity.label marks a declared name."""

PUBLIC = frozenset({
    # which job, whose
    "job_id", "user", "user_verified", "account", "array_id", "array_index",
    # its state and times
    "state", "cancel_requested", "submitted", "started", "ended", "since", "seconds",
    # its GPUs, how it runs (a call, command or container; whole or share), where, and its place in line
    "ngpus", "share_bytes", "share_mib", "gpus", "gpu_uuids", "candidates", "sizes_mib", "ranges", "kind",
    "detached", "service", "server", "server_id", "ahead", "position", "ticket", "sequence", "planned_start",
    "usage", "backfilled", "leftover", "reason", "priority",
    # while it waits, the jobs holding the GPUs it waits for: each of them by these public fields only
    # (rpycdl.server.status.holders: gpu, uuid, job_id, user, share_bytes, since)
    "holders",
})
"""The fields of a job's row (the ledger's, a GPU's holder, a waiting request, the monitor's rows) that anyone
may see. Everything else is its owner's: its command and arguments, name, working directory, client address,
error and exit code, log and result sizes, processes; a field added later is too, until it is listed here."""

REDUCED = "reduced"
"""The key a row shown without its owner's fields carries (true)."""


def sees_all(viewer: Identity | None, owner: Identity | None) -> bool:
    """Whether `viewer` (None: nobody authenticated) sees all of a job of `owner` (None: unknown), reads its
    log and result, cancels or deletes it: an admin, or its owner, the same user proven alike (both verified,
    or both declared)."""
    if viewer is None:
        return False
    return viewer.admin or (owner is not None and (owner.user, owner.verified) == (viewer.user, viewer.verified))


def owner_of(row: Mapping[str, Any]) -> Identity | None:
    """Whose job a row is: `user` and `user_verified` (the ledger's rows), else `user` as Identity.label
    writes it (holders, waiting requests, the monitor's rows); None if it names nobody."""
    user = row.get("user")
    if not isinstance(user, str) or not user:
        return None
    if "user_verified" in row:
        return Identity(user, bool(row["user_verified"]))
    if user.endswith(UNVERIFIED):
        return Identity(user[:-len(UNVERIFIED)])
    return Identity(user, verified=True)


def shown(row: dict[str, Any], viewer: Identity | None, owner: Identity | None = None) -> dict[str, Any]:
    """`row` as `viewer` may see it: all of it for its owner (`owner`, else owner_of(row)) or an admin; for
    anyone else its PUBLIC fields only, marked REDUCED."""
    if sees_all(viewer, owner if owner is not None else owner_of(row)):
        return row
    return {**{key: value for key, value in row.items() if key in PUBLIC}, REDUCED: True}


def refusal(job_id: str, owner: Identity | None, viewer: Identity | None) -> str:
    """Why `viewer` may not read a job's log or result, cancel or delete it."""
    whose = f"belongs to {owner.label}" if owner is not None else "has no known owner"
    who = "you are not authenticated" if viewer is None else f"you are {viewer.label}"
    return (f"job {job_id} {whose} and {who}: only its owner or an admin can read its log, result and artifacts, "
            "cancel or delete it")
