"""Shares of one GPU (issue 4) through real servers: requests and their errors, packing, the
environment that caps a job's frameworks, the memory watchdog, and what status shows."""

from __future__ import annotations

import os

import pytest
from helpers import Background, gate_job, open_gate, refusal, wait_until

import rpycdl
from rpycdl.cli.status import format_status
from rpycdl.errors import GPUMemoryExceededError, GPUNotGrantedError, InvalidRequestError

GiB = 1024**3


def _jobs():
    """The jobs, defined in a function so that dill sends them by value, not as test_shares.x."""

    def env_job(_):
        import os

        return {key: value for key, value in os.environ.items()
                if key.startswith(("RPYCDL_", "CUDA_", "XLA_", "CUPY_"))}

    def allocate_job(args):
        """Use `size` bytes of the simulated GPU, then hold them for `hold` seconds."""
        import time

        from rpycdl.gpu.inventory import simulate_memory

        simulate_memory(args["size"])
        time.sleep(args["hold"])
        return "done"

    return env_job, allocate_job


env_job, allocate_job = _jobs()


@pytest.fixture
def two_gpus(server) -> int:
    """Two 16 GiB simulated GPUs, shares in 1 GiB units, a 512 MiB allowance."""
    return server("pytorch", "fake:2x16GiB", "--gpu-unit", "1GiB", "--memory-allowance", "512MiB")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpus": 1.5}, "neither a share of one GPU"),
    ({"gpus": 0}, "positive number"),
    ({"gpus": -0.5}, "positive number"),
    ({"gpus": "half"}, "positive number"),
    ({"gpus": float("nan")}, "positive number"),
    ({"gpus": 3}, "this server has 2"),
    ({"gpu_memory": "17GiB"}, "largest GPU here has 16 GiB"),
    ({"gpu_memory": "lots"}, "not a memory size"),
    ({"gpu_memory": 0}, "must be positive"),
    ({"gpu_memory": 2.5}, "a size like '6GiB'"),
    ({"gpus": 0.5, "gpu_memory": "1GiB"}, "not both"),
    ({"ngpus": 1, "gpus": 0.5}, "without ngpus"),
    ({"ngpus": 2, "gpu_memory": "1GiB"}, "without ngpus"),
])
def test_bad_share_requests_fail_at_once(two_gpus, connect, kwargs, message):
    conn = connect(two_gpus)
    error = refusal(lambda: conn.root.run_code(env_job, None, **kwargs))
    assert isinstance(error, InvalidRequestError) and message in str(error), error
    assert conn.root.run_code(lambda x: x, 7) == 7  # the server goes on


def test_a_share_is_rounded_up_to_the_unit_and_its_caps_are_in_the_environment(two_gpus, connect):
    env = connect(two_gpus).root.run_code(env_job, None, gpu_memory="1500MiB")
    assert int(env["RPYCDL_GPU_MEMORY"]) == 2 * GiB  # 1500 MiB in 1 GiB units
    assert int(env["RPYCDL_GPU_MEMORY_TOTAL"]) == 16 * GiB
    assert int(env["CUPY_GPU_MEMORY_LIMIT"]) == 2 * GiB
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(0.125, abs=1e-3)
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) <= 0.125
    assert len(env["RPYCDL_GPU_UUIDS"].split(",")) == 1 and env["CUDA_VISIBLE_DEVICES"] in ("0", "1")

    quarter = connect(two_gpus).root.run_code(env_job, None, gpus=0.25)
    assert int(quarter["RPYCDL_GPU_MEMORY"]) == 4 * GiB
    whole = connect(two_gpus).root.run_code(env_job, None, gpus=2)  # a whole number: whole GPUs, like ngpus
    assert len(whole["RPYCDL_GPU_UUIDS"].split(",")) == 2
    assert not any(key in whole for key in ("RPYCDL_GPU_MEMORY", "CUPY_GPU_MEMORY_LIMIT",
                                            "XLA_PYTHON_CLIENT_MEM_FRACTION"))


