"""The client's memory of the working directories it sent (manifests): a directory scanned again with
every entry as it was (names, types, modes, sizes, and each file's device, inode, mtime and ctime) has
the digest it had, and its files are not read again. A manifest holds for one server: the digest is the
one that server computed of what it received, so no server can make a client name a content on another.

A write to a file changes its mtime and ctime (a program can set the mtime back, not the ctime), so an
identity unchanged says the content is unchanged, but for what the kernel's clock cannot tell apart: a
file written again within the same tick of the clock that stamped it. Such a file ("racy", as git calls
it: changed in the RACY_NS before the scan began) is remembered by the hash of its content as well,
and read again to compare, until it is older than that. What is left: a change that keeps size, mtime
and ctime, which takes writes through a shared mapping not yet synced, the system clock set back, or a
filesystem whose timestamps are coarser than RACY_NS or lie (some network filesystems)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path

from rpycdl.artifacts.workdir import Scan
from rpycdl.defaults import ENV_MANIFESTS, MANIFESTS, MANIFESTS_KEPT

RACY_NS = 2 * 10**9
"""A file changed less than this before its directory was scanned may change again unseen by its times."""


class Manifests:
    """The manifests in the directory `root` (default: $RPYCDL_MANIFESTS, else MANIFESTS; "" keeps none),
    one small JSON file per working directory, readable by its user alone. A manifest that cannot be read
    or written is no manifest: the directory is read and sent again. `racy_ns`: see RACY_NS."""

    def __init__(self, root: str | os.PathLike[str] | None = None, racy_ns: int = RACY_NS) -> None:
        where = os.fspath(root) if root is not None else os.environ.get(ENV_MANIFESTS, MANIFESTS)
        self.root = Path(where).expanduser() if where else None
        self.racy_ns = racy_ns

    def known(self, scanned: Scan, server: str) -> str | None:
        """The digest of the directory `scanned`, if it is as it was when it was last sent to `server` (its
        address as dialled); else None."""
        path = self._path(scanned, server)
        try:
            stored = json.loads(path.read_text()) if path is not None else None
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != scanned.key():
            return None
        racy = stored.get("racy", {})
        if racy and scanned.digests(racy) != racy:  # their content, read again
            return None
        settled = set(racy) - set(self.racy(scanned))
        if settled:  # now old enough for their times to tell
            self.remember(scanned, server, stored["digest"], {name: racy[name] for name in set(racy) - settled})
        else:
            with contextlib.suppress(OSError):
                os.utime(path)  # type: ignore[arg-type]
        return stored["digest"]

    def racy(self, scanned: Scan) -> list[str]:
        """The files of `scanned` to remember by content as well (see the module's docstring)."""
        return scanned.changed_since(scanned.scanned_ns - self.racy_ns)

    def remember(self, scanned: Scan, server: str, digest: str, racy: dict[str, str]) -> None:
        """Remember that `scanned` was sent to `server`, which named it `digest`; `racy`: the content hash of the
        content of its racy files, as they were sent. Forgets the least recently used beyond MANIFESTS_KEPT."""
        path = self._path(scanned, server)
        if path is None:
            return
        with contextlib.suppress(OSError):
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, aside = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            try:
                with open(fd, "w") as out:
                    json.dump({"directory": scanned.root, "server": server, "key": scanned.key(), "digest": digest,
                               "racy": racy}, out)
                os.replace(aside, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(aside)
            kept = sorted(path.parent.glob("*.json"), key=lambda known: known.stat().st_mtime)
            for forgotten in kept[:-MANIFESTS_KEPT]:
                forgotten.unlink(missing_ok=True)

    def _path(self, scanned: Scan, server: str) -> Path | None:
        if self.root is None:
            return None
        where = f"{os.path.realpath(scanned.root)}\0{server}".encode(errors="surrogateescape")
        return self.root / f"{hashlib.sha256(where).hexdigest()[:32]}.json"
