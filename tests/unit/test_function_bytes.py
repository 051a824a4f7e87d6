"""A function sent again is pickled again only if something it is made of changed (rpycdl.wire.function_bytes):
each change a script can make between two calls reaches the server, and an unchanged function is pickled once."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from rpycdl.wire import codec, function_bytes


def script(source: str) -> dict[str, Any]:
    """The globals of a script (`__main__`, whose functions dill sends by value) that ran `source`."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(textwrap.dedent(source), namespace)  # noqa: S102 - the test's own source
    return namespace


def on_server(fn: Callable[..., Any], args: Any = None) -> Any:
    """What `fn(args)` returns where the server runs it: encoded, checked and loaded as a call is."""
    payload, buffers = codec.encode_call(fn, args)
    loaded, loaded_args = codec.load_call(codec.check_payload(payload, len(buffers)), [b.raw() for b in buffers])
    return loaded(loaded_args)


CHANGES = {
    "a global rebound": ("LIMIT = 1\ndef f(_):\n    return LIMIT\n", "LIMIT = 2"),
    "a list changed in place": ("SEEN = [1]\ndef f(_):\n    return SEEN\n", "SEEN.append(2)"),
    "a dict changed in place": ("TABLE = {'a': 1}\ndef f(_):\n    return TABLE\n", "TABLE['b'] = 2"),
    "the function redefined": ("def f(_):\n    return 1\n", "def f(_):\n    return 2"),
    "a default changed": ("def f(_, n=1):\n    return n\n", "f.__defaults__ = (2,)"),
    "a helper redefined": ("def helper():\n    return 1\ndef f(_):\n    return helper()\n",
                           "def helper():\n    return 2"),
    "a helper's global rebound": ("N = 1\ndef helper():\n    return N\ndef f(_):\n    return helper()\n", "N = 2"),
    "a closure's variable rebound": ("def outer():\n    n = 1\n    def f(_):\n        return n\n"
                                     "    def bump():\n        nonlocal n\n        n = 2\n    return f, bump\n"
                                     "f, bump = outer()\n", "bump()"),
    "a tuple global rebound": ("PAIR = (1, ('a',))\ndef f(_):\n    return PAIR\n", "PAIR = (2, ('b',))"),
    "an attribute set on the function": ("def f(_):\n    return getattr(f, 'mark', 1)\n", "f.mark = 2"),
}


@pytest.mark.parametrize("before, change", CHANGES.values(), ids=CHANGES.keys())
def test_what_changed_between_two_calls_reaches_the_server(before, change):
    namespace = script(before)
    first = on_server(namespace["f"])
    exec(textwrap.dedent(change), namespace)  # noqa: S102
    second = on_server(namespace["f"])
    assert first != second
    assert second == namespace["f"](None)


def test_an_unchanged_function_of_immutable_parts_is_pickled_once_and_one_of_mutable_parts_each_time():
    namespace = script("""
        import math
        SCALE = 2.0
        NAMES = ("a", "b")
        def helper(x):
            return math.floor(x * SCALE)
        def pure(x, n=3):
            return helper(x) + len(NAMES) + n
        ITEMS = []
        def impure(x):
            return x + len(ITEMS)
        """)
    pickled: list[Any] = []

    def dumps(fn: Any) -> bytes:
        pickled.append(fn)
        return codec.dumps(fn)[0]

    pure, impure = namespace["pure"], namespace["impure"]
    assert function_bytes.kept(pure, dumps) == function_bytes.kept(pure, dumps) is not None
    assert pickled == [pure]
    assert function_bytes.kept(impure, dumps) is None and function_bytes.kept(len, dumps) is None
    assert on_server(pure, 1.6) == 8 and on_server(impure, 1) == 1


def test_kept_bytes_go_with_their_function():
    namespace = script("def f(_):\n    return 1\n")
    function_bytes.kept(namespace["f"], lambda fn: codec.dumps(fn)[0])
    kept = len(function_bytes._kept)
    del namespace["f"]
    namespace.clear()
    assert len(function_bytes._kept) == kept - 1
