"""A detached job's dependencies (submit's `after=`, Slurm's afterok, afternotok and afterany): their syntax, and
whether the jobs they name have ended so that the job may take its place in line, never can, or waits on. Pure
functions of the rows: the server's sweep (rpycdl.server.held) reads them and acts."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.states import JobState

KINDS = {"ok": "ended SUCCEEDED", "notok": "ended other than SUCCEEDED", "any": "ended, however"}
"""The kinds of dependency, and what each asks of every job it names."""

MAX_REFS = 64
"""The most jobs one `after=` may name."""

EACH = "[*]"
"""What ends a reference to an array that an array waits for element by element (`ok:sweep[*]`: each element for its
peer of the same index)."""

_REF = re.compile(r"^[A-Za-z0-9._-]+(\[(\d{1,6}|\*)\])?$")
"""A job id or name, an array's element (`sweep[3]`), or an array element by element (`sweep[*]`)."""


@dataclass(frozen=True)
class After:
    """What a job waits for: every job of `refs` (ids once resolved, or names as the client gave them) to have
    ended as `kind` asks (KINDS)."""

    kind: str
    refs: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind}:{','.join(self.refs)}"


@dataclass(frozen=True)
class Verdict:
    """Where a job's dependencies stand: `met` (it may take its place in line), or `broken` by the row of the job
    that ended the wrong way (None when it was deleted: `missing`, its id), or neither (it waits on)."""

    met: bool = False
    broken: JobRecord | None = None
    missing: str | None = None

    @property
    def waits(self) -> bool:
        return not self.met and self.broken is None and self.missing is None


def parse(text: object) -> After:
    """`after=` as a client gives it: "KIND:JOB[,JOB...]", KIND one of KINDS, each JOB an id or a name (of a job, an
    array, or an array's element: `sweep[3]`; `sweep[*]`: element by element, for an array's submit).

    Raises:
        InvalidRequestError: anything else, saying what it takes.
    """
    usage = (f"after= takes KIND:JOB[,JOB...], KIND one of {', '.join(KINDS)} (such as 'ok:3f2a9c1d', 'ok:sweep[3]', "
             f"or 'ok:sweep[*]' for an array element by element), not {text!r}")
    if not isinstance(text, str):
        raise InvalidRequestError(usage)
    kind, colon, listed = text.strip().partition(":")
    refs = tuple(ref.strip() for ref in listed.split(","))
    if not colon or kind not in KINDS or not all(refs) or not all(_plain(ref) for ref in refs):
        raise InvalidRequestError(usage)
    if len(refs) > MAX_REFS:
        raise InvalidRequestError(f"after= names {len(refs)} jobs: {MAX_REFS} at most")
    return After(kind, tuple(dict.fromkeys(refs)))  # each once, in the order given


def _plain(ref: str) -> bool:
    """A job id or name: letters, digits, '.', '_', '-' (what JobCalls._find takes), with an element's index or [*]."""
    return _REF.match(ref) is not None


def split(after: After) -> tuple[After, str | None]:
    """`after` as an array's element waits: the jobs every element waits for, and the array (its id) whose element
    of the same index each waits for (a reference ending in EACH; one at most), or None."""
    peers = [ref[:-len(EACH)] for ref in after.refs if ref.endswith(EACH)]
    return After(after.kind, tuple(ref for ref in after.refs if not ref.endswith(EACH))), (peers or [None])[0]


def judge(after: After, rows: Mapping[str, JobRecord | Sequence[JobRecord] | None]) -> Verdict:
    """Whether `after` is met by the jobs' rows now (`rows`: by id, None for a job no longer on record: deleted
    or pruned, so ended, however; for an array, its elements' rows, or those that decide: arrays.deciding). ok:
    broken by the first that ended other than SUCCEEDED; notok: by the first that SUCCEEDED; any: never. A job no
    longer on record breaks ok and notok (how it ended is unknown). An array waits for every element: ok, all
    SUCCEEDED (broken by the first that did not); notok, one did not (broken once all did); any, all ended."""
    ended = True
    for job_id in after.refs:
        row = rows.get(job_id)
        if isinstance(row, Sequence):
            verdict = _judge_array(after.kind, job_id, row)
            if not verdict.waits and not verdict.met:
                return verdict
            ended = ended and verdict.met
            continue
        if row is None:
            if after.kind != "any":
                return Verdict(missing=job_id)
            continue
        if not row.state.finished:
            ended = False
        elif (row.state is JobState.SUCCEEDED) != (after.kind == "ok") and after.kind != "any":
            return Verdict(broken=row)
    return Verdict(met=ended)


def _judge_array(kind: str, array_id: str, elements: Sequence[JobRecord]) -> Verdict:
    """judge for one array, its elements' rows given (none: no longer on record, as a deleted job is judged)."""
    if not elements:
        return Verdict(met=True) if kind == "any" else Verdict(missing=array_id)
    failed = next((row for row in elements if row.state.finished and row.state is not JobState.SUCCEEDED), None)
    if kind == "ok" and failed is not None:
        return Verdict(broken=failed)
    if any(not row.state.finished for row in elements):
        return Verdict()
    if kind == "notok" and failed is None:
        return Verdict(broken=elements[-1])
    return Verdict(met=True)


def reason(who: str, after: After, verdict: Verdict, shown: Sequence[str] = ()) -> str:
    """Why a job (`who`: "job ID", or "not submitted") never runs: its dependency and how the job that broke it
    ended (with its error if that job's owner is the same: `shown`, the ids whose errors may be told)."""
    head = f"{who}: its dependency after={after} cannot be met"
    if verdict.missing is not None:
        return f"{head}: job {verdict.missing} is no longer on record (deleted), so how it ended is unknown"
    row = verdict.broken
    assert row is not None
    how = row.state.value
    if row.job_id in shown and row.error:
        error = row.error if len(row.error) <= 200 else row.error[:200] + "..."
        how += f" ({row.error_type + ': ' if row.error_type else ''}{error})"
    return f"{head}: job {row.job_id} {how}, and {after.kind}: waits for jobs that {KINDS[after.kind]}"
