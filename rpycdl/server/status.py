"""What a server tells of its GPUs and its queue: the bodies of the service's status calls."""

from __future__ import annotations

import time
from typing import Any

from rpycdl.security import visibility
from rpycdl.security.auth import Identity
from rpycdl.server.context import ServerContext


def _snapshot(ctx: ServerContext, plan: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Holders by GPU UUID, and the waiting requests that compete for this server's GPUs (with `plan`, their
    planned starts under backfill)."""
    snapshot = ctx.locks.snapshot(plan)
    mine = {gpu.uuid for gpu in ctx.gpus}
    return snapshot["held"], [waiter for waiter in snapshot["queue"] if mine & set(waiter["candidates"])]


def gpu_status(ctx: ServerContext, viewer: Identity) -> dict[str, Any]:
    """This server, each GPU with its holders (one whole-GPU job, or the jobs sharing it, each with its
    `share_bytes`, 0 for the whole GPU) and memory use, and the waiting queue in order; the holders and
    waiters of others than `viewer` as security.visibility shows them (no client address)."""
    held, queue = _snapshot(ctx, plan=True)
    used = ctx.inventory.memory_used()
    gpus = [{**gpu.to_dict(), "memory_used": used.get(gpu.uuid),
             "holders": [visibility.shown(holder, viewer) for holder in held.get(gpu.uuid, [])]} for gpu in ctx.gpus]
    return {"server": ctx.info(), "gpus": gpus, "queue": [visibility.shown(waiter, viewer) for waiter in queue],
            "time": time.time()}


def load(ctx: ServerContext) -> tuple[int, int, int]:
    """(free GPUs, waiting requests, GPUs): how soon a new job would run here."""
    held, queue = _snapshot(ctx)
    return sum(1 for gpu in ctx.gpus if gpu.uuid not in held), len(queue), len(ctx.gpus)


def ahead(ctx: ServerContext, job_id: str) -> int | None:
    """How many waiting requests are before a job's in line, in the order of the host's policy, and compete
    for its GPUs (None if it does not wait)."""
    queue = ctx.locks.snapshot()["queue"]
    place = next((place for place, waiter in enumerate(queue) if waiter["job_id"] == job_id), None)
    if place is None:
        return None
    mine = set(queue[place]["candidates"])
    return sum(1 for waiter in queue[:place] if mine & set(waiter["candidates"]))
