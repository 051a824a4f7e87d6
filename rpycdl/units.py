"""Sizes and durations as people write and read them: '16GiB' or '512MiB' in, '1 GiB' out, bytes
inside; '7d' or '90m' in, seconds inside."""

from __future__ import annotations

import re

from rpycdl.errors import InvalidRequestError

MiB = 1024**2
GiB = 1024**3
_SIZE_UNITS = {"": 1, "B": 1, "KIB": 1024, "MIB": MiB, "GIB": GiB, "TIB": 1024**4,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(text: str) -> int:
    """Parse '16GiB', '512MiB', '8GB' or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise InvalidRequestError(f"not a memory size: {text!r} (try 16GiB or 512MiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def format_size(nbytes: int) -> str:
    """A size in words, in the largest binary unit it fills: '0 B', '512 MiB', '1 GiB', '79.6 GiB'.

    At most one decimal, and none when it is whole (so parse_size reads it back, to within 0.05 of the unit).
    """
    size, unit = float(nbytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if abs(round(size, 1)) < 1024:
            break
        size, unit = size / 1024, bigger
    text = f"{size:.1f}".removesuffix(".0")
    return f"{text} {unit}"


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Parse '90s', '30m', '12h', '7d', '2w' or a plain number of seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]?)\s*", text)
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise InvalidRequestError(f"not a duration: {text!r} (try 90s, 30m, 12h, 7d or 2w)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def format_duration(seconds: float) -> str:
    """A duration in words, to the second, in its two largest units: '45s', '3m05s', '2h07m', '3d04h',
    and in one when that is exact ('7d', '2h'), so parse_duration reads it back."""
    seconds = max(0, int(seconds))
    for unit, size, smaller, small in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= size:
            rest = seconds % size // small
            return f"{seconds // size}{unit}" + (f"{rest:02d}{smaller}" if rest else "")
    return f"{seconds}s"