def test_a_fraction_unit_rounds_to_parts_of_the_gpu(server, connect):
    port = server("pytorch", "fake:1x16GiB", "--gpu-unit", "1/8")
    env = connect(port).root.run_code(env_job, None, gpus=0.3)  # 0.3 of 16 GiB, in eighths: 3/8
    assert int(env["RPYCDL_GPU_MEMORY"]) == 6 * GiB


def test_shares_run_together_on_one_gpu_and_status_shows_each(two_gpus, connect, tmp_path):
    gate = str(tmp_path / "gate")
    jobs = [Background(connect(two_gpus), gate_job(gate), n, gpus=0.25) for n in range(3)]
    running = [job.wait_state("running") for job in jobs]
    assert {tuple(info["uuids"]) for info in running} == {tuple(running[0]["uuids"])}, "shares were not packed"
    assert [info["share_bytes"] for info in running] == [4 * GiB] * 3

    status = connect(two_gpus).root.gpu_status()
    shared = next(gpu for gpu in status["gpus"] if gpu["uuid"] == running[0]["uuids"][0])
    assert sorted(holder["job_id"] for holder in shared["holders"]) == sorted(job.job_id for job in jobs)
    assert [holder["share_bytes"] for holder in shared["holders"]] == [4 * GiB] * 3
    text = format_status(("127.0.0.1", two_gpus), status)
    assert "shared: 12 GiB of 16 GiB granted to 3 job(s)" in text
    assert all(f"4 GiB: job {job.job_id}" in text for job in jobs), text

    # The other GPU stayed idle, so a whole-GPU job runs at once.
    assert connect(two_gpus).root.run_code(lambda x: x, "whole", ngpus=1, queue_timeout=2) == "whole"
    open_gate(gate)
    assert sorted(job.result() for job in jobs) == [0, 1, 2]


def test_a_whole_gpu_request_waits_for_the_shares_and_status_says_what_it_wants(server, connect, tmp_path):
    port = server("pytorch", "fake:1x16GiB")
    gate = str(tmp_path / "gate")
    share = Background(connect(port), gate_job(gate), "share", gpu_memory="4GiB")
    share.wait_state("running")
    whole = Background(connect(port), lambda x: x, "whole", ngpus=1)
    whole.wait_state("pending")
    status = connect(port).root.gpu_status()
    assert "wants 1 GPU," in format_status(("127.0.0.1", port), status)
    later = Background(connect(port), lambda x: x, "later share", gpus=0.25)
    later.wait_state("pending")  # it would fit, but the whole-GPU request came first
    assert "wants 4 GiB of one GPU" in format_status(("127.0.0.1", port), connect(port).root.gpu_status())
    open_gate(gate)
    assert share.result() == "share" and whole.result() == "whole" and later.result() == "later share"


