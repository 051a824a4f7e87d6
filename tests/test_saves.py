"""rpycdl.save_artifact end to end: a job saves a checkpoint while it runs, then crashes (its process
killed, or its supervisor killed -9): the checkpoint is listed by `rpycdl artifacts` and downloads; a
file saved and unchanged is not uploaded again at the end, one changed is; attached and detached jobs;
the default local store and S3 (moto in server mode), whose credentials the job does not get; a store
that fails tells the job and keeps the file for the end; hostile paths and requests refused by name.
Real registry and servers on loopback; only the GPUs are simulated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
from helpers import rpycdl_cli, wait_until
from s3 import CREDENTIALS, moto_server

import rpycdl
from rpycdl import JobState
from rpycdl.scheduler.ledger import Ledger


def _make_trainer() -> Callable[[dict[str, Any]], Any]:
    """A training that saves checkpoints: epoch 1, then epoch 2 under the same name, and a file of its
    working directory; it waits for `gate` (if given) and then crashes, or returns."""

    def train(args: dict[str, Any]) -> Any:
        import os
        import signal
        import time

        import rpycdl

        out = rpycdl.output_dir()
        saved = []
        for epoch in (1, 2):
            with open(os.path.join(out, "ckpt.pt"), "wb") as ckpt:
                ckpt.write(f"epoch {epoch}".encode() * epoch)
            saved.append(rpycdl.save_artifact(os.path.join(out, "ckpt.pt")))
        if args.get("config"):
            saved.append(rpycdl.save_artifact("config.yaml", name="run/config.yaml"))  # from the working directory
        with open(os.path.join(out, "changed.txt"), "w") as changed:
            changed.write("saved")
        saved.append(rpycdl.save_artifact(os.path.join(out, "changed.txt")))
        with open(os.path.join(out, "changed.txt"), "w") as changed:
            changed.write("changed after")  # goes up again at the end
        while args.get("gate") and not os.path.exists(args["gate"]):
            time.sleep(0.05)
        if args.get("crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        return {"saved": saved, "aws": os.environ.get("AWS_SECRET_ACCESS_KEY")}

    return train


train = _make_trainer()


def stored(lock_dir: str, job: rpycdl.Job, name: str) -> Path:
    return Path(lock_dir) / "state" / "artifacts" / job.info["user"] / job.id / name


def test_a_checkpoint_saved_before_a_crash_is_kept(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("lr: 0.01\n")
    gate = tmp_path / "gate"
    job = conn.root.submit(train, {"gate": str(gate), "crash": True, "config": True}, working_dir=project)
    running = wait_until(lambda: len((entry := job.artifacts())["files"]) == 3 and entry, 30, "the saves")
    assert running["state"] == "uploaded" and job.status().state is JobState.RUNNING
    assert running["files"] == [{"name": "changed.txt", "size": 5}, {"name": "ckpt.pt", "size": 14},
                                {"name": "run/config.yaml", "size": 9}]
    checkpoint = stored(lock_dir, job, "ckpt.pt")
    assert checkpoint.read_bytes() == b"epoch 2epoch 2"  # the later save replaced the first
    uploaded_once = checkpoint.stat().st_ino
    gate.touch()
    job.wait(30)
    assert job.status().state is JobState.FAILED  # killed: no result, its checkpoint kept
    entry = wait_until(lambda: (entry := job.artifacts())["state"] == "uploaded" and entry, 20, "the last upload")
    assert [artifact["name"] for artifact in entry["files"]] == ["changed.txt", "ckpt.pt", "run/config.yaml"]
    assert checkpoint.stat().st_ino == uploaded_once  # unchanged since saved: not uploaded again
    assert stored(lock_dir, job, "changed.txt").read_text() == "changed after"  # changed since: uploaded again

    where = ["--host", "127.0.0.1", "--port", str(port)]
    listed = rpycdl_cli("artifacts", job.id, *where)
    assert listed.returncode == 0, listed.stderr
    assert "ckpt.pt" in listed.stdout and "run/config.yaml" in listed.stdout
    fetched = rpycdl_cli("download", job.id, str(tmp_path / "dl"), "--pattern", "*.pt", *where)
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "dl" / "ckpt.pt").read_bytes() == b"epoch 2epoch 2"


def test_an_attached_job_saves_and_a_killed_supervisor_loses_nothing_saved(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    states: list[str] = []
    value = conn.root.run_code(train, {}, on_state=lambda state, info: states.append(info["job_id"]))
    assert value["saved"] == ["ckpt.pt", "ckpt.pt", "changed.txt"]
    attached = wait_until(lambda: (entry := conn.root.job(states[-1]).artifacts())["state"] == "uploaded" and entry,
                          20, "the attached job's outputs")
    assert [artifact["name"] for artifact in attached["files"]] == ["changed.txt", "ckpt.pt"]

    gate = tmp_path / "gate"
    job = conn.root.submit(train, {"gate": str(gate)})
    wait_until(lambda: len(job.artifacts()["files"]) == 2, 30, "the saves")
    supervisor = Ledger(Path(lock_dir) / "state").get(job.id).owner_pid
    os.kill(supervisor, signal.SIGKILL)  # its job dies with it: the end-of-job upload never happens
    assert job.wait(30).state is JobState.LOST
    entry = wait_until(lambda: (entry := job.artifacts())["state"] == "failed" and entry, 20, "the sweep")
    assert {artifact["name"] for artifact in entry["files"]} == {"ckpt.pt", "changed.txt"}
    assert "--retry" in entry["error"]
    job.download(tmp_path / "dl")  # what was saved downloads all the same
    assert (tmp_path / "dl" / "ckpt.pt").read_bytes() == b"epoch 2epoch 2"
    assert job.artifacts(retry=True)["state"] == "uploaded"  # and the rest goes up once asked
    assert stored(lock_dir, job, "changed.txt").read_text() == "changed after"


def test_saves_go_to_s3_without_the_job_seeing_the_credentials(server, connect, tmp_path, monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)  # the server's, inherited
    with moto_server() as endpoint:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="team")
        port = server("pytorch", "fake:2", "--artifacts", "s3://team/runs", "--artifacts-endpoint", endpoint)
        conn = connect(port)
        conn.root.identify("alice")
        gate = tmp_path / "gate"
        job = conn.root.submit(train, {"gate": str(gate), "crash": True})
        wait_until(lambda: len(job.artifacts()["files"]) == 2, 30, "the saves")
        body = s3.get_object(Bucket="team", Key=f"runs/alice/{job.id}/ckpt.pt")["Body"].read()
        assert body == b"epoch 2epoch 2"
        gate.touch()
        assert job.wait(30).state is JobState.FAILED
        wait_until(lambda: job.artifacts()["state"] == "uploaded", 20, "the last upload")
        job.download(tmp_path / "dl", pattern="ckpt.pt")
        assert (tmp_path / "dl" / "ckpt.pt").read_bytes() == b"epoch 2epoch 2"
        assert conn.root.run_code(train, {})["aws"] is None  # the store's secret is the server's alone


def _make_hostile() -> Callable[[str], dict[str, str]]:
    """A job that tries what it must not: each attempt's outcome, by what it tried."""

    def hostile(outside: str) -> dict[str, str]:
        import json
        import os
        import socket

        import rpycdl
        from rpycdl.artifacts.saving import address

        out = rpycdl.output_dir()
        os.symlink(outside, os.path.join(out, "link"))
        os.symlink(os.path.dirname(outside), os.path.join(out, "linked-dir"))
        os.mkfifo(os.path.join(out, "fifo"))
        os.mkdir(os.path.join(out, "dir"))
        with open(os.path.join(out, "ok.txt"), "w") as ok:
            ok.write("ok")
        attempts = {"outside": (outside, None), "link": (os.path.join(out, "link"), None),
                    "through a linked dir": (os.path.join(out, "linked-dir", os.path.basename(outside)), None),
                    "dot-dot": (os.path.join(out, "..", "..", "escape"), None),
                    "fifo": (os.path.join(out, "fifo"), None),
                    "a directory": (os.path.join(out, "dir"), None), "the output dir": (out, None),
                    "name dot-dot": (os.path.join(out, "ok.txt"), "../escape"),
                    "name absolute": (os.path.join(out, "ok.txt"), "/abs")}
        found = {}
        for what, (path, name) in attempts.items():
            try:
                found[what] = "saved " + rpycdl.save_artifact(path, name)
            except rpycdl.RpycdlError as exc:
                found[what] = f"{type(exc).__name__}: {exc}"
        for what, request in {"raw dot-dot": {"name": "../../x"}, "raw link": {"name": "link"},
                              "raw fifo": {"name": "fifo"}, "raw garbage": b"\xff" * 10}.items():
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as channel:  # past the library's checks
                channel.connect(address(os.environ["RPYCDL_SAVE_SOCKET"]))
                channel.sendall(request if isinstance(request, bytes) else json.dumps(request).encode())
                found[what] = json.loads(channel.recv(65536)).get("type", "saved")
        found["socket"] = os.environ["RPYCDL_SAVE_SOCKET"]
        return found

    return hostile


