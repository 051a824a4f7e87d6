"""A server's job forkserver imports the modules of --preload once, before it forks any job, so that every job
starts with them imported (issue 28), a detached job too (its supervisor is the forkserver's); a preload that fails
stops the start, naming the module."""

from __future__ import annotations

import os
import sys

from helpers import forkserver, rpycdl_cli, server_pid

PROBE = """
import os
with open(os.environ["PRELOAD_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
"""


def _make_seen():
    """The job: whether the probe was imported when it started, and its pid (made in a function, so that dill
    sends its code)."""

    def seen(_):
        import os
        import sys

        return "rpycdl_preload_probe" in sys.modules, os.getpid()

    return seen


_seen = _make_seen()


def test_a_preloaded_module_is_imported_once_in_the_forkserver_and_there_in_every_job(cluster, connect, tmp_path):
    (tmp_path / "rpycdl_preload_probe.py").write_text(PROBE)
    log = tmp_path / "imports"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path]), "PRELOAD_LOG": str(log)}
    process, port = cluster.add_server("pytorch", "fake:2", "--preload", "rpycdl_preload_probe", env=env)
    assert "preloaded: rpycdl_preload_probe;" in process.lines[0]
    conn = connect(port)
    seen = [conn.root.run_code(_seen, None) for _ in range(3)]
    seen += [conn.root.submit(_seen, None).result(timeout=60) for _ in range(2)]  # a detached job's too
    assert [found for found, _ in seen] == [True] * 5 and len({pid for _, pid in seen}) == 5
    assert log.read_text().split() == [str(forkserver(server_pid(cluster, port)))]  # once, in the forkserver
    status = rpycdl_cli("status", "--host", "127.0.0.1", "--port", str(port))
    assert "preloaded: rpycdl_preload_probe" in status.stdout, status.stdout


def test_by_default_a_service_without_its_framework_installed_preloads_nothing(cluster, connect):
    process, port = cluster.add_server("pytorch", "fake:1")  # torch is not installed where the tests run
    assert "preloaded: nothing;" in process.lines[0]
    assert connect(port).root.run_code(_seen, None)[0] is False


def test_a_preload_that_fails_stops_the_start_naming_it(lock_dir):
    started = rpycdl_cli("serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none",
                         "--lock-dir", lock_dir, "--preload", "json,rpycdl_no_such_module", timeout=60)
    assert started.returncode == 1, started.stderr
    assert ("could not start: --preload rpycdl_no_such_module: ModuleNotFoundError: No module named "
            "'rpycdl_no_such_module'") in started.stderr, started.stderr
    usage = rpycdl_cli("serve", "--service", "pytorch", "--preload", "not a module", timeout=60)
    assert usage.returncode == 2 and "module names separated by commas" in usage.stderr, usage.stderr
