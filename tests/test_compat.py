"""Clients written for the original RPyC deep-learning servers work unchanged against rpycdl servers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import wait_idle

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
