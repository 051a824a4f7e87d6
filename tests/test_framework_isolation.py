"""Promise 6: the server parent never imports a framework (so never initialises CUDA); it reads
the framework's version from package metadata. Its job forkserver imports it once, before any job (the
default --preload), or, without a preload, each job process does."""

from __future__ import annotations

import os
from pathlib import Path

from helpers import forkserver

import rpycdl
from rpycdl import registry

FAKE_TORCH = '''
import os
with open(os.environ["TORCH_IMPORT_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
'''


def _fake_torch(root: Path) -> None:
    """A `torch` distribution, version 9.9.9, whose import writes the importing pid to a log."""
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text(FAKE_TORCH)
    info = root / "torch-9.9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")


def _make_uses_torch():
    def uses_torch(_):
        import os

        import torch  # noqa: F401

        return os.getpid()

    return uses_torch


uses_torch = _make_uses_torch()


def test_the_server_parent_never_imports_the_framework_its_forkserver_preloads_it_once(cluster, tmp_path,
                                                                                        monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _fake_torch(site)
    log = tmp_path / "imports.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TORCH_IMPORT_LOG", str(log))
    process, port = cluster.add_server("pytorch", "fake:2")  # preloads torch, installed here: the fake one
    assert "preloaded: torch;" in process.lines[0]

    assert ("127.0.0.1", port) in registry.discover("PYTORCH-9.9.9", cluster.registry_address)
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        assert conn.root.run_code(lambda x: x, 1) == 1
        conn.root.gpu_status()
        job_pid = conn.root.run_code(uses_torch, None)
    [importer] = log.read_text().split()  # once, before any job: every job starts with it imported
    assert int(importer) == forkserver(process.popen.pid) != process.popen.pid
    assert job_pid not in (int(importer), process.popen.pid)


def test_without_a_preload_only_job_processes_import_the_framework(cluster, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _fake_torch(site)
    log = tmp_path / "imports.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("TORCH_IMPORT_LOG", str(log))
    process, port = cluster.add_server("pytorch", "fake:2", "--preload", "")
    with rpycdl.connect(host="127.0.0.1", port=port) as conn:
        assert conn.root.run_code(lambda x: x, 1) == 1
        assert not log.exists(), "something in the server imported the framework"
        job_pid = conn.root.run_code(uses_torch, None)
    assert log.read_text().split() == [str(job_pid)]
    assert job_pid != process.popen.pid
