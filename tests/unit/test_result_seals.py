"""Sealed results (rpycdl.security.results): a result file opens only under its own job's key and id, whole and
unchanged; the client's secret is made once, mode 600, and two clients making it at once read the same; a job's
key file is read only as this account wrote it."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpycdl.client.detached import DetachedCalls
from rpycdl.errors import InvalidRequestError, ResultIntegrityError, UnverifiableResultError
from rpycdl.security import results
from rpycdl.wire import codec

JOB_IDS = st.text("0123456789abcdef", min_size=12, max_size=12)
KEYS = st.binary(min_size=results.MAC_SIZE, max_size=results.MAC_SIZE)


@given(KEYS, JOB_IDS, st.binary(max_size=4096))
def test_a_sealed_outcome_opens_whole_under_its_key_and_job(key, job_id, outcome):
    sealed = results.seal(key, job_id, outcome)
    assert sealed[:len(results.MAGIC)] == results.MAGIC and len(sealed) == results.HEADER + len(outcome)
    assert bytes(results.open_sealed(key, job_id, sealed)) == outcome
    assert results.unverified(sealed) == outcome and results.is_sealed(sealed)


@given(KEYS, KEYS, JOB_IDS, JOB_IDS, st.binary(min_size=1, max_size=512), st.data())
def test_any_change_another_key_or_another_job_is_refused(key, other_key, job_id, other_job, outcome, data):
    sealed = results.seal(key, job_id, outcome)
    position = data.draw(st.integers(0, len(sealed) - 1))
    flipped = bytearray(sealed)
    flipped[position] ^= 1 << data.draw(st.integers(0, 7))
    changed = [bytes(flipped), sealed[:-1], sealed + b"\0", sealed[:results.HEADER], outcome]
    if other_key != key:
        changed.append(results.seal(other_key, job_id, outcome))
    if other_job != job_id:
        changed.append(results.seal(key, other_job, outcome))
    for forged in changed:
        with pytest.raises(ResultIntegrityError, match=f"job {job_id}'s result was not written by the job"):
            results.open_sealed(key, job_id, forged)


@given(st.binary(max_size=64))
def test_unsealed_bytes_pass_unverified_as_they_are(data):
    if not data.startswith(results.MAGIC):
        assert results.unverified(data) == data and not results.is_sealed(data)


def test_a_job_key_is_the_clients_secret_and_the_jobs_nonce_and_the_key_id_tells_secrets_apart():
    secret, other = os.urandom(32), os.urandom(32)
    seal = results.new_seal(secret)
    assert seal.key == results.job_key(secret, seal.nonce) != results.job_key(other, seal.nonce)
    assert seal.key_id == results.key_id(secret) != results.key_id(other) and len(seal.key_id) == 16
    assert results.new_seal(secret).nonce != seal.nonce and results.check_seal(seal.sent()) == seal
    assert results.check_seal(None) is None


@pytest.mark.parametrize("sent", [("ab", "cd", b"k"), "text", (1, 2, 3), ("zz" * 16, "00" * 8, bytes(32)),
                                  ("00" * 16, "00" * 8, "k" * 32), ("00" * 16, "00" * 8)])
def test_a_malformed_seal_is_refused(sent):
    with pytest.raises(InvalidRequestError, match="a submit's seal is"):
        results.check_seal(sent)


def test_the_clients_secret_is_made_once_for_it_alone(tmp_path):
    path = tmp_path / "config" / "result-key"
    secret = results.client_secret(path)
    assert len(secret) == results.SECRET_SIZE and results.client_secret(path) == secret
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text() == secret.hex() + "\n" and os.listdir(path.parent) == ["result-key"]


def _make(path: str, start: multiprocessing.synchronize.Event, out: multiprocessing.Queue) -> None:
    start.wait()
    out.put(results.client_secret(Path(path)))


def test_two_clients_making_the_secret_at_once_read_the_same(tmp_path):
    context = multiprocessing.get_context("fork")
    start, out = context.Event(), context.Queue()
    makers = [context.Process(target=_make, args=(str(tmp_path / "result-key"), start, out)) for _ in range(8)]
    for maker in makers:
        maker.start()
    start.set()
    secrets = {out.get(timeout=60) for _ in makers}
    for maker in makers:
        maker.join(60)
    assert secrets == {results.client_secret(tmp_path / "result-key")}
    assert os.listdir(tmp_path) == ["result-key"]  # every maker's file aside is gone


def test_a_secret_file_others_can_read_a_link_or_junk_is_refused(tmp_path):
    path = tmp_path / "result-key"
    results.client_secret(path)
    path.chmod(0o640)
    with pytest.raises(InvalidRequestError, match=r"only you can read and write \(chmod 600"):
        results.client_secret(path)
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(InvalidRequestError, match="a link is not followed"):
        results.client_secret(link)
    path.write_text("not hex\n")
    with pytest.raises(InvalidRequestError, match="does not hold 64 hex digits"):
        results.client_secret(path)


def test_a_jobs_key_is_kept_for_this_account_alone_and_read_only_as_written(tmp_path):
    key = os.urandom(32)
    results.write_job_key(tmp_path, key)
    kept = tmp_path / results.KEY_FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and results.read_job_key(tmp_path, "abc") == key
    with pytest.raises(FileExistsError):  # made new, never over another
        results.write_job_key(tmp_path, key)
    kept.chmod(0o640)
    with pytest.raises(ResultIntegrityError, match="its key file is not the one its submit wrote"):
        results.read_job_key(tmp_path, "abc")
    kept.unlink()
    kept.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ResultIntegrityError, match="job abc's result cannot be sealed: its key is not there"):
        results.read_job_key(tmp_path, "abc")
    results.drop_job_key(tmp_path)
    assert not os.path.lexists(kept)
    results.drop_job_key(tmp_path)  # gone already: nothing to do


def test_a_verified_outcome_decodes_as_the_job_sent_it():
    key, outcome = os.urandom(32), codec.encode_ok({"loss": 0.1})
    assert codec.decode_outcome(results.open_sealed(key, "abc", results.seal(key, "abc", outcome))) == {"loss": 0.1}


class OldServer:
    """A connection to a server from before sealed results, as a client sees it: a submit's seal is one option
    too many, and job_result takes no `sealed`."""

    closed_by_user, session, address = False, None, ("gpu01", 18861)

    def __init__(self, outcome: bytes) -> None:
        self.outcome, self.calls = outcome, []

    def call(self, name: str, *args: object) -> bytes:
        self.calls.append((name, args))
        if name.startswith("submit") and len(args) > 8:
            return codec.encode_error(InvalidRequestError("too many arguments: at most 7 after the fixed ones"), tb="")
        if name == "job_result" and len(args) > 1:
            raise TypeError("exposed_job_result() takes 2 positional arguments but 3 were given")
        if name == "job_result":
            return self.outcome
        return codec.encode_data({"job_id": "0123456789ab", "state": "SUCCEEDED", "server": "gpu01:18861"})


def test_a_server_from_before_seals_takes_the_job_unsealed_and_its_result_reads_only_unverified(monkeypatch, tmp_path):
    monkeypatch.setenv("RPYCDL_RESULT_KEY", str(tmp_path / "result-key"))
    old = OldServer(codec.encode_ok("its value"))
    calls = DetachedCalls()
    calls._connection, calls._check_size, calls._working_dir = old, lambda size: None, lambda path: None
    with pytest.warns(UserWarning, match="gpu01:18861 predates sealed results: job 0123456789ab's result"):
        job = calls.submit_command(["true"])
    assert [len(args) for name, args in old.calls] == [9, 8]  # with its seal, then without
    with pytest.raises(UnverifiableResultError, match="the server at gpu01:18861 predates sealed results"):
        job.result(wait=False)
    assert job.result(wait=False, verify=False) == "its value"
