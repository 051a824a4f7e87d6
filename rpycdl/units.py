"""Sizes as people write and read them: '16GiB' or '512MiB' in, '1 GiB' out; bytes inside."""

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
