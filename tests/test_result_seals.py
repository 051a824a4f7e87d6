"""A detached job's result is unpickled only if its job wrote it (issue 34, attack 4: a local user who could
replace alice's job's directory put a forged result there, and her job.result() ran his code). Every result file
is sealed with a key only the job's client and its supervisor hold (rpycdl.security.results); the client checks
the seal before anything is unpickled. Real registry, server, supervisors and clients on loopback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from helpers import TALKER, open_gate, rpycdl_cli, wait_until

import rpycdl
from rpycdl import JobState, ResultIntegrityError, UnverifiableResultError
from rpycdl.client import credentials
from rpycdl.defaults import STATE_SUBDIR
from rpycdl.scheduler.jobfiles import JobFiles
from rpycdl.security import results
from rpycdl.wire import codec


@pytest.fixture
def served(cluster, connect) -> tuple[int, rpycdl.Connection, JobFiles]:
    """A fake:2 server, a connection to it, and its host's job files."""
    port = cluster.add_server("pytorch", "fake:2")[1]
    return port, connect(port), JobFiles(Path(cluster.lock_dir) / STATE_SUBDIR)


class Planted:
    """What bob puts in alice's result: unpickling it creates the file `marker` (his code, run in her client)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (self.marker, "w")


def _replace(path: Path, data: bytes) -> None:
    """Replace the file at `path` as bob did: a file of his, renamed over it."""
    aside = path.with_name("forged")
    aside.write_bytes(data)
    os.replace(aside, path)


def _finished(conn: rpycdl.Connection, directory: Path, value: object) -> rpycdl.Job:
    """A job of `conn`'s that returned `value`, once it has ended."""
    job = conn.root.submit(TALKER, {"dir": str(directory), "value": value})
    job.wait(30)
    assert job.status().state is JobState.SUCCEEDED
    return job


def test_a_detached_jobs_result_is_sealed_with_its_clients_key_and_verifies(served, tmp_path):
    _, conn, files = served
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "value": {"ok": 1}})
    command = conn.root.submit_command(["true"])
    assert job.result(timeout=30) == {"ok": 1} and command.result(timeout=30) == 0
    secret, path = credentials.result_secret()
    assert path == Path(os.environ["RPYCDL_CONFIG"]).parent / "result-key"  # beside the credentials file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for each in (job, command):
        row = each.refresh()
        assert row["result_key_id"] == results.key_id(secret) and len(row["result_nonce"]) == 2 * results.NONCE_SIZE
        assert files.path(each.id, "result").read_bytes().startswith(results.MAGIC)
        assert not files.path(each.id, results.KEY_FILE).exists()  # the job's key goes at its end
    assert job.refresh()["result_nonce"] != command.refresh()["result_nonce"]  # a key of its own per job


def test_a_result_file_replaced_on_the_server_is_refused_and_nothing_of_it_is_unpickled(served, tmp_path):
    port, conn, files = served
    marker = tmp_path / "bobs-code-ran"
    job, other = _finished(conn, tmp_path, "alice's value"), _finished(conn, tmp_path, "her other job's value")
    result = files.path(job.id, "result")
    forgeries = {
        "a plain outcome, as a server before seals wrote them": codec.encode_ok(Planted(str(marker))),
        "one sealed with a key of bob's": results.seal(os.urandom(32), job.id, codec.encode_ok(Planted(str(marker)))),
        "her own other job's sealed result": files.path(other.id, "result").read_bytes(),
    }
    for what, forged in forgeries.items():
        _replace(result, forged)
        with pytest.raises(ResultIntegrityError, match=f"job {job.id}'s result was not written by the job") as info:
            job.result()
        assert type(info.value) is ResultIntegrityError, what
        assert not marker.exists(), f"{what}: unpickled"
    cli = rpycdl_cli("result", job.id, "--host", "127.0.0.1", "--port", str(port))
    assert cli.returncode != 0 and "was not written by the job" in cli.stderr and not marker.exists()
    assert other.result() == "her other job's value"  # the original, where it belongs, still verifies
    _replace(result, forgeries["a plain outcome, as a server before seals wrote them"])
    job.result(verify=False)  # what verify=False does: run bob's code
    assert marker.exists()


def test_a_client_with_another_result_key_is_told_so_and_may_read_it_unverified(served, tmp_path, monkeypatch):
    _, conn, _ = served
    gate = str(tmp_path / "gate")
    job = _finished(conn, tmp_path, [1, 2, 3])
    cancelled = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate})
    cancelled.cancel()
    mine = results.key_id(credentials.result_secret()[0])
    monkeypatch.setenv("RPYCDL_RESULT_KEY", str(tmp_path / "another-machine" / "result-key"))
    with pytest.raises(UnverifiableResultError, match="submitted from another machine or account") as info:
        job.result()
    assert mine in str(info.value) and "verify=False" in str(info.value)
    assert job.result(verify=False) == [1, 2, 3]
    with pytest.raises(rpycdl.JobCancelledError):  # no result: the server's own answer, whatever the key
        cancelled.result()


def test_a_job_without_a_seal_is_read_only_unverified_and_old_clients_get_its_outcome(served, tmp_path):
    _, conn, files = served
    raw = conn.root._connection
    unsealed = rpycdl.Job(codec.decode_outcome(raw.call("submit", codec.encode_payload(TALKER, {
        "dir": str(tmp_path), "value": "unsealed"}))), raw)  # as a client from before seals submits
    unsealed.wait(30)
    assert unsealed.refresh()["result_nonce"] is None
    with pytest.raises(UnverifiableResultError, match=f"job {unsealed.id} has no seal of its result"):
        unsealed.result()
    assert unsealed.result(verify=False) == "unsealed"
    sealed = _finished(conn, tmp_path, "sealed")
    for job, value in ((sealed, "sealed"), (unsealed, "unsealed")):  # a client from before seals: the outcome
        assert codec.decode_outcome(raw.call("job_result", job.id)) == value
    assert files.path(sealed.id, "result").read_bytes().startswith(results.MAGIC)


def test_a_job_whose_key_is_gone_fails_saying_its_result_could_not_be_sealed(served, tmp_path):
    _, conn, files = served
    gate = str(tmp_path / "gate")
    job = conn.root.submit(TALKER, {"dir": str(tmp_path), "gate": gate, "value": 1})
    key = files.path(job.id, results.KEY_FILE)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    key.unlink()
    open_gate(gate)
    status = wait_until(lambda: (found := job.status()).finished and found, 30, f"job {job.id}'s end")
    assert status.state is JobState.FAILED and "result cannot be sealed" in status.error
    assert not files.path(job.id, "result").exists()
