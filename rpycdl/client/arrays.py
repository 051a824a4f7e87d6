"""Job arrays as a client holds them: `conn.root.submit_array(fn, args_list, ...)` submits one element per argument
in one request and returns an `ArrayJob`: its elements' `Job`s (iterable, indexable), its counts by state
(`status`), `wait`, `results` in order, `cancel`, `download` (a folder per element), and a notebook display with
its counts and a progress bar."""

from __future__ import annotations

import html
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rpycdl.client import credentials, displays
from rpycdl.client.jobs import Job
from rpycdl.defaults import CANCEL_WAIT, JOB_WAIT_MAX, UPLOAD_WAIT
from rpycdl.errors import InvalidRequestError, JobNotFinishedError, RpycdlError
from rpycdl.security import results
from rpycdl.states import JobState
from rpycdl.wire import codec

if TYPE_CHECKING:
    from rpycdl.client.connection import Connection

ERRORS = ("raise", "return")
"""What results() does with an element that failed: raise its exception, or give the exception in its place."""


@dataclass(frozen=True)
class ArrayStatus:
    """How many of an array's elements are in each state (`counts`: every JobState's value, 0 for none), of
    `size`; `finished` once none is PENDING or RUNNING."""

    counts: dict[str, int]
    size: int

    @property
    def finished(self) -> bool:
        return not self.counts.get("PENDING", 0) and not self.counts.get("RUNNING", 0)

    @property
    def done(self) -> int:
        """How many have ended, however."""
        return self.size - self.counts.get("PENDING", 0) - self.counts.get("RUNNING", 0)

    def __str__(self) -> str:
        shown = [f"{count} {state}" for state, count in self.counts.items() if count and state in JobState.__members__]
        return f"{self.done}/{self.size} ended: {', '.join(shown) or 'none'}"


