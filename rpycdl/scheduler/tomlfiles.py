"""An operator's TOML files (--fair-share, --limits) read, their failures in words that name the file."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from rpycdl.errors import InvalidRequestError


def read(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The parsed TOML file at `path`, `what` naming it in errors ("the limits file").

    Raises:
        InvalidRequestError: the file cannot be read, or is not TOML.
    """
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {what} {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"{what} {path} is not TOML: {exc}") from None
