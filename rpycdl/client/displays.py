"""How the client hands out what servers tell of jobs and GPUs, and how it reads: `client_row`, the one place
where the rows and status that travel (epoch seconds, `ahead` as the queued requests alone, as every server
sends them) become what the client gives (datetimes, `ahead` counting the jobs that hold the GPUs too);
`JobList` and `GPUStatus`, which Jupyter shows as tables (`_repr_html_`), and the HTML of a job."""

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
    info = waiting_for(row) or row.get("error") or (f"exit {row['exit_code']}" if row.get("exit_code") is not None
                                                    else "")
    user = Identity(row.get("user", "unknown"), bool(row.get("user_verified"))).label
    return [row["job_id"], row.get("name") or "-", row["state"], user, gpus_text(row),
            "-" if waited is None else format_duration(waited), "-" if ran is None else format_duration(ran),
            *usage_cells(row)[:2], info]


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
              format_duration(seconds(waiter["since"], status.get("time")) or 0.0)]
             for place, waiter in enumerate(status.get("queue", []), 1)]
    parts.append(table(["#", "job", "user", "wants", "waiting"], queue, "waiting") if queue
                 else "<p>nobody waiting</p>")
    return "".join(parts)


def job_text(row: Mapping[str, Any], read_at: datetime) -> str:
    """A job in one line: its state, where it runs or what it waits for, and when that was read."""
    state = row["state"]
    if state == JobState.PENDING.value and row.get("holders"):
        state += f" ({held_by(row['holders'])})"
    elif state == JobState.RUNNING.value and row.get("gpu_uuids"):
        state += f" on {gpus_text(row)}"
    elif row.get("error"):
        state += f": {row['error']}"
    return f"{state}, read at {read_at.strftime('%H:%M:%S')}"