def test_hostile_paths_and_requests_are_refused_by_name(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    outside = tmp_path / "secret.txt"
    outside.write_text("the server's")
    states: list[str] = []
    found = conn.root.run_code(_make_hostile(), str(outside),
                               on_state=lambda state, info: states.append(info["job_id"]))
    assert found["outside"].startswith(f"InvalidRequestError: {outside} is outside the job's own directories")
    for what in ("link", "through a linked dir", "fifo", "a directory"):
        assert found[what].startswith("InvalidRequestError: ") and "symbolic link" in found[what], what
    assert "outside the job's own directories" in found["dot-dot"] and "outside" in found["the output dir"]
    assert "not an artifact's name: '../escape'" in found["name dot-dot"]
    assert "not an artifact's name: '/abs'" in found["name absolute"]
    assert [found[what] for what in ("raw dot-dot", "raw link", "raw fifo", "raw garbage")] == \
        ["InvalidRequestError"] * 4
    entry = conn.root.job(states[-1]).artifacts()
    assert all("secret" not in artifact["name"] and "escape" not in artifact["name"] for artifact in entry["files"])
    assert not list(Path(lock_dir).rglob("escape")) and not list(Path(lock_dir).rglob("x"))

    gate = tmp_path / "gate"
    job = conn.root.submit(train, {"gate": str(gate)})
    wait_until(lambda: len(job.artifacts()["files"]) == 2, 30, "the saves")
    socket_name = wait_until(lambda: _save_socket(job.id), 10, "the job's save socket")
    probe = subprocess.run([sys.executable, "-c", _PROBE, socket_name], capture_output=True, text=True, timeout=30)
    assert probe.stdout.strip() == "NotAllowedError", probe.stderr
    gate.touch()
    job.wait(30)
    with pytest.raises(RuntimeError, match="rpycdl job"):
        rpycdl.save_artifact(outside)  # not in a job


_PROBE = """
import json, socket, sys
from rpycdl.artifacts.saving import address
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as channel:
    channel.connect(address(sys.argv[1]))
    channel.sendall(json.dumps({"name": "ckpt.pt"}).encode())
    print(json.loads(channel.recv(65536))["type"])
"""
"""Another process of the same user, not of the job, asking the job's owner to save."""


def _save_socket(job_id: str) -> str | None:
    """The job's save socket as the kernel lists it (abstract sockets are in /proc/net/unix)."""
    with open("/proc/net/unix") as listing:
        for line in listing:
            if f"@rpycdl-save-{job_id}-" in line:
                return line.split()[-1]
    return None


def test_a_store_that_fails_tells_the_job_and_keeps_the_file(server, connect, lock_dir, tmp_path):
    blocked = tmp_path / "store"
    blocked.write_text("a file where the store's directory should be")
    port = server("pytorch", "fake:2", "--artifacts", str(blocked))
    conn = connect(port)

    def save_anyway(_: Any) -> str:
        import os

        import rpycdl

        with open(os.path.join(rpycdl.output_dir(), "ckpt.pt"), "w") as ckpt:
            ckpt.write("epoch 1")
        try:
            rpycdl.save_artifact(os.path.join(rpycdl.output_dir(), "ckpt.pt"))
        except rpycdl.ArtifactStoreError as exc:
            return str(exc)
        return "saved"

    job = conn.root.submit(save_anyway, None)
    told = job.result(timeout=30)
    assert str(blocked) in told and "stays in the job's output directory" in told
    entry = wait_until(lambda: (entry := job.artifacts())["state"] == "failed" and entry, 20, "the last upload")
    assert entry["files"] == [] and "--retry" in entry["error"]
    blocked.unlink()
    assert job.artifacts(retry=True)["files"] == [{"name": "ckpt.pt", "size": 7}]
    assert (blocked / job.info["user"] / job.id / "ckpt.pt").read_text() == "epoch 1"
