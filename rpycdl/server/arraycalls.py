"""The service's calls about job arrays (rpycdl.server.arrays): submitting one (a function over a list of arguments,
or a command per index) in one request, an array's view (its counts by state, its elements' ids), waiting for its
end, its elements' results in index order, cancelling it whole. Everyone sees that an array exists and its counts;
only its owner or an admin reads its results or cancels it. Answers are outcome bytes (wire.codec), as jobcalls'."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rpycdl.defaults import JOB_WAIT_MAX, MAX_ARRAY
from rpycdl.errors import InvalidRequestError, NotAllowedError
from rpycdl.scheduler import arrays as rows
from rpycdl.scheduler.arrays import Array
from rpycdl.security import auth, results, visibility
from rpycdl.server import arrays, jobcalls, request
from rpycdl.server.commands import run_command
from rpycdl.server.context import ServerContext
from rpycdl.wire import codec, netrefs

ARRAY_OPTIONS = ("ngpus", "gpus", "gpu_memory", "timeout", "queue_timeout", "name", "seal", "memory", "cpus",
                 "max_running", "working_dir", "after", "retries", "retry_on_failure", "priority")
"""The options of `submit_array` and `submit_command_array` after what they run: submit's (request.SUBMIT_OPTIONS;
`after` may also wait element by element, `ok:ID[*]`) and max_running, the ones arrays took first first."""

RESULTS_CHUNK = 64 * 1024 * 1024
"""Bytes of results one array_results call answers at most (it answers one result at least: call again)."""

POLL = 0.1
"""Seconds between looks at an array's rows while a call waits for its end."""


