"""Job arrays in the ledger: an array is one row of `arrays` (its owner, name, size and `max_running`) and one row of
`jobs` per element, an ordinary job with `array_id` and `array_index`, all written in one transaction (save). What
the server does with them (their place in line, their limit, their payload) is rpycdl.server.arrays's; this module
only reads and writes their rows, through the ledger's own connection and transactions.

An element's name is its array's with its index, `sweep[3]`, so that a name finds one element as it finds a job.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.jobrecord import JobRecord, from_row, to_row
from rpycdl.scheduler.ledger import _SELECT, Ledger
from rpycdl.scheduler.schema import LIVE
from rpycdl.states import JobState

_COLUMNS = tuple(to_row(JobRecord("x", "x", "x", 1)))
_INSERT = f"INSERT INTO jobs ({', '.join(_COLUMNS)}) VALUES ({', '.join(':' + c for c in _COLUMNS)})"
_ARRAY_COLUMNS = ("array_id", "user", "user_verified", "name", "size", "max_running", "submitted", "server_id", "kind")
BATCH = 500
"""Rows a statement names at most by id (SQLite bounds a statement's parameters)."""

HELD = "json_extract(request, '$.after') IS NOT NULL AND json_extract(request, '$.after_met') IS NULL"
"""An element's row whose dependencies (its array's `after=`: rpycdl.server.held) have not been met yet; once they
have, its request's `after_met` says so (mark_met), for good: its place in line is then its array's to give."""

ELEMENT = re.compile(r"^(?P<array>[A-Za-z0-9._-]+)\[(?P<index>\d{1,6})\]$")
"""A reference to one element: its array's id or name, then its index in brackets (`sweep[3]`)."""


@dataclass(frozen=True)
class Array:
    """An array's row: who submitted it, its name, how many elements, how many may run at once (None: no limit)."""

    array_id: str
    user: str
    user_verified: bool
    name: str | None
    size: int
    max_running: int | None
    submitted: float
    server_id: str
    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {column: getattr(self, column) for column in _ARRAY_COLUMNS}


def element_name(name: str | None, index: int) -> str | None:
    """The name of an array's element: the array's with its index (`sweep[3]`), or None for an unnamed array."""
    return None if name is None else f"{name}[{index}]"


def save(ledger: Ledger, array: Array, template: JobRecord, job_ids: Sequence[str]) -> None:
    """Write an array and its elements' rows in one transaction: element i is `template` with the id job_ids[i],
    its index i and its name (element_name).

    Raises:
        InvalidRequestError: the user has an unfinished job or array of the array's name (raised by the caller's
            check; a race with another submit of the name fails here on the unique index, as InvalidRequestError).
    """
    with ledger._write() as db:
        try:
            db.execute(f"INSERT INTO arrays VALUES ({', '.join('?' * len(_ARRAY_COLUMNS))})",
                       [int(value) if isinstance(value, bool) else value for value in
                        (getattr(array, column) for column in _ARRAY_COLUMNS)])
            row = {**to_row(template), "array_id": array.array_id}
            db.executemany(_INSERT, ({**row, "job_id": job_id, "array_index": index,
                                      "name": element_name(array.name, index)} for index, job_id in enumerate(job_ids)))
        except sqlite3.IntegrityError as exc:
            raise InvalidRequestError(f"array {array.name or array.array_id} could not be recorded: a job of one of "
                                      f"its names is unfinished already ({exc})") from None


def get(ledger: Ledger, array_id: str) -> Array | None:
    with ledger._db() as db:
        row = db.execute(f"SELECT {', '.join(_ARRAY_COLUMNS)} FROM arrays WHERE array_id = ?", (array_id,)).fetchone()
    return None if row is None else _array(row)


def find(ledger: Ledger, ref: str, user: str, verified: bool | None = None) -> Array | None:
    """The array whose id is `ref`, else `user`'s array of that name with an unfinished element, else their latest
    of that name (as Ledger.find finds a job)."""
    alike = "" if verified is None else f" AND user_verified = {int(verified)}"
    live = f"EXISTS (SELECT 1 FROM jobs WHERE jobs.array_id = arrays.array_id AND jobs.{LIVE})"
    with ledger._db() as db:
        row = db.execute(f"SELECT {', '.join(_ARRAY_COLUMNS)} FROM arrays WHERE array_id = ?", (ref,)).fetchone() \
            or db.execute(f"SELECT {', '.join(_ARRAY_COLUMNS)} FROM arrays WHERE user = ? AND name = ?{alike} "
                          f"ORDER BY {live} DESC, submitted DESC LIMIT 1", (user, ref)).fetchone()
    return None if row is None else _array(row)


def unfinished_named(ledger: Ledger, name: str, user: str) -> Array | None:
    """`user`'s array named `name` that has an unfinished element, or None."""
    found = find(ledger, name, user)
    return found if found is not None and found.name == name and counts(ledger, found.array_id).get(
        "unfinished") else None


def find_element(ledger: Ledger, ref: str, user: str, verified: bool | None = None) -> JobRecord | None:
    """The element `ref` names, `ARRAY[INDEX]` (ARRAY an array's id, or one of `user`'s array names), or None."""
    match = ELEMENT.match(ref)
    array = None if match is None else find(ledger, match["array"], user, verified)
    return None if array is None or match is None else element(ledger, array.array_id, int(match["index"]))


def element(ledger: Ledger, array_id: str, index: int) -> JobRecord | None:
    with ledger._db() as db:
        row = db.execute(f"{_SELECT} WHERE array_id = ? AND array_index = ?", (array_id, index)).fetchone()
    return None if row is None else from_row(row)


def elements(ledger: Ledger, array_id: str, start: int = 0, count: int = -1) -> list[JobRecord]:
    """The array's elements' rows from index `start`, `count` at most (-1: all), in index order."""
    with ledger._db() as db:
        return [from_row(row) for row in db.execute(
            f"{_SELECT} WHERE array_id = ? AND array_index >= ? ORDER BY array_index LIMIT ?",
            (array_id, start, count))]


def counts(ledger: Ledger, array_id: str) -> dict[str, int]:
    """How many of the array's elements are in each state (every state, 0 for none), and `unfinished`."""
    with ledger._db() as db:
        found = dict(db.execute("SELECT state, count(*) FROM jobs WHERE array_id = ? GROUP BY state", (array_id,)))
    by_state = {state.value: found.get(state.value, 0) for state in JobState}
    return {**by_state, "unfinished": by_state["PENDING"] + by_state["RUNNING"]}


def unfinished(ledger: Ledger, array_id: str) -> bool:
    """Whether an element of the array is unfinished: read from its last element back, which waits while any does
    (elements start in index order), so that an element's end reads one row, not every ended one."""
    with ledger._db() as db:
        return db.execute(f"SELECT 1 FROM jobs WHERE array_id = ? AND {LIVE} ORDER BY array_index DESC LIMIT 1",
                          (array_id,)).fetchone() is not None


def live(ledger: Ledger, array_id: str) -> list[tuple[str, int, int, str, bool]]:
    """The array's unfinished elements, in index order: (job id, index, owner pid, state, cancel asked)."""
    with ledger._db() as db:
        return [(job_id, index, owner, state, bool(cancel)) for job_id, index, owner, state, cancel in db.execute(
            f"SELECT job_id, array_index, owner_pid, state, cancel_requested FROM jobs WHERE array_id = ? AND {LIVE} "
            "ORDER BY array_index", (array_id,))]


def job_ids(ledger: Ledger, array_id: str) -> list[str]:
    """The ids of the array's elements, in index order."""
    with ledger._db() as db:
        return [row[0] for row in db.execute("SELECT job_id FROM jobs WHERE array_id = ? ORDER BY array_index",
                                             (array_id,))]


def unqueued(ledger: Ledger, array_id: str, after: int, count: int, queued: Container[str]) -> list[tuple[str, int]]:
    """The array's first `count` elements after index `after` that wait with no owner, no cancel asked and no place
    in line (not in `queued`), in index order: (job id, index); not those held by their dependencies (HELD), nor a
    requeued one (its place is rpycdl.server.retries's to give). It reads as few rows as it needs, BATCH at a time."""
    found: list[tuple[str, int]] = []
    while len(found) < count:
        with ledger._db() as db:
            rows = db.execute("SELECT job_id, array_index FROM jobs WHERE array_id = ? AND array_index > ? AND "
                              "state = 'PENDING' AND owner_pid = 0 AND cancel_requested = 0 AND attempt = 1 AND "
                              f"NOT ({HELD}) ORDER BY array_index LIMIT ?", (array_id, after, BATCH)).fetchall()
        found += [(job_id, index) for job_id, index in rows if job_id not in queued][:count - len(found)]
        if len(rows) < BATCH:
            break
        after = rows[-1][1]
    return found


def cancelled_waiting(ledger: Ledger, array_id: str) -> list[str]:
    """The array's elements that wait with no owner and whose cancel was asked."""
    with ledger._db() as db:
        return [row[0] for row in db.execute("SELECT job_id FROM jobs WHERE array_id = ? AND state = 'PENDING' AND "
                                             "owner_pid = 0 AND cancel_requested = 1", (array_id,))]


def active(ledger: Ledger, array_id: str, queued: Container[str]) -> int:
    """How many of the array's elements are owned (a supervisor's), running, or unowned with a place in line
    (in `queued`): those its max_running counts."""
    with ledger._db() as db:
        started = db.execute(f"SELECT count(*) FROM jobs WHERE array_id = ? AND {LIVE} AND "
                             "(owner_pid != 0 OR state = 'RUNNING')", (array_id,)).fetchone()[0]
        waiting = db.execute("SELECT job_id FROM jobs WHERE array_id = ? AND state = 'PENDING' AND owner_pid = 0",
                             (array_id,)).fetchall()
    return started + sum(1 for (job_id,) in waiting if job_id in queued)


def has_room(ledger: Ledger, array_id: str, queued: Container[str]) -> bool:
    """Whether one more of the array's elements may take its place in line under its max_running (`queued`, the rows
    in line now, read under the queue lock)."""
    array = get(ledger, array_id)
    return array is None or array.max_running is None or active(ledger, array_id, queued) < array.max_running


def held(ledger: Ledger) -> list[tuple[str, str]]:
    """The arrays that have elements held by their dependencies (HELD), with the `after` their elements keep."""
    with ledger._db() as db:
        return list(db.execute(f"SELECT DISTINCT array_id, json_extract(request, '$.after') FROM jobs WHERE array_id "
                               f"IS NOT NULL AND state = 'PENDING' AND owner_pid = 0 AND attempt = 1 AND "
                               f"cancel_requested = 0 AND {HELD}"))


def held_elements(ledger: Ledger, array_id: str, peer: str | None) -> list[tuple[str, int, str | None]]:
    """The array's elements held by their dependencies, in index order: (job id, index, the job id of its peer in
    the array `peer`, None if that has no such element); with a `peer`, only those whose peer has ended, or is
    no longer on record."""
    with ledger._db() as db:
        return list(db.execute(
            "SELECT e.job_id, e.array_index, p.job_id FROM jobs e LEFT JOIN jobs p ON p.array_id = ? AND "
            "p.array_index = e.array_index WHERE e.array_id = ? AND e.state = 'PENDING' AND e.owner_pid = 0 AND "
            f"e.attempt = 1 AND e.cancel_requested = 0 AND {HELD.replace('request', 'e.request')} AND (p.state IS NULL "
            "OR p.state NOT IN ('PENDING', 'RUNNING')) ORDER BY e.array_index", (peer, array_id)))


def mark_met(ledger: Ledger, job_ids: Sequence[str]) -> None:
    """Say in the rows of the elements `job_ids`, still waiting with no owner, that their dependencies are met."""
    for start in range(0, len(job_ids), BATCH):
        chunk = list(job_ids[start:start + BATCH])
        with ledger._write() as db:
            db.execute("UPDATE jobs SET request = json_set(request, '$.after_met', 1) WHERE job_id IN "
                       f"({', '.join('?' * len(chunk))}) AND state = 'PENDING' AND owner_pid = 0", chunk)


def deciding(ledger: Ledger, array_id: str) -> list[JobRecord]:
    """The elements whose rows decide a dependency on the array (dependencies.judge): its first unfinished one, its
    first that ended other than SUCCEEDED, and its last, each once, in index order; none for an array no longer on
    record."""
    found: dict[int, JobRecord] = {}
    with ledger._db() as db:
        for where, order in ((LIVE, "array_index"), ("state NOT IN ('PENDING', 'RUNNING', 'SUCCEEDED')", "array_index"),
                             ("1", "array_index DESC")):
            row = db.execute(f"{_SELECT} WHERE array_id = ? AND {where} ORDER BY {order} LIMIT 1",
                             (array_id,)).fetchone()
            if row is not None:
                record = from_row(row)
                found[record.array_index or 0] = record
    return [found[index] for index in sorted(found)]


def waiting_arrays(ledger: Ledger) -> list[str]:
    """The arrays that have elements waiting with no owner: those whose elements may need a place in line."""
    with ledger._db() as db:
        return [row[0] for row in db.execute(
            "SELECT DISTINCT array_id FROM jobs WHERE array_id IS NOT NULL AND state = 'PENDING' AND owner_pid = 0")]


def cancel_all(ledger: Ledger, array_id: str) -> int:
    """Ask the cancel of every unfinished element of the array; returns how many."""
    with ledger._write() as db:
        return db.execute(f"UPDATE jobs SET cancel_requested = 1 WHERE array_id = ? AND {LIVE}",
                          (array_id,)).rowcount


def end_unowned(ledger: Ledger, job_ids: Sequence[str], state: JobState, error: str, error_type: str) -> list[str]:
    """End the elements of `job_ids` that wait with no owner (never started), in a few transactions; their ids."""
    ended: list[str] = []
    for start in range(0, len(job_ids), BATCH):
        chunk = list(job_ids[start:start + BATCH])
        with ledger._write() as db:
            ended += [row[0] for row in db.execute(
                f"UPDATE jobs SET state = ?, error = ?, error_type = ?, ended = ? WHERE job_id IN "
                f"({', '.join('?' * len(chunk))}) AND state = 'PENDING' AND owner_pid = 0 RETURNING job_id",
                (state.value, error, error_type, time.time(), *chunk))]
    return ended


def _array(row: Sequence[Any]) -> Array:
    data = dict(zip(_ARRAY_COLUMNS, row, strict=True))
    return Array(**{**data, "user_verified": bool(data["user_verified"])})
