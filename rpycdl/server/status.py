"""What a server tells of its GPUs and its queue: the bodies of the service's status calls."""

from __future__ import annotations

import time
from typing import Any

from rpycdl.scheduler import limits
from rpycdl.security import visibility
from rpycdl.security.auth import Identity
from rpycdl.server.context import ServerContext


def _snapshot(ctx: ServerContext, plan: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Holders by GPU UUID, and the waiting requests that compete for this server's GPUs (with `plan`, their
    planned starts under backfill)."""
    snapshot = ctx.locks.snapshot(plan)
    return snapshot["held"], _mine(ctx, snapshot["queue"])


def _mine(ctx: ServerContext, queue: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The waiting requests of a host's `queue` that compete for this server's GPUs."""
    mine = {gpu.uuid for gpu in ctx.gpus}
    return [waiter for waiter in queue if mine & set(waiter["candidates"])]


def gpu_status(ctx: ServerContext, viewer: Identity) -> dict[str, Any]:
    """This server, each GPU with its holders (one whole-GPU job, or the jobs sharing it, each with its
    `share_bytes`, 0 for the whole GPU) and memory use, and the waiting queue in order; the holders and
    waiters of others than `viewer` as security.visibility shows them (no client address); while limits are
    in force (`rpycdl serve --limits`), each user's and group's use of the host against them (`limits`:
    rpycdl.scheduler.limits.standing: users, counts and limits, which anyone may see)."""
    host, now = ctx.locks.snapshot(plan=True), time.time()
    held, queue = host["held"], _mine(ctx, host["queue"])
    used = ctx.inventory.memory_used()
    gpus = [{**gpu.to_dict(), "memory_used": used.get(gpu.uuid),
             "holders": [visibility.shown(holder, viewer) for holder in held.get(gpu.uuid, [])]} for gpu in ctx.gpus]
    status = {"server": ctx.info(), "gpus": gpus, "queue": [visibility.shown(waiter, viewer) for waiter in queue],
              "time": now}
    standing = limits.standing(ctx.locks.root, host, ctx.ledger, now)
    if standing is not None:
        status["limits"] = standing
    return status


def load(ctx: ServerContext) -> tuple[int, int, int]:
    """(free GPUs, waiting requests, GPUs): how soon a new job would run here."""
    held, queue = _snapshot(ctx)
    return sum(1 for gpu in ctx.gpus if gpu.uuid not in held), len(queue), len(ctx.gpus)


def in_line(ctx: ServerContext, job_id: str) -> dict[str, Any]:
    """Where a waiting job stands now: lines()'s for it."""
    return lines(ctx).get(job_id, NOT_IN_LINE)


NOT_IN_LINE: dict[str, Any] = {"ahead": None, "holders": []}
"""in_line of a job that does not wait."""


def lines(ctx: ServerContext, snapshot: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Where each waiting job stands, by job id (in the lock manager's `snapshot`, taken now if not given):
    `ahead`, how many waiting requests are before it in line (in the order of the host's policy) and compete for
    its GPUs, `holders`, the jobs holding the GPUs it may use (holders()), and `reason`, why its owner's limits hold
    it back ("": they do not; rpycdl.scheduler.limits). One pass over the queue, counting
    those ahead by their set of GPUs (a server's requests share one), so that thousands waiting cost little."""
    snapshot = ctx.locks.snapshot() if snapshot is None else snapshot
    counted: dict[frozenset[str], int] = {}  # the requests met so far, by their candidates
    held: dict[frozenset[str], list[dict[str, Any]]] = {}
    found = {}
    for waiter in snapshot["queue"]:
        mine = frozenset(waiter["candidates"])
        if mine not in held:
            held[mine] = holders(ctx, snapshot["held"], waiter["candidates"])
        found[waiter["job_id"]] = {"ahead": sum(count for theirs, count in counted.items() if theirs & mine),
                                   "holders": held[mine], "reason": waiter.get("reason", "")}
        counted[mine] = counted.get(mine, 0) + 1
    return found


def holders(ctx: ServerContext, held: dict[str, list[dict[str, Any]]] | None = None,
            candidates: list[str] | None = None) -> list[dict[str, Any]]:
    """The jobs holding the GPUs `candidates` (UUIDs; default: this server's), which a request for them waits
    for (`held`: the lock manager's, read now if not given): for each GPU in order, each holder's job id, user,
    share (0: the whole GPU) and since when, with the GPU's UUID and its index on this server (None for a GPU
    of another server of the host). A job on two GPUs is there twice."""
    held = ctx.locks.held() if held is None else held
    index = {gpu.uuid: gpu.index for gpu in ctx.gpus}
    return [{"gpu": index.get(uuid), "uuid": uuid, "job_id": holder["job_id"], "user": holder.get("user", "unknown"),
             "share_bytes": holder.get("share_bytes", 0), "since": holder["since"]}
            for uuid in (list(index) if candidates is None else candidates) for holder in held.get(uuid, [])]