class ArrayCalls:
    """The exposed calls about arrays, mixed into the service (rpycdl.server.service.GPUService)."""

    context: ServerContext
    _identity: auth.Identity
    _request: Callable[..., request.JobRequest]
    _detached: Callable[..., tuple[dict[str, Any], results.Seal | None, tuple[str, bool] | None]]

    def exposed_submit_array(self, payload: bytes, arguments: Any, *args: Any, **kwargs: Any) -> bytes:
        """Submit an array: `payload` (codec.encode_payload of the function, its argument None) and `arguments`, a
        tuple of each element's argument pickled (codec.dumps); options ARRAY_OPTIONS. Answers its view."""
        def submit() -> dict[str, Any]:
            parts = _arguments(arguments, self.context.limits.max_payload - len(payload))
            request.check_size(payload, "payload", self.context.limits.max_payload)
            return self._submit_array(args, kwargs, parts, body=codec.check_payload(payload))

        return jobcalls._answer(submit, self.context)

    def exposed_submit_command_array(self, argvs: Any, *args: Any, **kwargs: Any) -> bytes:
        """Submit a command per element (`argvs`: a tuple of argvs, each a tuple of strings); its exit code is each
        element's result, as submit_command's."""
        def submit() -> dict[str, Any]:
            given = netrefs.materialize(argvs, self.context.limits.max_payload)
            if not isinstance(given, (tuple, list)) or not 0 < len(given) <= MAX_ARRAY:
                raise InvalidRequestError(f"an array has 1 to {MAX_ARRAY} commands, not {type(given).__name__}")
            commands = [list(request.check_command(argv)) for argv in given]
            body = codec.check_payload(codec.encode_payload(run_command, None))
            parts = [codec.dumps(command)[0] for command in commands]
            return self._submit_array(args, kwargs, parts, body=body, command=tuple(commands[0]))

        return jobcalls._answer(submit, self.context)

    def _submit_array(self, args: tuple[Any, ...], kwargs: dict[str, Any], parts: list[bytes],
                      **job: Any) -> dict[str, Any]:
        options = request.named(ARRAY_OPTIONS, args, kwargs)
        max_running = arrays.check(parts, options.pop("max_running", None))
        detached, seal, _ = self._detached(options, len(parts))
        checked = self._request(options, **detached, **job)
        array = arrays.hand_over(self.context, checked, parts, max_running, seal)
        return arrays.view(self.context, array)

    def exposed_array(self, ref: Any) -> bytes:
        """An array's view by id, or by name among the caller's arrays."""
        return jobcalls._answer(lambda: arrays.view(self.context, self._array(ref)))

    def exposed_array_wait(self, ref: Any, timeout: Any = None) -> bytes:
        """An array's view once none of its elements is unfinished, or after `timeout` (JOB_WAIT_MAX at most)."""
        def wait() -> dict[str, Any]:
            array = self._array(ref)
            deadline = time.monotonic() + min(request.check_seconds(timeout, "timeout") or JOB_WAIT_MAX, JOB_WAIT_MAX)
            while rows.counts(self.context.ledger, array.array_id)["unfinished"] and time.monotonic() < deadline:
                time.sleep(POLL)
            return arrays.view(self.context, array)

        return jobcalls._answer(wait)

    def exposed_array_results(self, ref: Any, start: Any = 0) -> bytes:
        """The results of the array's elements from index `start`, in order, up to RESULTS_CHUNK bytes (one at
        least), each (job id, "result", its result file as it is, seal included) or (job id, "error", this
        server's outcome: why it has none); only finished elements, stopping at the first unfinished one."""
        def read() -> list[tuple[str, str, bytes]]:
            array = self._array(ref, mine=True)
            first = jobcalls._count(start, "start")
            answered: list[tuple[str, str, bytes]] = []
            size = 0
            for record in rows.elements(self.context.ledger, array.array_id, first, 1000):
                if not record.state.finished or (answered and size > RESULTS_CHUNK):
                    break
                stored = self.context.files.result(record.job_id)
                if stored is not None:
                    answered.append((record.job_id, "result", stored))
                else:
                    answered.append((record.job_id, "error", codec.encode_error(jobcalls._ended(record), tb="")))
                size += len(answered[-1][2])
            return answered

        return jobcalls._answer(read)

    def exposed_array_cancel(self, ref: Any) -> bytes:
        """Cancel every unfinished element of an array (its owner or an admin may); answers how many were asked."""
        return jobcalls._answer(lambda: arrays.cancel(self.context, self._array(ref, mine=True)))

    def exposed_array_elements(self, ref: Any, start: Any = 0, count: Any = 1000) -> bytes:
        """The rows of an array's elements from index `start`, `count` at most (1000 at most), as job() shows them."""
        def read() -> list[dict[str, Any]]:
            array = self._array(ref)
            records = rows.elements(self.context.ledger, array.array_id, jobcalls._count(start, "start"),
                                    min(jobcalls._count(count, "count"), 1000))
            return [jobcalls._shown(self.context, record, self._identity, {}) for record in records]

        return jobcalls._answer(read)

    def _array(self, ref: Any, mine: bool = False) -> Array:
        """The array `ref` names (an id, or one of the caller's names); with `mine`, only for its owner or an admin."""
        if not isinstance(ref, str) or not ref.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise InvalidRequestError(f"not an array id or name: {ref!r}")
        me = self._identity
        array = rows.find(self.context.ledger, ref, me.user, me.verified)
        if array is None:
            raise InvalidRequestError(f"no array {ref!r} here: see `rpycdl jobs --all` for the jobs this host keeps")
        owner = auth.Identity(array.user, array.user_verified)
        if mine and not visibility.sees_all(me, owner):
            self.context.ledger.count_refusal(self.context.name, "not_allowed")
            raise NotAllowedError(visibility.refusal(array.array_id, owner, me))
        return array


def _arguments(arguments: Any, room: int) -> list[bytes]:
    """The elements' arguments as they came (a tuple of bytes, which RPyC passes by value), within `room` bytes."""
    if not isinstance(arguments, tuple) or not all(isinstance(part, bytes) for part in arguments):
        raise InvalidRequestError("an array's arguments come as a tuple of pickles (bytes)")
    if not 0 < len(arguments) <= MAX_ARRAY:
        raise InvalidRequestError(f"an array has 1 to {MAX_ARRAY} elements, not {len(arguments)}")
    total = sum(len(part) for part in arguments)
    if total > room:
        raise InvalidRequestError(f"the array's arguments ({total} bytes) pass this server's --max-payload")
    return list(arguments)
