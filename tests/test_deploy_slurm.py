"""deploy/slurm/rpycdl-server.sbatch, run with bash as Slurm runs a batch script: with the variables Slurm
sets in a job granted two of a node's four GPUs (played by the fake NVML driver, with and without device
cgroups), it starts a real server that manages exactly those GPUs and registers with a real registry, and
Slurm's TERM at the end of the allocation stops it and takes it out of the registry."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until
from test_deploy_confinement import UUIDS, driver, gpu_env

import rpycdl
from rpycdl import registry
from rpycdl.site.local import one_account

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "slurm" / "rpycdl-server.sbatch"
SECRET = "slurm's own secret, 32 characters"


def slurm_job(tmp_path: Path, registry_address: str, denied: tuple[int, ...] = (), **settings: str) -> dict[str, str]:
    """The environment of Slurm job 4242's batch script on node gpu07, granted GPUs 1 and 3 (`CUDA_VISIBLE_DEVICES`
    as Slurm sets it, given in `settings`), with rpycdl's environment on the PATH and the fake driver."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    environ = {name: value for name, value in os.environ.items()
               if not name.startswith(("SLURM", "RPYCDL_", "CUDA_", "NVIDIA_"))}
    return {**environ, **driver(tmp_path / "nvml.json", denied),
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), environ.get("PATH", "")]),
            "TMPDIR": str(tmp_path),
            "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NAME": "rpycdl-server",
            "SLURM_JOB_NODELIST": "gpu07", "SLURMD_NODENAME": "gpu07", "SLURM_NNODES": "1", "SLURM_NTASKS": "1",
            "SLURM_JOB_GPUS": "1,3", "SLURM_GPUS_ON_NODE": "2", "SLURM_SUBMIT_DIR": str(tmp_path),
            "RPYCDL_REGISTRY": registry_address, "RPYCDL_SECRET_FILE": str(secret),
            "RPYCDL_SERVE_ARGS": " ".join(one_account()), **settings}  # a batch job runs as its user, never root


def run_script(environ: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["bash", str(SCRIPT)], env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@pytest.mark.parametrize("denied, visible, indices", [
    ((), "1,3", [1, 3]),  # no device cgroups: Slurm names the node's GPUs 1 and 3
    ((0, 2), "0,1", [0, 1]),  # ConstrainDevices: the job sees only its two, as CUDA's 0 and 1
], ids=["node-indices", "device-cgroups"])
def test_the_batch_script_serves_the_jobs_gpus_for_the_allocations_lifetime(cluster, tmp_path, denied, visible,
                                                                             indices):
    environ = slurm_job(tmp_path, cluster.registry_address, denied, CUDA_VISIBLE_DEVICES=visible,
                        GPU_DEVICE_ORDINAL=visible,
                        RPYCDL_SERVE_ARGS=" ".join(["--keep 1d --max-queued 50", *one_account()]))
    script = run_script(environ)
    try:
        servers = wait_until(lambda: registry.discover("pytorch", cluster.registry_address) or script.poll(), 30,
                             "the server to register")
        assert script.poll() is None, script.stdout.read()
        [(host, port)] = servers
        with rpycdl.connect("pytorch", registry_address=cluster.registry_address,
                            secret_file=environ["RPYCDL_SECRET_FILE"]) as conn:
            gpus = [(gpu["index"], gpu["uuid"]) for gpu in conn.root.gpu_status()["gpus"]]
            assert gpus == list(zip(indices, [UUIDS[1], UUIDS[3]], strict=True))
            seen = conn.root.run_code(gpu_env, None, ngpus=-1)
        assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, indices))
        assert seen["RPYCDL_GPU_UUIDS"] == f"{UUIDS[1]},{UUIDS[3]}"
        with pytest.raises(rpycdl.AuthFailedError):  # beyond loopback, only with the secret
            rpycdl.connect(host=host, port=port).root.gpu_status()
        assert (tmp_path / "rpycdl-4242" / "state" / "ledger.sqlite3").is_file(), "the allocation's own lock directory"

        script.send_signal(signal.SIGTERM)  # the end of the allocation (--signal=B:TERM@120), or scancel
        assert script.wait(15) == 0
        output = script.stdout.read()
        assert "rpycdl server for Slurm job 4242 on gpu07: GPUs " + visible in output
        assert "rpycdl serve: stopped" in output
        assert registry.discover("pytorch", cluster.registry_address) == (), "it left the registry"
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()


@pytest.mark.parametrize("drop, settings, words", [
    ("SLURM_JOB_ID", {}, "not in a Slurm job"),
    ("CUDA_VISIBLE_DEVICES", {}, "Slurm granted this job no GPU (CUDA_VISIBLE_DEVICES is not set)"),
    ("RPYCDL_REGISTRY", {}, "set RPYCDL_REGISTRY"),
    (None, {"RPYCDL_TLS_CERT": "/etc/server.crt"}, "TLS needs all three"),
    (None, {"PATH": "/usr/bin:/bin"}, "rpycdl is not on the PATH"),
])
def test_the_batch_script_says_what_is_missing(cluster, tmp_path, drop, settings, words):
    environ = slurm_job(tmp_path, cluster.registry_address, CUDA_VISIBLE_DEVICES="0", **settings)
    environ.pop(drop or "", None)
    script = run_script(environ)
    output, _ = script.communicate(timeout=30)
    assert script.returncode == 2 and words in output, output


def test_a_server_refuses_to_listen_beyond_loopback_without_authentication(cluster, tmp_path):
    environ = slurm_job(tmp_path, cluster.registry_address, CUDA_VISIBLE_DEVICES="0")
    del environ["RPYCDL_SECRET_FILE"]
    output, _ = (script := run_script(environ)).communicate(timeout=30)
    assert script.returncode == 1 and "refusing to listen on 0.0.0.0 without authentication" in output, output


def test_the_allocation_signals_the_batch_shell_before_its_end():
    directives = re.findall(r"^#SBATCH (\S+)", SCRIPT.read_text(), re.M)
    header = SCRIPT.read_text().split("\nset -euo pipefail", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines()), "sbatch reads directives up to the first command"
    assert any(re.fullmatch(r"--signal=B:TERM@\d+", directive) for directive in directives), directives
    assert any(directive.startswith(("--gres=gpu", "--gpus")) for directive in directives), directives
