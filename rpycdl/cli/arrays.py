"""`rpycdl submit --array 0-99%8 -- COMMAND {index}` (an array of detached commands, as Slurm's sbatch --array),
and what the job verbs do with an array: `rpycdl jobs` shows one row per array (its counts by state; --expand: its
elements), `wait`, `result`, `cancel`, `logs` and `download` take an array (or one element, `NAME[INDEX]`)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import dill

from rpycdl.cli.common import EXIT_FAILED, EXIT_QUEUE_TIMEOUT
from rpycdl.client.arrays import ArrayJob, ArrayStatus
from rpycdl.client.connection import Connection
from rpycdl.defaults import MAX_ARRAY
from rpycdl.errors import InvalidRequestError, JobNotFinishedError
from rpycdl.states import JobState

INDEX = "{index}"
"""What each element's command has in place of its index."""

_SPEC = re.compile(r"^(?P<ranges>\d+(-\d+)?(,\d+(-\d+)?)*)(%(?P<max>\d+))?$")


def add_flags(submit: argparse.ArgumentParser) -> None:
    submit.add_argument("--array", default=None, metavar="INDICES[%N]",
                        help="submit an array: one job per index (0-99, or 1,3,5-9), {index} in COMMAND replaced by "
                             "it (and $RPYCDL_ARRAY_INDEX its position, from 0); %%N runs N at most at once")


def parse(spec: str) -> tuple[list[int], int | None]:
    """The indices and the max_running of an --array spec: `0-99%8`, `1,3,5-9`, `0-9`.

    Raises:
        InvalidRequestError: anything else, an empty range, repeated indices or more than MAX_ARRAY of them.
    """
    match = _SPEC.match(spec.strip())
    if match is None:
        raise InvalidRequestError(f"--array takes INDICES[%N] (0-99%8, 1,3,5-9), not {spec!r}")
    indices: list[int] = []
    for part in match["ranges"].split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low or len(indices) + high - low + 1 > MAX_ARRAY:
            raise InvalidRequestError(f"--array {spec!r}: {part} is an empty range, or makes more than {MAX_ARRAY}")
        indices += range(low, high + 1)
    if len(set(indices)) != len(indices):
        raise InvalidRequestError(f"--array {spec!r} names an index twice")
    most = None if match["max"] is None else int(match["max"])
    if most is not None and most < 1:
        raise InvalidRequestError(f"--array {spec!r}: %N runs N elements at once, 1 or more")
    return indices, most


def submit(args: argparse.Namespace, conn: Connection, options: dict[str, Any]) -> int:
    """`rpycdl submit --array`: one command per index, submitted in one request with submit's `options` (its
    keywords, as the command line gave them)."""
    if args.image:
        raise InvalidRequestError("--array goes without --image (not yet)")
    indices, most = parse(args.array)
    commands = [[part.replace(INDEX, str(index)) for part in args.argv] for index in indices]
    array = conn.root.submit_command_array(commands, args.ngpus, max_running=most, **options)
    at_most = f", {most} at most at once" if most else ""
    print(array.id if args.quiet else f"array {array.id}{f' ({array.name})' if array.name else ''} of {array.size} "
          f"jobs submitted on {conn.address[0]}:{conn.address[1]}{at_most}: {array.status()}")
    return 0


def grouped(rows: list[dict[str, Any]], expand: bool) -> list[dict[str, Any]]:
    """The rows of `rpycdl jobs`: an array's elements as one row (its id, name, the state of most concern, its
    counts by state in INFO), unless `expand`."""
    if expand:
        return rows
    shown: list[dict[str, Any]] = []
    arrays: dict[str, dict[str, Any]] = {}
    for row in rows:
        array_id = row.get("array_id")
        if array_id is None:
            shown.append(row)
            continue
        if array_id not in arrays:
            name = row.get("name")
            arrays[array_id] = {**row, "job_id": array_id, "name": name.rsplit("[", 1)[0] if name else None,
                                "counts": {}, "error": "", "exit_code": None, "ahead": None, "holders": None,
                                "started": None, "ended": None}
            shown.append(arrays[array_id])
        counts = arrays[array_id]["counts"]
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    for row in arrays.values():
        counts = row["counts"]
        row["state"] = next(state.value for state in (JobState.RUNNING, JobState.PENDING, *JobState)
                            if counts.get(state.value))
        row["error"] = "array: " + ", ".join(f"{count} {state}" for state, count in counts.items())
    return shown


def wait(found: ArrayJob, timeout: float | None) -> int:
    status = found.wait(timeout)
    print(f"array {found.id}: {status}", file=sys.stderr)
    return exit_code(status)


def exit_code(status: ArrayStatus) -> int:
    """0 if every element succeeded, EXIT_QUEUE_TIMEOUT if some have not ended, else EXIT_FAILED."""
    if not status.finished:
        return EXIT_QUEUE_TIMEOUT
    return 0 if status.counts.get("SUCCEEDED", 0) == status.size else EXIT_FAILED


def result(found: ArrayJob, no_wait: bool, verify: bool, output: str | None) -> int:
    """`rpycdl result ARRAY`: each element's value in index order, one a line (str as it is, anything else its
    repr), a failed element's line empty and the element named on stderr (or with `output`, the list of values saved
    with dill, a failed element's exception in its place); exits as `rpycdl wait ARRAY` does."""
    try:
        values = found.results(timeout=0 if no_wait else None, errors="return", verify=verify)
    except JobNotFinishedError:
        print(f"rpycdl result: array {found.id} has not ended ({ArrayStatus(found.info['counts'], found.size)}): "
              f"wait for it with rpycdl wait {found.id}", file=sys.stderr)
        return EXIT_QUEUE_TIMEOUT
    status = ArrayStatus(found.info["counts"], found.size)
    failed = {} if status.counts.get("SUCCEEDED", 0) == found.size else {
        element.info["array_index"]: element for element in found if element.info["state"] != "SUCCEEDED"}
    if output:
        Path(output).write_bytes(dill.dumps(values))
        print(f"rpycdl result: array {found.id}'s {found.size} values (a list) saved to {output}", file=sys.stderr)
    else:
        for index, value in enumerate(values):
            failure = index in failed and isinstance(value, BaseException)
            print("" if failure else value if isinstance(value, str) else repr(value))
    for index, element in sorted(failed.items()):
        value = values[index]
        why = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else f"its value {value!r}"
        print(f"rpycdl result: element {index} ({element.name or element.id}, job {element.id}) "
              f"{element.info['state']}: {why}", file=sys.stderr)
    return exit_code(status)


def cancel(found: ArrayJob) -> int:
    status = found.cancel()
    print(f"array {found.id}: " + (str(status) if status.finished else f"cancel requested; {status}"))
    return 0


def logs(found: ArrayJob, tail: int | None) -> int:
    """Each element's log in turn, each under a line naming it."""
    for element in found:
        print(f"==> {element.name or element.id} (element {element.info['array_index']}) <==", flush=True)
        for line in element.logs(tail=tail):
            sys.stdout.write(line)
    return 0


def download(found: ArrayJob, dest: str, pattern: str | None, timeout: float | None) -> int:
    written = found.download(dest, pattern, timeout=timeout)
    print(f"array {found.id}: {len(written)} file(s) in {Path(dest)}/INDEX/")
    return 0
