"""dill bytes of the function a call sends, made once and reused while nothing it is made of changes.

dill pickles a function of the client's script by value, with its code, defaults, closure and the globals
its code reads, in Python (dill's pickler is pickle's pure-Python one): for a small function that is most of
what a call costs the client (about 0.15 ms of a session call's 0.4 ms of client CPU). A session or a loop
sends the same function again and again, so the bytes are kept with the function (weakly: they go when it
goes) together with everything they were made of, and are reused when every one of those is still the very
same object. That is only sound where the objects cannot change in place, so a function is kept only when
all it is made of is immutable: None, numbers, strings, bytes, tuples and frozensets of them, modules and
classes and functions that dill names rather than copies, and functions of the script that are kept by the
same rule. A function reading a list, a dict or an object is pickled afresh at each call, as before, so that
the server always sees the globals as they are at the call.
"""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

KEEP_MAX = 64 << 10
"""Bytes of a function larger than this are not kept (a large constant among its globals: it may travel
beside the call, out of band, instead)."""

_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_MISSING = object()
"""Stands for a global name that the code reads and the function's globals do not hold (a builtin)."""

_kept: weakref.WeakKeyDictionary[types.FunctionType, tuple[list[Any], bytes]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def kept(fn: Any, dumps: Callable[[Any], bytes]) -> bytes | None:
    """dill bytes of `fn` where it is a function made only of immutable values: `dumps(fn)`, or the bytes it
    gave before if nothing `fn` is made of has changed since (kept for next time, up to KEEP_MAX bytes).
    None for any other callable: it is pickled with its call, afresh."""
    parts = _parts(fn) if type(fn) is types.FunctionType else None
    if parts is None:
        return None
    with _lock:
        known = _kept.get(fn)
    if known is not None and _same(known[0], parts):
        return known[1]
    data = dumps(fn)
    if len(data) > KEEP_MAX:
        return None
    with _lock:
        _kept[fn] = (parts, data)
    return data


def _same(kept: list[Any], parts: list[Any]) -> bool:
    return len(kept) == len(parts) and all(a is b for a, b in zip(kept, parts, strict=True))


def _parts(fn: types.FunctionType) -> list[Any] | None:
    """Everything dill's bytes of `fn` are made of, functions as weak references (so that keeping them does
    not keep the functions alive), or None where one of them is mutable."""
    parts: list[Any] = []
    return parts if _add_function(fn, parts, set()) else None


def _add_function(fn: types.FunctionType, parts: list[Any], seen: set[int]) -> bool:
    parts.append(weakref.ref(fn))
    if id(fn) in seen or _named(fn):
        return True
    seen.add(id(fn))
    if fn.__dict__:
        return False
    parts += [fn.__code__, fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__, fn.__defaults__]
    values = [*(fn.__defaults__ or ()), *_items(fn.__kwdefaults__), *_items(fn.__annotations__)]
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a variable not assigned yet
            values.append(_MISSING)
    values += [fn.__globals__.get(name, _MISSING) for name in global_names(fn.__code__)]
    return all(_add_value(value, parts, seen) for value in values)


def _add_value(value: Any, parts: list[Any], seen: set[int]) -> bool:
    if isinstance(value, types.FunctionType):
        return _add_function(value, parts, seen)
    parts.append(value)
    if value is _MISSING or _immutable(value):
        return True
    if type(value) is types.ModuleType:
        return value.__name__ != "__main__" and sys.modules.get(value.__name__) is value
    if isinstance(value, (type, types.BuiltinFunctionType)):  # a bound method of a list is a builtin too
        return isinstance(getattr(value, "__self__", None), (types.ModuleType, type(None))) and _named(value)
    return False


def _immutable(value: Any) -> bool:
    kind = type(value)
    return kind in _SCALARS or (kind in (tuple, frozenset) and all(_immutable(item) for item in value))


def _named(obj: Any) -> bool:
    """Whether dill pickles `obj` (a function, a class) by its module and name rather than by value."""
    module = getattr(obj, "__module__", None)
    if module in ("__main__", None) or module not in sys.modules:
        return False
    found: Any = sys.modules[module]
    for name in getattr(obj, "__qualname__", "<>").split("."):
        found = getattr(found, name, None)
    return found is obj


def _items(mapping: dict[str, Any] | None) -> list[Any]:
    return [item for pair in (mapping or {}).items() for item in pair]


def global_names(code: types.CodeType) -> list[str]:
    """The names `code` and the functions defined in it look up, in order, each once."""
    names = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(global_names(const)))
    return list(names)
