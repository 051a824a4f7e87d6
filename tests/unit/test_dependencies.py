"""after= syntax and its judgement (rpycdl.scheduler.dependencies): which dependencies are met, which can never be,
and what a job that never runs is told."""

from __future__ import annotations

import pytest

from rpycdl.errors import InvalidRequestError
from rpycdl.scheduler.dependencies import MAX_REFS, After, Verdict, judge, parse, reason
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.states import JobState


def row(job_id: str, state: JobState, error: str = "", error_type: str = "") -> JobRecord:
    return JobRecord(job_id, "server", "client", 1, state=state, error=error, error_type=error_type)


@pytest.mark.parametrize(("text", "kind", "refs"), [
    ("ok:3f2a9c1d0e7b", "ok", ("3f2a9c1d0e7b",)),
    ("notok:a,b", "notok", ("a", "b")),
    ("any: lr-1e-3 , b.2,lr-1e-3", "any", ("lr-1e-3", "b.2")),  # spaces around, each once
])
def test_parse_reads_the_kind_and_the_jobs(text, kind, refs):
    assert parse(text) == After(kind, refs)
    assert str(After(kind, refs)) == f"{kind}:{','.join(refs)}"


@pytest.mark.parametrize("text", ["ok:", "ok", "", ":a", "sometimes:x", "afterok:x", "OK:x", "ok:a,,b", "ok:a b",
                                  "ok:a;rm", "ok:é", None, 3, ["ok:a"]])
def test_parse_refuses_anything_else_saying_what_it_takes(text):
    with pytest.raises(InvalidRequestError, match=r"after= takes KIND:JOB\[,JOB...\], KIND one of ok, notok, any"):
        parse(text)


def test_parse_refuses_too_many_jobs():
    with pytest.raises(InvalidRequestError, match=f"{MAX_REFS} at most"):
        parse("ok:" + ",".join(f"j{index}" for index in range(MAX_REFS + 1)))


ENDS = {state: row("a", state) for state in JobState}


@pytest.mark.parametrize(("kind", "state", "expected"), [
    ("ok", JobState.PENDING, "waits"), ("ok", JobState.RUNNING, "waits"), ("ok", JobState.SUCCEEDED, "met"),
    ("ok", JobState.FAILED, "broken"), ("ok", JobState.CANCELLED, "broken"), ("ok", JobState.LOST, "broken"),
    ("ok", JobState.TIMED_OUT, "broken"),
    ("notok", JobState.RUNNING, "waits"), ("notok", JobState.SUCCEEDED, "broken"), ("notok", JobState.FAILED, "met"),
    ("notok", JobState.CANCELLED, "met"), ("notok", JobState.TIMED_OUT, "met"), ("notok", JobState.LOST, "met"),
    ("any", JobState.RUNNING, "waits"), ("any", JobState.SUCCEEDED, "met"), ("any", JobState.FAILED, "met"),
    ("any", JobState.CANCELLED, "met"),
])
def test_judge_one_dependency(kind, state, expected):
    verdict = judge(After(kind, ("a",)), {"a": ENDS[state]})
    assert {"waits": verdict.waits, "met": verdict.met, "broken": verdict.broken is not None} == {
        name: name == expected for name in ("waits", "met", "broken")}


def test_judge_several_waits_for_all_and_breaks_at_the_first_wrong_end():
    after = After("ok", ("a", "b"))
    assert judge(after, {"a": row("a", JobState.SUCCEEDED), "b": row("b", JobState.RUNNING)}).waits
    assert judge(after, {"a": row("a", JobState.SUCCEEDED), "b": row("b", JobState.SUCCEEDED)}).met
    broken = judge(after, {"a": row("a", JobState.RUNNING), "b": row("b", JobState.FAILED)})
    assert broken.broken is not None and broken.broken.job_id == "b"  # not waiting for a to end: b decides it


def test_a_job_no_longer_on_record_breaks_ok_and_notok_and_meets_any():
    assert judge(After("ok", ("a",)), {"a": None}) == Verdict(missing="a")
    assert judge(After("notok", ("a",)), {}) == Verdict(missing="a")
    assert judge(After("any", ("a",)), {"a": None}).met


def test_reason_names_the_dependency_and_its_end_and_the_error_only_if_shown():
    after = After("ok", ("a",))
    verdict = Verdict(broken=row("a", JobState.FAILED, "division by zero", "ZeroDivisionError"))
    told = reason("job b", after, verdict, ["a"])
    assert told == ("job b: its dependency after=ok:a cannot be met: job a FAILED (ZeroDivisionError: division by "
                    "zero), and ok: waits for jobs that ended SUCCEEDED")
    assert "division" not in reason("job b", after, verdict)  # another user's job: its error is its owner's
    assert "no longer on record" in reason("job b", after, Verdict(missing="a"))


@pytest.mark.parametrize(("states", "met"), [  # by kind: None waits, True met, a string broken by it
    (("SUCCEEDED", "RUNNING"), {"ok": None, "notok": None, "any": None}),
    (("FAILED", "RUNNING"), {"ok": "e0", "notok": None, "any": None}),
    (("SUCCEEDED", "SUCCEEDED"), {"ok": True, "notok": "e1", "any": True}),
    (("SUCCEEDED", "CANCELLED"), {"ok": "e1", "notok": True, "any": True}),
    ((), {"ok": "missing", "notok": "missing", "any": True}),  # no longer on record: as a deleted job
])
def test_an_array_is_judged_on_every_element(states, met):
    elements = [row(f"e{index}", JobState(state)) for index, state in enumerate(states)]
    for kind, expected in met.items():
        verdict = judge(After(kind, ("arr", "done")), {"arr": elements, "done": ENDS[JobState.SUCCEEDED]
                                                        if kind != "notok" else ENDS[JobState.FAILED]})
        if expected is None:
            assert verdict.waits, (kind, states, verdict)
        elif expected == "missing":
            assert verdict.missing == "arr", (kind, states, verdict)
        elif isinstance(expected, str):
            assert verdict.broken is not None and verdict.broken.job_id == expected, (kind, states, verdict)
        else:
            assert verdict.met is expected, (kind, states, verdict)