def test_the_watchdog_stops_a_job_over_its_grant(two_gpus, connect):
    conn = connect(two_gpus)
    # 2 GiB granted, 512 MiB allowed beyond it: 2.5 GiB is fine, 3 GiB is not.
    assert conn.root.run_code(allocate_job, {"size": 5 * GiB // 2, "hold": 2.5}, gpu_memory="2GiB") == "done"
    with pytest.raises(GPUMemoryExceededError) as caught:
        conn.root.run_code(allocate_job, {"size": 3 * GiB, "hold": 30}, gpu_memory="2GiB", timeout=20)
    message = str(caught.value)
    assert "used 3072 MiB of GPU" in message and "grant of 2048 MiB" in message and "512 MiB allowance" in message
    jobs = conn.root.jobs()
    assert jobs[0]["state"] == "FAILED" and "over its grant" in jobs[0]["error"]
    status = conn.root.gpu_status()
    assert [gpu["holders"] for gpu in status["gpus"]] == [[], []]
    assert all(gpu["memory_used"] == 0 for gpu in status["gpus"]), "the stopped job's memory is still counted"


def test_the_watchdog_counts_the_processes_a_job_starts(two_gpus, connect):
    def spawning_job(size):
        import subprocess
        import sys

        child = f"import time; from rpycdl import simulate_memory; simulate_memory({size}); time.sleep(30)"
        subprocess.run([sys.executable, "-c", child], check=False)

    with pytest.raises(GPUMemoryExceededError):
        connect(two_gpus).root.run_code(spawning_job, 3 * GiB, gpu_memory="2GiB", timeout=20)


def test_whole_gpu_jobs_are_not_held_to_a_memory_size(two_gpus, connect):
    assert connect(two_gpus).root.run_code(allocate_job, {"size": 15 * GiB, "hold": 1.5}, ngpus=1) == "done"


def test_the_watchdog_stops_a_job_on_a_gpu_it_was_not_granted(two_gpus, connect):
    def sneaking_job(_):
        import os
        import time

        from rpycdl import simulate_memory

        mine = os.environ["RPYCDL_GPU_UUIDS"]
        other = next(uuid for uuid in ("GPU-00000000-0000-4000-8000-000000000000",
                                       "GPU-00000000-0000-4000-8000-000000000001") if uuid != mine)
        os.environ["RPYCDL_GPU_UUIDS"] = f"{mine},{other}"  # as a job that reset CUDA_VISIBLE_DEVICES sees more
        simulate_memory(GiB, device=1)
        time.sleep(30)

    conn = connect(two_gpus)
    with pytest.raises(GPUNotGrantedError, match=r"used GPU \d \(GPU-\S+\), which it was not granted") as caught:
        conn.root.run_code(sneaking_job, None, ngpus=1, timeout=20)
    assert "it may use only GPU" in str(caught.value)
    assert conn.root.jobs()[0]["state"] == "FAILED" and conn.root.jobs()[0]["error_type"] == "GPUNotGrantedError"
    assert [gpu["holders"] for gpu in conn.root.gpu_status()["gpus"]] == [[], []]


def test_simulate_memory_outside_a_simulated_job_says_why(monkeypatch):
    from rpycdl.gpu.inventory import simulate_memory

    monkeypatch.delenv("RPYCDL_SIMULATED_GPUS", raising=False)
    with pytest.raises(RuntimeError, match="jobs on simulated GPUs"):
        simulate_memory(1)


def test_original_clients_can_ask_for_a_share(two_gpus):
    import dill
    import rpyc

    conn = rpyc.connect("127.0.0.1", two_gpus)
    try:
        env = conn.root.run_code(dill.dumps(env_job, recurse=True), None, gpus=0.5)
        assert int(env["RPYCDL_GPU_MEMORY"]) == 8 * GiB
    finally:
        conn.close()


def test_server_refuses_a_bad_unit(cluster):
    with pytest.raises(Exception, match="gpu-unit"):
        cluster.add_server("pytorch", "fake:1", "--gpu-unit", "1/0")
    assert os.path.isdir(cluster.lock_dir)


def test_load_counts_gpus_with_shares_as_busy(two_gpus, connect, tmp_path):
    gate = str(tmp_path / "gate")
    job = Background(connect(two_gpus), gate_job(gate), None, gpus=0.5)
    job.wait_state("running")
    free, waiting, total = connect(two_gpus).root.load()
    assert (free, waiting, total) == (1, 0, 2)
    open_gate(gate)
    job.result()
    wait_until(lambda: connect(two_gpus).root.load()[0] == 2, 5, "the share to be released")


def test_rpycdl_connect_finds_shares_through_the_registry(cluster, two_gpus):
    with rpycdl.connect("pytorch", registry_address=cluster.registry_address) as conn:
        assert int(conn.root.run_code(env_job, None, gpus=0.5)["RPYCDL_GPU_MEMORY"]) == 8 * GiB


def test_the_sweep_example_runs_its_trainings_side_by_side_on_one_gpu(cluster):
    import subprocess
    import sys
    from pathlib import Path

    cluster.add_server("pytorch", "fake:1x16GiB")
    script = Path(__file__).parent.parent / "clients" / "sweep.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RPYCDL_REGISTRY": cluster.registry_address})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all 4 trainings shared one GPU" in done.stdout
