"""What a server tells of its GPUs, its queue and its jobs, and cancelling a job: the bodies of the
service's status calls."""

from __future__ import annotations

import time
from typing import Any

from rpycdl.errors import InvalidRequestError, NotAllowedError
from rpycdl.security import auth
from rpycdl.server.context import ServerContext


def _snapshot(ctx: ServerContext) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Holders by GPU UUID, and the waiting requests that compete for this server's GPUs."""
    snapshot = ctx.locks.snapshot()
    mine = {gpu.uuid for gpu in ctx.gpus}
    return snapshot["held"], [waiter for waiter in snapshot["queue"] if mine & set(waiter["candidates"])]


def gpu_status(ctx: ServerContext) -> dict[str, Any]:
    """This server, each GPU with its holders (one whole-GPU job, or the jobs sharing it, each with its
    `share_bytes`, 0 for the whole GPU) and memory use, and the waiting queue in order."""
    held, queue = _snapshot(ctx)
    used = ctx.inventory.memory_used()
    gpus = [{**gpu.to_dict(), "memory_used": used.get(gpu.uuid), "holders": held.get(gpu.uuid, [])}
            for gpu in ctx.gpus]
    return {"server": ctx.info(), "gpus": gpus, "queue": queue, "time": time.time()}


def load(ctx: ServerContext) -> tuple[int, int, int]:
    """(free GPUs, waiting requests, GPUs): how soon a new job would run here."""
    held, queue = _snapshot(ctx)
    return sum(1 for gpu in ctx.gpus if gpu.uuid not in held), len(queue), len(ctx.gpus)


def jobs(ctx: ServerContext) -> list[dict[str, Any]]:
    """This server's job records, oldest first (a record whose connection process died is ended
    first: it never shows as pending or running)."""
    ctx.store.sweep()
    return [record.to_dict() for record in ctx.store.all() if record.server_id == ctx.server_id]


def cancel(ctx: ServerContext, me: auth.Identity, job_id: Any) -> str:
    """Ask to cancel a pending or running job of this server, as `me` (its owner, or an admin);
    returns its state when asked.

    Raises:
        InvalidRequestError: no such job here. NotAllowedError: someone else's.
    """
    if not isinstance(job_id, str) or not job_id.isalnum():
        raise InvalidRequestError(f"not a job id: {job_id!r}")
    record = ctx.store.load(job_id)
    if record is None or record.server_id != ctx.server_id:
        raise InvalidRequestError(f"no job {job_id} on this server")
    if not me.admin and (record.user, record.user_verified) != (me.user, me.verified):
        owner = auth.Identity(record.user, record.user_verified).label
        raise NotAllowedError(f"job {job_id} belongs to {owner} and you are {me.label}: only its owner "
                              "or an admin can cancel it")
    ctx.store.request_cancel(record)
    ctx.locks.wake_all()
    return record.state.value
