"""A client's credentials and registry: from arguments (the CLI's flags), else environment
variables, else the credentials file, setting by setting.

The file (`~/.config/rpycdl/credentials.toml`, or `$RPYCDL_CONFIG`) is TOML with these keys,
all optional; relative paths are relative to the file:

    secret_file = "~/.rpycdl-secret"
    tls_cert = "user-alice.crt"
    tls_key = "user-alice.key"
    tls_ca = "ca.crt"
    registry = "10.0.0.2"
    result_key = "result-key"

`result_key` is this client's result key (rpycdl.security.results: the secret that seals its detached jobs'
results), made on first need; by default `result-key` beside the credentials file.
"""

from __future__ import annotations

import functools
import os
import ssl
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from rpycdl.defaults import (
    CONFIG_FILE,
    ENV_CONFIG,
    ENV_REGISTRY,
    ENV_RESULT_KEY,
    ENV_SECRET_FILE,
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    RESULT_KEY_FILE,
)
from rpycdl.errors import InvalidRequestError
from rpycdl.security import auth, results, tls

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENVIRONMENT = {"secret_file": ENV_SECRET_FILE, "tls_cert": ENV_TLS_CERT, "tls_key": ENV_TLS_KEY,
               "tls_ca": ENV_TLS_CA, "registry": ENV_REGISTRY, "result_key": ENV_RESULT_KEY}
"""The environment variable of each setting."""


@dataclass(frozen=True)
class Settings:
    """Where a client's credentials are, and which registry it asks (None: not set anywhere)."""

    secret_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    registry: str | None = None
    result_key: str | None = None

    def secret(self) -> bytes | None:
        """The shared secret, or None."""
        return auth.load_secret(self.secret_file) if self.secret_file else None

    def tls_context(self) -> ssl.SSLContext | None:
        """The client's TLS context, or None when no TLS setting is given."""
        if not (self.tls_cert or self.tls_key or self.tls_ca):
            return None
        return tls.client_context(self.tls_cert, self.tls_key, self.tls_ca)


def config_path() -> Path:
    """The credentials file: $RPYCDL_CONFIG, else ~/.config/rpycdl/credentials.toml."""
    return Path(os.environ.get(ENV_CONFIG) or CONFIG_FILE).expanduser()


def read_config(path: Path) -> dict[str, str]:
    """The settings in a credentials file (nothing if it does not exist), paths made absolute.

    Raises:
        InvalidRequestError: the file is not TOML, has an unknown key or a value that is not a string.
    """
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read the credentials file {path}: {exc}") from None
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidRequestError(f"unknown setting(s) {', '.join(unknown)} in {path}; "
                                  f"known: {', '.join(sorted(known))}")
    settings = {}
    for key, value in data.items():
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{key} in {path} must be a non-empty string, not {value!r}")
        settings[key] = value if key == "registry" else str(path.parent / Path(value).expanduser())
    return settings


def resolve(**given: str | None) -> Settings:
    """Each setting from `given` (e.g. a CLI flag), else its environment variable, else the
    credentials file. Keys: secret_file, tls_cert, tls_key, tls_ca, registry, result_key.

    Raises:
        InvalidRequestError: an unknown key, or a bad credentials file.
    """
    unknown = set(given) - set(ENVIRONMENT)
    if unknown:
        raise InvalidRequestError(f"unknown credential setting(s): {', '.join(sorted(unknown))}")
    config: dict[str, str] | None = None
    values: dict[str, str | None] = {}
    for key, env in ENVIRONMENT.items():
        value = given.get(key) or os.environ.get(env)
        if not value:
            config = read_config(config_path()) if config is None else config
            value = config.get(key)
        values[key] = value
    return Settings(**values)


def result_key_path() -> Path:
    """This client's result key file: $RPYCDL_RESULT_KEY, else `result_key` in the credentials file, else
    RESULT_KEY_FILE beside the credentials file."""
    given = resolve().result_key
    return (Path(given).expanduser() if given else config_path().parent / RESULT_KEY_FILE).absolute()


def result_secret() -> tuple[bytes, Path]:
    """This client's result secret (security.results.client_secret: made on first need) and its file.

    Raises:
        InvalidRequestError: the file cannot be made or read, or is not the user's alone.
    """
    path = result_key_path()
    return _secret(path), path


@functools.cache
def _secret(path: Path) -> bytes:
    """The secret in `path`, read once per process."""
    return results.client_secret(path)
