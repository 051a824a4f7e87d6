"""An array element's call, as its job process runs it: the array's function (a payload body, stored once for the
whole array) applied to the element's own argument (a pickle of its own), both unpickled only in the job process."""

from __future__ import annotations

from typing import Any

import dill

from rpycdl.wire import codec


def run_element(parts: tuple[bytes, bytes]) -> Any:
    """`fn(arg)` for an array element: `parts` is the array's payload body (wire.codec: its function, with the source
    lines of the client's functions) and the element's argument pickled. What the server sends a job process for an
    element is a payload of this function (pickled by its name) with those bytes (rpycdl.server.arrays)."""
    function_body, argument = parts
    fn, _ = codec.load_call(function_body)
    return fn(dill.loads(argument))
