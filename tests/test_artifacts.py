"""Jobs' outputs end to end: what a job leaves in rpycdl.output_dir() goes to the artifact store when it
ends (the state directory's by default, S3 through moto in server mode), listed in the ledger, and comes
back with job.download() and `rpycdl download` through the server; an upload that fails keeps the files
on the server, says why, and `--retry` sends them once the store is back; another user reads nothing.
Real registry and servers on loopback; only the GPUs are simulated."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
from helpers import cli_env, rpycdl_cli, wait_until
from s3 import CREDENTIALS, moto_server

import rpycdl
from rpycdl import JobState
from rpycdl.cli.common import EXIT_QUEUE_TIMEOUT
from rpycdl.scheduler import procs


def _make_leaver() -> Callable[[dict[str, Any]], str]:
    """A job that saves a model and a checkpoint in its output directory (made in a function: dill sends
    it by value, as a script's own function)."""

    def leave_outputs(args: dict[str, Any]) -> str:
        import os

        import rpycdl

        out = rpycdl.output_dir()
        os.makedirs(os.path.join(out, "ckpt"), exist_ok=True)
        with open(os.path.join(out, "model.pt"), "wb") as model:
            model.write(args["model"])
        with open(os.path.join(out, "ckpt", "epoch1.pt"), "w") as checkpoint:
            checkpoint.write("epoch 1")
        return out

    return leave_outputs


leave_outputs = _make_leaver()


def uploaded(job: rpycdl.Job) -> dict[str, Any]:
    return wait_until(lambda: (entry := job.artifacts())["state"] in ("uploaded", "failed") and entry, 20,
                      f"job {job.id}'s outputs to be uploaded")


MODEL = bytes(range(256)) * 4096  # 1 MiB


def test_outputs_go_to_the_default_store_and_come_back(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)  # as this OS user, as the command line below
    job = conn.root.submit(leave_outputs, {"model": MODEL}, gpu_memory="4GiB")
    out = job.result(timeout=30)
    entry = uploaded(job)
    assert entry["state"] == "uploaded" and entry["error"] == ""
    assert entry["files"] == [{"name": "ckpt/epoch1.pt", "size": 7}, {"name": "model.pt", "size": len(MODEL)}]
    stored = Path(lock_dir) / "state" / "artifacts" / job.info["user"] / job.id
    assert entry["store"] == str(Path(lock_dir) / "state" / "artifacts")
    assert (stored / "model.pt").read_bytes() == MODEL and not Path(out).exists()  # moved, not copied
    got: list[int] = []
    written = job.download(tmp_path / "dl", on_progress=got.append)
    assert sorted(path.relative_to(tmp_path / "dl").as_posix() for path in written) == ["ckpt/epoch1.pt", "model.pt"]
    assert (tmp_path / "dl" / "model.pt").read_bytes() == MODEL and sum(got) == len(MODEL) + 7

    states: list[str] = []  # an attached job's too, found by its id
    conn.root.run_code(leave_outputs, {"model": b"small"}, on_state=lambda state, info: states.append(info["job_id"]))
    attached = uploaded(conn.root.job(states[-1]))
    assert [artifact["name"] for artifact in attached["files"]] == ["ckpt/epoch1.pt", "model.pt"]

    cli = [sys.executable, "-m", "rpycdl"]
    where = ["--host", "127.0.0.1", "--port", str(port)]
    listed = subprocess.run([*cli, "artifacts", job.id, *where], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert f"job {job.id}: artifacts uploaded to {stored}/" in listed.stdout and "model.pt" in listed.stdout
    fetched = subprocess.run([*cli, "download", job.id, str(tmp_path / "cli"), "--pattern", "*.pt", *where],
                             capture_output=True, text=True, timeout=60)
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "cli" / "model.pt").read_bytes() == MODEL  # ckpt/epoch1.pt matches *.pt too (fnmatch)

    mallory = connect(port)
    mallory.root.identify("mallory")
    with pytest.raises(rpycdl.NotAllowedError):
        mallory.root.job(job.id).artifacts()
    with pytest.raises(rpycdl.NotAllowedError):
        mallory.root.job(job.id).download(tmp_path / "stolen")


def test_a_failed_upload_keeps_the_files_and_a_retry_sends_them(server, connect, lock_dir, tmp_path):
    blocked = tmp_path / "store"
    blocked.write_text("a file where the store's directory should be")
    port = server("pytorch", "fake:2", "--artifacts", str(blocked))
    conn = connect(port)
    job = conn.root.submit(leave_outputs, {"model": MODEL})
    out = Path(job.result(timeout=30))
    entry = uploaded(job)
    assert entry["state"] == "failed" and str(blocked) in entry["error"] and "--retry" in entry["error"]
    assert job.status().state is JobState.SUCCEEDED  # the job did its work: its outputs wait
    assert (out / "model.pt").read_bytes() == MODEL
    with pytest.raises(rpycdl.InvalidRequestError, match="no uploaded artifacts"):
        job.download(tmp_path / "dl")
    failed = subprocess.run([sys.executable, "-m", "rpycdl", "artifacts", job.id, "--host", "127.0.0.1", "--port",
                             str(port)], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and "--retry" in failed.stderr
    blocked.unlink()  # the store is back
    assert job.artifacts(retry=True)["state"] == "uploaded"
    assert (blocked / job.info["user"] / job.id / "model.pt").read_bytes() == MODEL and not out.exists()


def test_outputs_go_to_s3(server, connect, tmp_path, monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)  # the server's, inherited: clients never see them
    with moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="team")
        port = server("pytorch", "fake:2", "--artifacts", "s3://team/runs", "--artifacts-endpoint", endpoint)
        conn = connect(port)
        conn.root.identify("alice")
        job = conn.root.submit(leave_outputs, {"model": MODEL})
        job.wait(30)
        assert uploaded(job)["state"] == "uploaded"
        body = boto3.client("s3", endpoint_url=endpoint).get_object(Bucket="team", Key=f"runs/alice/{job.id}/model.pt")
        assert hashlib.sha256(body["Body"].read()).digest() == hashlib.sha256(MODEL).digest()
        job.download(tmp_path / "dl", pattern="model.pt")
        assert (tmp_path / "dl" / "model.pt").read_bytes() == MODEL and not (tmp_path / "dl" / "ckpt").exists()


def test_an_upload_that_fails_midway_lists_what_went_up(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    gate = tmp_path / "gate"

    def leave_two(gate: str) -> None:
        import os
        import time

        import rpycdl

        out = rpycdl.output_dir()
        os.makedirs(os.path.join(out, "sub"))
        for name in ("a.bin", "sub/b.bin"):
            with open(os.path.join(out, name), "w") as file:
                file.write(name)
        while not os.path.exists(gate):
            time.sleep(0.05)

    job = conn.root.submit(leave_two, str(gate))
    prefix = Path(lock_dir) / "state" / "artifacts" / job.info["user"] / job.id
    prefix.mkdir(parents=True)
    (prefix / "sub").write_text("a file where a directory should be")  # sub/b.bin cannot go up
    gate.touch()
    job.wait(30)
    entry = uploaded(job)
    assert entry["state"] == "failed" and {"name": "a.bin", "size": 5} in entry["files"]  # it is in the store
    assert not (Path(lock_dir) / "state" / "jobs" / job.id / "output" / "a.bin").exists()
    (prefix / "sub").unlink()
    retried = job.artifacts(retry=True)
    assert retried["state"] == "uploaded" and {"name": "sub/b.bin", "size": 9} in retried["files"]
    assert (prefix / "a.bin").read_text() == "a.bin" and (prefix / "sub" / "b.bin").read_text() == "sub/b.bin"


def _make_one_file_leaver() -> Callable[[int], int]:
    """A job that leaves one file, out-N.txt, in its output directory, and returns N."""

    def leave_one(number: int) -> int:
        import os

        import rpycdl

        with open(os.path.join(rpycdl.output_dir(), f"out-{number}.txt"), "w") as out:
            out.write(f"job {number}")
        return number

    return leave_one


leave_one = _make_one_file_leaver()


def test_a_download_straight_after_the_jobs_end_waits_for_its_upload(server, connect, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    errors, downloaded = [], []
    for number in range(20):  # docs/data.md's sequence: wait() (or result()), then download()
        job = conn.root.submit(leave_one, number)
        if number % 2:
            assert job.result(timeout=30) == number
        else:
            assert job.wait(30).state is JobState.SUCCEEDED
        try:
            written = job.download(tmp_path / str(number))
        except rpycdl.RpycdlError as exc:
            errors.append(f"job {job.id}: {exc!r}")
            continue
        downloaded.append([path.read_text() for path in written])
    assert errors == []
    assert downloaded == [[f"job {number}"] for number in range(20)]

    where = ["--host", "127.0.0.1", "--port", str(port)]  # and on the command line: wait, then download
    for number in range(3):
        submitted = rpycdl_cli("submit", "pytorch", "-q", *where, "--", "sh", "-c",
                               f'echo cli {number} > "$RPYCDL_OUTPUT_DIR/out.txt"')
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        waited = rpycdl_cli("wait", job_id, *where)
        assert waited.returncode == 0, waited.stderr
        fetched = rpycdl_cli("download", job_id, str(tmp_path / f"cli-{number}"), *where)
        assert fetched.returncode == 0, fetched.stderr
        assert (tmp_path / f"cli-{number}" / "out.txt").read_text() == f"cli {number}\n"


def _owned_by(lock_dir: str, job_id: str, pid: int, start: int) -> None:
    """Make `pid` (started at `start`) the owner of a finished job's row, in its host's ledger file."""
    with contextlib.closing(sqlite3.connect(Path(lock_dir) / "state" / "ledger.sqlite3")) as db, db:
        db.execute("UPDATE jobs SET owner_pid = ?, owner_start = ? WHERE job_id = ?", (pid, start, job_id))


def test_a_download_waits_while_the_outputs_upload_up_to_its_timeout(server, connect, lock_dir, tmp_path):
    port = server("pytorch", "fake:2")
    conn = connect(port)
    job = conn.root.submit(leave_one, 7)
    assert job.wait(30).state is JobState.SUCCEEDED and uploaded(job)["state"] == "uploaded"
    # As between a job's end and the end of its upload: its owner (this process, here) alive, its output
    # directory there with what it left.
    output = Path(lock_dir) / "state" / "jobs" / job.id / "output"
    output.mkdir()
    (output / "late.txt").write_text("late")
    me = procs.stat(os.getpid())
    assert me is not None
    _owned_by(lock_dir, job.id, os.getpid(), me.start)
    assert job.artifacts()["state"] == "uploading"
    with pytest.raises(rpycdl.UploadTimeoutError, match=rf"job {job.id}'s outputs are still uploading to the artifact "
                                                        r"store after 0\.5 s: try again later") as info:
        job.download(tmp_path / "early", timeout=0.5)
    assert isinstance(info.value, TimeoutError)
    where = ["--host", "127.0.0.1", "--port", str(port)]
    late = rpycdl_cli("download", job.id, str(tmp_path / "late"), "--timeout", "1", *where)
    assert late.returncode == EXIT_QUEUE_TIMEOUT, late.stderr
    said = late.stderr.splitlines()
    assert said[0] == (f"rpycdl download: job {job.id}'s outputs are still uploading to the artifact store: waiting "
                       "for them (up to 1 s)")
    assert said[-1].startswith(f"rpycdl download: job {job.id}'s outputs are still uploading to the artifact store "
                               "after 1 s"), late.stderr

    waiting = subprocess.Popen([sys.executable, "-m", "rpycdl", "download", job.id, str(tmp_path / "cli"), *where],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
    try:
        assert "waiting for them" in waiting.stderr.readline()  # it said so, then waits
        shutil.rmtree(output)  # what the end of an upload does with the directory: it downloads now
        out, err = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
        waiting.wait()
    assert waiting.returncode == 0, err
    assert (tmp_path / "cli" / "out-7.txt").read_text() == "job 7" and "1 file(s)" in out

    output.mkdir()  # an owner that died before uploading: failed, and a retry sends what it left
    (output / "late.txt").write_text("late")
    child = subprocess.Popen(["true"])
    child.wait()
    _owned_by(lock_dir, job.id, child.pid, 1)
    entry = job.artifacts()
    assert entry["state"] == "failed" and f"rpycdl artifacts {job.id} --retry" in entry["error"]
    retried = job.artifacts(retry=True)
    assert retried["state"] == "uploaded" and [f["name"] for f in retried["files"]] == ["late.txt", "out-7.txt"]
