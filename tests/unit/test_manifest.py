"""rpycdl.artifacts.manifest: a working directory scanned again as it was has the digest it had; any
change a write can make (content, size, mode, an entry added or gone) names nothing, even with the
file's mtime set back; a file changed within RACY_NS of the scan is compared by content until it settles."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import blake3

from rpycdl.artifacts import workdir
from rpycdl.artifacts.manifest import Manifests

MiB = 1024**2


def project(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "model.py").write_text("LR = 0.5\n")
    (root / "data.bin").write_bytes(os.urandom(1000))
    (root / "latest").symlink_to("data.bin")
    return root


SERVER = "gpu01:18861"


def sent(manifests: Manifests, source: Path) -> str:
    """Send `source` as a client does: stream it (its racy files hashed apart), remember the digest the
    server computed."""
    scanned = workdir.scan(source, MiB)
    archive = bytearray()
    racy = scanned.stream(archive.extend, manifests.racy(scanned))
    digest = blake3.blake3(archive).hexdigest()
    manifests.remember(scanned, SERVER, digest, racy)
    return digest


def test_an_unchanged_directory_has_its_digest_and_any_change_names_nothing(tmp_path):
    manifests = Manifests(tmp_path / "manifests", racy_ns=0)  # times alone tell
    source = project(tmp_path / "src")
    assert manifests.known(workdir.scan(source, MiB), SERVER) is None
    digest = sent(manifests, source)
    assert digest == workdir.pack(source, MiB).digest
    assert manifests.known(workdir.scan(source, MiB), SERVER) == digest
    assert manifests.known(workdir.scan(source, MiB), "gpu02:18861") is None  # what one server named

    model = source / "pkg" / "model.py"
    before = model.stat()
    time.sleep(0.05)  # past the tick of the kernel's clock that stamped it (racy_ns=0 does not guard it)
    model.write_text("LR = 0.7\n")  # the same size, the mtime set back: the ctime still tells
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert manifests.known(workdir.scan(source, MiB), SERVER) is None
    assert sent(manifests, source) != digest

    changes = [lambda: (source / "new.txt").write_text("x"), lambda: (source / "data.bin").chmod(0o600),
               lambda: (source / "latest").unlink(), lambda: (source / workdir.IGNORE_FILE).write_text("*.bin\n")]
    for change in changes:
        known = sent(manifests, source)
        change()
        assert manifests.known(workdir.scan(source, MiB), SERVER) is None
        assert sent(manifests, source) != known


def test_a_racy_file_is_compared_by_content_until_it_settles(tmp_path):
    manifests = Manifests(tmp_path / "manifests", racy_ns=3600 * 10**9)  # racy for an hour: however slow the scan
    source = project(tmp_path / "src")
    digest = sent(manifests, source)  # everything was written just now: all racy
    [stored] = (tmp_path / "manifests").glob("*.json")
    racy = json.loads(stored.read_text())["racy"]
    assert set(racy) == {"pkg/model.py", "data.bin"}
    assert manifests.known(workdir.scan(source, MiB), SERVER) == digest  # read again, the same

    forged = {**json.loads(stored.read_text()), "racy": {**racy, "pkg/model.py": "0" * 64}}
    stored.write_text(json.dumps(forged))  # as if it had been written again within the same tick
    assert manifests.known(workdir.scan(source, MiB), SERVER) is None

    digest = sent(manifests, source)
    assert json.loads(stored.read_text())["racy"]
    settling = Manifests(tmp_path / "manifests", racy_ns=300 * 10**6)  # the same manifests, racy for 0.3 s
    time.sleep(0.4)
    assert settling.known(workdir.scan(source, MiB), SERVER) == digest
    assert json.loads(stored.read_text())["racy"] == {}  # settled: its times tell from now on


def test_no_manifest_where_none_can_be_kept(tmp_path):
    source = project(tmp_path / "src")
    nowhere = Manifests("")
    digest = workdir.pack(source, MiB).digest
    nowhere.remember(workdir.scan(source, MiB), SERVER, digest, {})
    assert nowhere.known(workdir.scan(source, MiB), SERVER) is None
    (tmp_path / "file").write_text("not a directory")
    blocked = Manifests(tmp_path / "file" / "manifests")
    blocked.remember(workdir.scan(source, MiB), SERVER, digest, {})  # nothing kept, nothing raised
    assert blocked.known(workdir.scan(source, MiB), SERVER) is None