class ArrayJob:
    """An array of detached jobs on one host (conn.root.submit_array, rpycdl.job(name)).

    Attributes:
        id: the array's id, unique everywhere (its elements have their own ids).
        name: its name, or None; element i is named `name[i]`.
        size: how many elements.
        max_running: how many may run at once (None: no limit).
        info: the array as last seen: its row, `counts` by state, `job_ids` in index order.
    """

    def __init__(self, info: dict[str, Any], connection: Connection) -> None:
        self._connection = connection
        self._seen(info)
        self.id: str = info["array_id"]
        self.name: str | None = info.get("name")
        self.size: int = info["size"]
        self.max_running: int | None = info.get("max_running")
        self._rows: dict[int, dict[str, Any]] = {}

    def _seen(self, info: dict[str, Any]) -> dict[str, Any]:
        self.info, self.read_at = info, datetime.now().astimezone()
        return info

    def _call(self, name: str, *args: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if self._connection.closed_by_user:
            self._connection = self._connection.reopen()
        return codec.decode_outcome(self._connection.call(name, *args))

    def refresh(self) -> dict[str, Any]:
        """The array now (its `info`)."""
        return self._seen(self._call("array", self.id))

    def status(self) -> ArrayStatus:
        """How many of its elements are in each state now."""
        return ArrayStatus(self.refresh()["counts"], self.size)

    def wait(self, timeout: float | None = None) -> ArrayStatus:
        """Wait until every element has ended (or `timeout` seconds passed); returns the counts then."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = JOB_WAIT_MAX if deadline is None else deadline - time.monotonic()
            info = self._seen(self._call("array_wait", self.id, min(left, JOB_WAIT_MAX)) if left > 0
                              else self._call("array", self.id))  # timeout=0: the counts now
            status = ArrayStatus(info["counts"], self.size)
            if status.finished or (deadline is not None and time.monotonic() >= deadline):
                return status

    def results(self, timeout: float | None = None, errors: str = "raise", verify: bool = True) -> list[Any]:
        """The elements' values in index order, once every one has ended (waiting `timeout` seconds at most). An
        element that failed (or was cancelled, timed out, was lost) raises its exception with `errors="raise"`,
        or stands as the exception object with `errors="return"`. Each result is unpickled only once its seal is
        checked, as Job.result does (`verify`).

        Raises:
            JobNotFinishedError: some elements had not ended in time.
            InvalidRequestError: errors= is neither "raise" nor "return".
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        if errors not in ERRORS:
            raise InvalidRequestError(f"errors= takes {', '.join(map(repr, ERRORS))}, not {errors!r}")
        if not self.wait(timeout).finished:
            raise JobNotFinishedError(f"array {self.id} has unfinished elements after {timeout:g} s")
        key = self._key() if verify else None
        values: list[Any] = []
        while len(values) < self.size:
            chunk = self._call("array_results", self.id, len(values))
            if not chunk:
                raise JobNotFinishedError(f"array {self.id}'s element {len(values)} has not ended")
            for job_id, kind, data in chunk:
                try:
                    if kind != "result":
                        values.append(codec.decode_outcome(data))
                    else:
                        outcome = results.open_sealed(key, job_id, data) if key else results.unverified(data)
                        values.append(codec.decode_outcome(outcome))
                except Exception as exc:
                    if errors == "raise":
                        raise
                    values.append(exc)
        return values

    def _key(self) -> bytes:
        """The key this client gave the array's elements (results.job_key of its secret and the array's nonce)."""
        nonce, sealed_for = self.info.get("result_nonce"), self.info.get("result_key_id")
        secret, path = credentials.result_secret()
        if nonce is None or sealed_for is None or results.key_id(secret) != sealed_for:
            from rpycdl.errors import UnverifiableResultError

            raise UnverifiableResultError(f"array {self.id}'s results were not sealed with this client's result key "
                                          f"({path}): read them where the array was submitted, or results(verify="
                                          "False) for results you trust")
        return results.job_key(secret, nonce)

    def cancel(self, timeout: float | None = CANCEL_WAIT) -> ArrayStatus:
        """Cancel every unfinished element, and wait up to `timeout` seconds for their ends; the counts then."""
        self._call("array_cancel", self.id)
        return self.wait(timeout) if timeout != 0 else self.status()

    def _elements(self, start: int, count: int) -> list[dict[str, Any]]:
        return self._call("array_elements", self.id, start, count)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Job:
        if not -self.size <= index < self.size:
            raise IndexError(f"array {self.id} has {self.size} elements")
        index %= self.size
        return Job(self._elements(index, 1)[0], self._connection)

    def __iter__(self) -> Iterator[Job]:
        for start in range(0, self.size, 1000):
            for row in self._elements(start, 1000):
                yield Job(row, self._connection)

    def download(self, dest: str | os.PathLike[str] = ".", pattern: str | None = None,
                 timeout: float | None = UPLOAD_WAIT, quiet: bool | None = None) -> list[Path]:
        """Download every element's uploaded artifacts into `dest`/INDEX/ (elements that left none are skipped);
        returns the files written."""
        written: list[Path] = []
        for job in self:
            if job.wait_artifacts(timeout)["files"]:
                written += job.download(Path(dest) / str(job.info["array_index"]), pattern, timeout=timeout,
                                        quiet=quiet)
        return written

    def __repr__(self) -> str:
        named = f" {self.name!r}" if self.name else ""
        return f"<rpycdl.ArrayJob {self.id}{named} {ArrayStatus(self.info['counts'], self.size)}>"

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        """What Jupyter shows: its counts by state and a progress bar of those that ended, read now."""
        status = ArrayStatus(self.info["counts"], self.size)
        if not status.finished:
            try:
                status = self.status()
            except (RpycdlError, OSError, EOFError):
                pass
        reasons = [] if status.finished else self.info.get("reasons") or []
        return {"text/plain": repr(self), "text/html": array_html(self.id, self.name, status, self.read_at, reasons)}


def _check_max_running(max_running: Any) -> None:
    if max_running is not None and (isinstance(max_running, bool) or not isinstance(max_running, int)
                                    or max_running < 1):
        raise InvalidRequestError(f"max_running= is a whole number, 1 or more, or None, not {max_running!r}")


def array_html(array_id: str, name: str | None, status: ArrayStatus, read_at: datetime,
               reasons: Iterable[str] = ()) -> str:
    """An array's counts as a table, a progress bar of its ended elements, and why its owner's limits hold back
    its waiting ones (`reasons`, the server's: each once)."""
    cells = [(state, count) for state, count in status.counts.items() if state in JobState.__members__]
    caption = f"array {array_id}{' ' + repr(name) if name else ''}, read at {read_at.strftime('%H:%M:%S')}"
    bar = (f'<progress value="{status.done}" max="{status.size}" style="width: 20em"></progress> '
           f"{status.done}/{status.size} ended")
    held = "".join(f"<p>held back: {html.escape(reason)}</p>" for reason in reasons)
    return displays.table([state for state, _ in cells], [[count for _, count in cells]], caption) + bar + held


class ArrayCalls:
    """`conn.root`'s calls about arrays, mixed into RemoteRoot (with rpycdl.client.detached's DetachedCalls, whose
    `exists=` and retries it shares)."""

    _connection: Connection
    _check_size: Callable[[int], None]
    _working_dir: Callable[[str | os.PathLike[str] | None], str | None]
    _named: Callable[..., Any]
    _retries_sent: Callable[[Any, Any], tuple[Any, Any]]
    _priority_sent: Callable[[Any], Any]

    def submit_array(self, fn: Callable[..., Any], args_list: list[Any], ngpus: int | None = None, *,
                     gpus: float | None = None, gpu_memory: str | int | None = None, name: str | None = None,
                     timeout: float | None = None, queue_timeout: float | None = None,
                     memory: str | int | None = None, cpus: float | None = None,
                     max_running: int | None = None, working_dir: str | os.PathLike[str] | None = None,
                     after: str | None = None, retries: int = 0, retry_on_failure: bool = False,
                     exists: str = "error", priority: int = 0) -> ArrayJob:
        """Submit `fn(args)` for every item of `args_list` as an array of detached jobs, in one request: each
        element a job of its own (its id, its place in line, its name `name[i]`), its index in
        $RPYCDL_ARRAY_INDEX (rpycdl.array_index()). `max_running` bounds how many run at once. Options as submit's:

        Args:
            working_dir: sent and stored once for the array; each element runs in a copy of its own.
            after: the whole array waits for these jobs (or arrays, or an element `NAME[INDEX]`), as submit's; with
                `NAME[*]` (`"ok:sweep[*]"`), element i waits for element i of that array, which must be as big. An
                element whose dependency can never be met ends FAILED with DependencyError, never having run.
            retries, retry_on_failure: each element is requeued on its own, as a job of submit's
                (rpycdl.attempt() in it says its attempt).
            priority: every element's, as submit's.
            exists: with `name`, what to do if you have an array of that name already: "error" (the default: a
                second unfinished one is refused), "return" (that array, unfinished or not: nothing is submitted),
                "replace" (cancel it, wait for its end, then submit).

        Raises:
            InvalidRequestError: an empty `args_list`, more than MAX_ARRAY elements, a bad max_running, a name you
                use already, an `after=` element by element of an array of another size, or what submit refuses;
                nothing is submitted.
            DependencyError: a job of `after` has ended already so that no element can ever run.
            LimitError: over the server's queue limits or --max-payload; nothing is submitted.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        items = list(args_list) if not isinstance(args_list, (str, bytes)) else None
        if not items:
            raise InvalidRequestError(f"args_list must be a non-empty list of arguments, not {args_list!r:.60}")
        _check_max_running(max_running)

        def submit() -> ArrayJob:
            payload = codec.encode_payload(fn, None)
            parts = tuple(codec.dumps(item)[0] for item in items)
            self._check_size(len(payload) + sum(map(len, parts)))
            return self._array_submitted("submit_array", payload, parts, ngpus, gpus, gpu_memory, timeout,
                                         queue_timeout, name, memory, cpus, max_running, self._working_dir(working_dir),
                                         after, *self._retries_sent(retries, retry_on_failure),
                                         self._priority_sent(priority))

        return self._named(name, exists, submit, self.array)

    def submit_command_array(self, commands: list[list[str]], ngpus: int | None = None, *,
                             gpus: float | None = None, gpu_memory: str | int | None = None, name: str | None = None,
                             timeout: float | None = None, queue_timeout: float | None = None,
                             memory: str | int | None = None, cpus: float | None = None,
                             max_running: int | None = None, working_dir: str | os.PathLike[str] | None = None,
                             after: str | None = None, retries: int = 0, retry_on_failure: bool = False,
                             exists: str = "error", priority: int = 0) -> ArrayJob:
        """Submit a command per element (each an argv), as submit_array does, with its options; each element's
        result is its exit code (it fails unless that is 0)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        _check_max_running(max_running)
        argvs = tuple(tuple(str(part) for part in command) for command in commands)
        return self._named(name, exists, lambda: self._array_submitted(
            "submit_command_array", argvs, ngpus, gpus, gpu_memory, timeout, queue_timeout, name, memory, cpus,
            max_running, self._working_dir(working_dir), after, *self._retries_sent(retries, retry_on_failure),
            self._priority_sent(priority)),
            self.array)

    def _array_submitted(self, call: str, *args: Any) -> ArrayJob:
        """Call a submit of an array with a fresh seal of its elements' results after its name, then its options
        up to the last given (a server from before working_dir, after and retries on arrays takes them only)."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        secret, _ = credentials.result_secret()
        *before, memory, cpus, max_running, working_dir, after, retries, on_failure, priority = args
        options = [memory, cpus, max_running, working_dir, after, retries, on_failure, priority]
        while len(options) > 3 and options[-1] is None:
            options.pop()
        seal = results.new_seal(secret).sent()
        return ArrayJob(codec.decode_outcome(self._connection.call(call, *before, seal, *options)), self._connection)

    def array(self, ref: str) -> ArrayJob:
        """The handle of an array of this server's host, by id, or by name among your arrays."""
        __tracebackhide__ = True  # noqa: F841 - IPython and pytest leave this frame out of what they show
        return ArrayJob(codec.decode_outcome(self._connection.call("array", ref)), self._connection)
