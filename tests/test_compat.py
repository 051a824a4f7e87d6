"""Clients written for the original RPyC deep-learning servers work unchanged against rpycdl servers."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import textwrap
import time

import dill
import pytest
import rpyc
from helpers import wait_idle, wait_until

import rpycdl
from rpycdl.registry import discover

# The original client, word for word, except for the registrar argument: the test registry
# listens on a free loopback port, not on the broadcast default. dill.dumps(fn) without
# recurse=True leaves fn's globals to the server's __main__, so fn imports what it uses, as
# original clients had to.
ORIGINAL_CLIENT = textwrap.dedent('''
    import sys

    import dill
    import rpyc
    from rpyc.utils.registry import UDPRegistryClient

    REGISTRY_PORT, SERVICE, MODE = int(sys.argv[1]), sys.argv[2], sys.argv[3]


    def fn(code_args):
        import os
        import subprocess
        import sys

        print("job sees GPUs", os.environ["CUDA_VISIBLE_DEVICES"])
        print("code_args arrived as", type(code_args).__name__, type(code_args[1]).__name__)
        sys.stderr.write("job warning on stderr\\n")
        subprocess.run(["sh", "-c", "echo child process output"], check=True)
        if code_args[0] == "fail":
            raise ValueError("remote failure " + code_args[1])
        return {"type": type(code_args).__name__, "total": sum(code_args[1]), "dict": code_args[2]}


    code_args = ["ok", [1, 2, 3], {"lr": 0.1, "layers": [64, 32]}] if MODE == "ok" else ["fail", "xyz"]
    conn = rpyc.connect_by_service(SERVICE, registrar=UDPRegistryClient(ip='127.0.0.1', port=REGISTRY_PORT),
                                   config={'allow_public_attrs': True})
    print(conn.root.run_code(dill.dumps(fn), code_args, ngpus=1, stdout=sys.stdout, stderr=sys.stderr))
    sys.stdout.flush()
    print("rpycdl imported by the original client:", "rpycdl" in sys.modules, file=sys.stderr)
''')


@pytest.fixture
def original_client(tmp_path, cluster):
    script = tmp_path / "original_client.py"
    script.write_text(ORIGINAL_CLIENT)

    def run(service: str, mode: str = "ok") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), str(cluster.registry_port), service, mode],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)

    return run


@pytest.fixture
def tensorflow(server):
    return server("tensorflow", "fake:2", "--framework-version", "2.15.1")


def test_tensorflow_aliases_are_registered(cluster, tensorflow):
    for name in ("TENSORFLOW", "TENSORFLOW-2.15", "TENSORFLOW-2.15.1", "tensorflow-2.15"):
        assert ("127.0.0.1", tensorflow) in discover(name, cluster.registry_address), name
    assert discover("TENSORFLOW-2.14", cluster.registry_address) == ()
    with rpycdl.connect("TENSORFLOW-2.15", registry_address=cluster.registry_address) as conn:
        info = conn.root.gpu_status()["server"]
    assert info["aliases"] == ["TENSORFLOW", "TENSORFLOW-2.15", "TENSORFLOW-2.15.1"]
    assert info["framework_version"] == "2.15.1"


@pytest.mark.parametrize("service", ["tensorflow", "TENSORFLOW-2.15.1"])
def test_original_client_runs_unchanged(original_client, tensorflow, service):
    result = original_client(service)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] in ("job sees GPUs 0", "job sees GPUs 1")
    assert lines[1] == "code_args arrived as list list"
    assert lines[2] == "child process output"
    assert lines[3] == "{'type': 'list', 'total': 6, 'dict': {'lr': 0.1, 'layers': [64, 32]}}"
    assert "job warning on stderr\n" in result.stderr
    assert "rpycdl imported by the original client: False" in result.stderr


def test_remote_exception_is_raised_in_the_original_client(original_client, tensorflow, connect):
    result = original_client("tensorflow", "fail")
    assert result.returncode == 1
    assert "job sees GPUs" in result.stdout  # it ran and printed before failing
    assert "ValueError: remote failure xyz" in result.stderr
    assert 'raise ValueError("remote failure " + code_args[1])' in result.stderr  # the job's own frame
    wait_idle(connect(tensorflow))


@pytest.mark.parametrize("service", ["deeplearning", "caffe"])
def test_other_original_services_start_register_and_serve(cluster, server, original_client, service):
    port = server(service, "fake:1")
    assert ("127.0.0.1", port) in discover(service.upper(), cluster.registry_address)
    assert service.upper() in rpycdl.registry.list_services(cluster.registry_address)
    result = original_client(service)
    assert result.returncode == 0, result.stderr
    assert "job sees GPUs 0" in result.stdout
    assert "'total': 6" in result.stdout


def _original_connection(port: int) -> rpyc.Connection:
    """A plain RPyC connection, as the original clients make."""
    return rpyc.connect("127.0.0.1", port, config={"allow_public_attrs": True, "sync_request_timeout": None})


def _make_slow_result_job():
    """A job that returns at once a value that takes 3 s to unpickle (what the server must do for an
    original client), after noting when it returned."""

    def job(marker):
        import time

        class SlowToLoad:
            def __reduce__(self):
                return time.sleep, (3,)

        with open(marker, "w") as f:
            f.write(str(time.time()))
        return SlowToLoad()

    return job


def test_an_original_clients_gpus_are_free_before_its_value_is_made(server, connect, tmp_path):
    port = server("pytorch", "fake:1")
    marker = tmp_path / "returned"
    conn = _original_connection(port)
    call = concurrent.futures.ThreadPoolExecutor(1).submit(
        conn.root.run_code, dill.dumps(_make_slow_result_job(), recurse=True), str(marker), timeout=1)
    wait_until(marker.exists, 20, "the job to return")
    returned = float(marker.read_text())
    status = connect(port)
    wait_until(lambda: not status.root.gpu_status()["gpus"][0]["holders"], 10, "the GPU to be free")
    assert time.time() - returned < 1.0, f"the GPU was held {time.time() - returned:.1f} s while the value loaded"
    assert not call.done(), "the value loaded before the GPU was free: the test did not test the order"
    assert call.result(20) is None  # time.sleep's value: the slow load did happen, after the release


def test_an_original_clients_value_that_grows_when_loaded_is_refused(server, tmp_path):
    def job(_):
        class Huge:
            def __reduce__(self):
                return bytearray, (3 * 1024**3,)  # 3 GiB from a pickle of a few bytes

        return Huge()

    conn = _original_connection(server("pytorch", "fake:1"))
    with pytest.raises(Exception, match="LimitError.*needs more than .* bytes of memory to load"):
        conn.root.run_code(dill.dumps(job, recurse=True), None)
    assert conn.root.run_code(dill.dumps(lambda x: x + 1, recurse=True), 1) == 2  # and it keeps serving
