"""How the client hands out what servers tell of jobs and GPUs, and how it reads: `client_row`, the one place
where the rows and status that travel (epoch seconds, `ahead` as the queued requests alone, as every server
sends them) become what the client gives (datetimes, `ahead` counting the jobs that hold the GPUs too);
`JobList` and `GPUStatus`, which Jupyter shows as tables (`_repr_html_`), and the HTML of a job (a waiting one
with why its owner's limits hold it back: `held_back`); each user's use against the limits (`standing_cells`)."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from rpycdl.security.auth import Identity
from rpycdl.states import JobState, clock, held_by, need_text, waiting_for
from rpycdl.units import format_duration, format_size

TIMES = frozenset({"submitted", "started", "ended", "since", "time", "planned_start"})
"""The keys of a row, a holder, a waiter or a status that hold a moment (epoch seconds on the wire)."""


def client_row(value: Any) -> Any:
    """A row, a list of rows, a GPU status or a state's info as the client gives it: every moment (TIMES) a
    timezone-aware datetime, and a waiting job's `ahead` counting the jobs that hold the GPUs it waits for as
    well as the requests queued before it (the server's `ahead` counts those alone). Anything else as it is;
    applied twice, the same."""
    if isinstance(value, list):
        return [client_row(item) for item in value]
    if not isinstance(value, dict):
        return value
    row = {key: _moment(item) if key in TIMES else client_row(item) for key, item in value.items()}
    holders = row.get("holders")
    if row.get("ahead") is not None and holders is not None and "queued" not in row:
        row["queued"] = row["ahead"]
        row["ahead"] += len({holder["job_id"] for holder in holders})
    return row


def _moment(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return datetime.fromtimestamp(value).astimezone()
    return value


def seconds(since: datetime | None, until: datetime | None) -> float | None:
    """Seconds from `since` to `until` (now if None); None without `since`."""
    if since is None:
        return None
    return ((until or datetime.now(since.tzinfo)) - since).total_seconds()


class JobList(list):  # type: ignore[type-arg]
    """Rows of jobs (conn.root.jobs()), newest first: a list of dicts, which Jupyter shows as a table."""

    def _repr_html_(self) -> str:
        return jobs_html(self)


class GPUStatus(dict):  # type: ignore[type-arg]
    """A server's GPUs, their holders and its queue (conn.root.gpu_status()): a dict, which Jupyter shows as
    tables."""

    def _repr_html_(self) -> str:
        return status_html(self)


def job_cells(row: Mapping[str, Any]) -> list[str]:
    """A job's row as the cells of a table: id, name, state, user, GPUs, waited, ran, its peak memory and CPU
    time (usage_cells), and what it waits for or why it ended."""
    started, ended = row.get("started"), row.get("ended")
    waited = seconds(row.get("submitted"), started or ended)
    ran = seconds(started, ended)
    info = held_back(row) or waiting_for(row) or row.get("error") or (
        f"exit {row['exit_code']}" if row.get("exit_code") is not None else "")
    user = Identity(row.get("user", "unknown"), bool(row.get("user_verified"))).label
    return [row["job_id"], row.get("name") or "-", row["state"], user, gpus_text(row),
            "-" if waited is None else format_duration(waited), "-" if ran is None else format_duration(ran),
            *usage_cells(row)[:2], info]


def held_back(row: Mapping[str, Any]) -> str:
    """Why a PENDING job's owner's limits hold it back, in words ('held back: alice holds 1 GPU, the limit of
    users.alice.gpus = 1'); "" for a job they do not hold back, or that does not wait."""
    reason = row.get("reason") if row.get("state") == JobState.PENDING.value else ""
    return f"held back: {reason}" if reason else ""


STANDING_HEADER = ["user", "GPUs held", "GPU-hours, last day", "GPU-hours, last week", "waiting"]
"""The columns of standing_cells."""


def standing_cells(row: Mapping[str, Any]) -> list[str]:
    """A user's or group's use against the limits in force (a row of a status's `limits`:
    rpycdl.scheduler.limits.standing) as cells: who ('group vision (alice, bob)' for a group), then GPUs held,
    GPU-hours in the last day and week and requests waiting, each as '1 / 2' against its limit, or alone where
    none binds."""
    who = f"group {row['name']} ({', '.join(row['members'])})" if row["kind"] == "group" else row["name"]
    cells = [who]
    for key in ("gpus", "gpu_hours_day", "gpu_hours_week", "pending"):
        limit = row["limits"].get(key)
        cells.append(_figure(key, row[key]) + ("" if limit is None else f" / {_figure(key, limit)}"))
    return cells


def _figure(key: str, count: float) -> str:
    return f"{count:.1f}" if key.startswith("gpu_hours") else f"{count:g}"


def usage_cells(row: Mapping[str, Any]) -> list[str]:
    """What a job used, as the server measured it at its end: its peak host memory, CPU time and most processes
    at once ('-' for each not measured, or not shown to this viewer)."""
    memory, cpu, procs = (row.get(key) for key in ("peak_memory", "cpu_seconds", "max_procs"))
    return ["-" if memory is None else format_size(memory), cpu_text(cpu), "-" if procs is None else str(procs)]


def cpu_text(cpu_seconds: float | None) -> str:
    """CPU time in words: to a tenth of a second under a minute ('0.4s', '12.3s'), else to the second as
    format_duration writes it ('3m05s', '1h02m'); '-' for None."""
    if cpu_seconds is None:
        return "-"
    return f"{cpu_seconds:.1f}s" if round(cpu_seconds, 1) < 60 else format_duration(round(cpu_seconds))


def gpus_text(row: Mapping[str, Any]) -> str:
    """What a job holds (its GPUs' UUIDs, shortened) or asks for."""
    held = row.get("gpu_uuids") or []
    if held:
        return ", ".join(uuid[:12] for uuid in held)
    return need_text(row.get("ngpus", 1), row.get("share_bytes", 0))


JOB_HEADER = ["job", "name", "state", "user", "GPUs", "waited", "ran", "peak memory", "CPU", "info"]


def table(header: Iterable[str], rows: Iterable[Iterable[Any]], caption: str = "") -> str:
    """An HTML table, every cell escaped."""
    head = "".join(f"<th>{html.escape(str(cell))}</th>" for cell in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    title = f"<caption style='text-align:left'>{html.escape(caption)}</caption>" if caption else ""
    return f"<table class='rpycdl'>{title}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def jobs_html(rows: Iterable[Mapping[str, Any]]) -> str:
    """Jobs as an HTML table."""
    listed = list(rows)
    return table(JOB_HEADER, [job_cells(row) for row in listed], f"{len(listed)} job(s)")


def status_html(status: Mapping[str, Any]) -> str:
    """A server's GPUs (who holds each, since when) and its queue as HTML tables."""
    server = status.get("server", {})
    gpus = []
    for gpu in status.get("gpus", []):
        used = gpu.get("memory_used")
        memory = f"{'?' if used is None else format_size(used)} / {format_size(gpu['memory_total'])}"
        holders = "; ".join(f"job {holder['job_id']} of {holder.get('user', 'unknown')} since {clock(holder['since'])}"
                            + (f", {format_size(holder['share_bytes'])}" if holder.get("share_bytes") else "")
                            for holder in gpu.get("holders", [])) or "free"
        gpus.append([gpu["index"], gpu.get("name", ""), memory, holders])
    where = f"{server.get('name', '?')} at {server.get('host', '?')}:{server.get('port', '?')}"
    parts = [table(["GPU", "name", "memory used", "held by"], gpus, where)]
    queue = [[place, waiter["job_id"], waiter.get("user", "unknown"),
              need_text(waiter.get("ngpus", 1), waiter.get("share_mib", 0) * 1024**2),
              format_duration(seconds(waiter["since"], status.get("time")) or 0.0), waiter.get("reason") or ""]
             for place, waiter in enumerate(status.get("queue", []), 1)]
    parts.append(table(["#", "job", "user", "wants", "waiting", "held back"], queue, "waiting") if queue
                 else "<p>nobody waiting</p>")
    if status.get("limits") is not None:
        parts.append(table(STANDING_HEADER, [standing_cells(row) for row in status["limits"]],
                           "use against the limits in force"))
    return "".join(parts)


def job_text(row: Mapping[str, Any], read_at: datetime) -> str:
    """A job in one line: its state, where it runs or what it waits for, and when that was read."""
    state = row["state"]
    if held_back(row):
        state += f" ({held_back(row)})"
    elif state == JobState.PENDING.value and row.get("holders"):
        state += f" ({held_by(row['holders'])})"
    elif state == JobState.RUNNING.value and row.get("gpu_uuids"):
        state += f" on {gpus_text(row)}"
    elif row.get("error"):
        state += f": {row['error']}"
    return f"{state}, read at {read_at.strftime('%H:%M:%S')}"
