"""rpycdl.artifacts.store against real stores: a local directory, and S3 served by moto in server mode
(a real HTTP endpoint, through s3fs): upload, list and read back every byte, multipart for a large
file, the store's failures in words with nothing lost, hostile names refused with nothing written."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from s3 import CREDENTIALS, moto_server

from rpycdl.artifacts.store import MULTIPART_CHUNK, Artifact, ArtifactStore
from rpycdl.errors import ArtifactStoreError, InvalidRequestError


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in CREDENTIALS.items():
            patch.setenv(name, value)
        with moto_server() as url:
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket="artifacts")
            yield url


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch) -> ArtifactStore:
    if request.param == "local":
        return ArtifactStore.from_url(str(tmp_path / "store"))
    endpoint = request.getfixturevalue("endpoint")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return ArtifactStore.from_url(f"s3://artifacts/{tmp_path.name}", endpoint_url=endpoint)


def outputs(root: Path) -> Path:
    (root / "ckpt").mkdir(parents=True)
    (root / "model.pt").write_bytes(os.urandom(70_000))
    (root / "ckpt" / "epoch 1.pt").write_bytes(b"one")
    (root / "empty").write_bytes(b"")
    (root / "link").symlink_to(root / "model.pt")  # skipped: never followed
    return root


def read_all(store: ArtifactStore, job: str, name: str, chunk: int = 8192) -> bytes:
    data, offset = b"", 0
    while piece := store.read("alice", job, name, offset, chunk):
        data, offset = data + piece, offset + len(piece)
    return data


def test_upload_list_and_read_back(store, tmp_path):
    store.check()
    source = outputs(tmp_path / "out")
    progress: list[int] = []
    uploaded = store.upload("alice", "job1", source, on_progress=progress.append)
    expected = [Artifact("ckpt/epoch 1.pt", 3), Artifact("empty", 0), Artifact("model.pt", 70_000)]
    assert uploaded == expected == store.list("alice", "job1")
    assert sum(progress) == 70_003
    assert read_all(store, "job1", "model.pt") == (source / "model.pt").read_bytes()
    assert read_all(store, "job1", "ckpt/epoch 1.pt") == b"one"
    assert store.upload_file("alice", "job1", source / "empty", "later/step.txt") == Artifact("later/step.txt", 0)
    assert [artifact.name for artifact in store.list("alice", "job1")][-1] == "model.pt"
    assert store.list("alice", "nothing") == [] and store.list("bob", "job1") == []
    with pytest.raises(InvalidRequestError, match="no artifact"):
        store.read("alice", "job1", "missing.pt", 0, 10)
    assert sorted(path.name for path in source.iterdir()) == ["ckpt", "empty", "link", "model.pt"]  # untouched


def test_a_large_file_goes_up_in_parts(endpoint, tmp_path, monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    store = ArtifactStore.from_url("s3://artifacts/multipart", endpoint_url=endpoint)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(2 * MULTIPART_CHUNK + 1))
    store.upload_file("alice", "job2", big, "big.bin")
    head = boto3.client("s3", endpoint_url=endpoint).head_object(Bucket="artifacts",
                                                                 Key="multipart/alice/job2/big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    assert hashlib.sha256(read_all(store, "job2", "big.bin", MULTIPART_CHUNK)).digest() == \
        hashlib.sha256(big.read_bytes()).digest()


def test_failures_say_why_and_lose_nothing(endpoint, tmp_path, monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    source = outputs(tmp_path / "out")
    down = ArtifactStore.from_url("s3://artifacts", endpoint_url="http://127.0.0.1:9")
    for attempt in (down.check, lambda: down.upload("alice", "job3", source)):
        with pytest.raises(ArtifactStoreError, match="127.0.0.1:9"):
            attempt()
    missing = ArtifactStore.from_url("s3://no-such-bucket", endpoint_url=endpoint)
    with pytest.raises(ArtifactStoreError, match="no such bucket"):
        missing.check()
    with pytest.raises(ArtifactStoreError, match="no-such-bucket"):
        missing.upload("alice", "job3", source)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(ArtifactStoreError, match="a-file"):
        ArtifactStore.from_url(str(blocked / "store")).check()
    assert (source / "model.pt").stat().st_size == 70_000  # the outputs stay for a retry
    for url in ("relative/dir", "ftp://host/x", "s3://", "s3://bad bucket/x"):
        with pytest.raises(InvalidRequestError, match="artifact store"):
            ArtifactStore.from_url(url)


@pytest.mark.parametrize("user, job, name", [
    ("..", "job", "x"), ("alice/../bob", "job", "x"), ("", "job", "x"), ("alice", ".", "x"),
    ("alice", "job", "../bob/job/x"), ("alice", "job", "a/../../x"), ("alice", "job", "/abs"),
    ("alice", "job", "a\nb"), ("alice", "job", ""), ("alice", "job", "a//b"), ("alice", "job", "a\\b"),
])
def test_hostile_names_are_refused_and_write_nothing(tmp_path, user, job, name):
    store = ArtifactStore.from_url(str(tmp_path / "store"))
    (tmp_path / "f").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(InvalidRequestError):
        store.upload_file(user, job, tmp_path / "f", name)
    with pytest.raises(InvalidRequestError):
        store.read(user, job, name, 0, 1)
    assert sorted(tmp_path.rglob("*")) == before
