"""rpycdl.artifacts.store against real stores: a local directory, and S3 served by moto in server mode
(a real HTTP endpoint, through s3fs): upload, list and read back every byte, multipart for a large
file, a forked process, the store's failures in words with nothing lost, hostile names refused with
nothing written."""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from s3 import CREDENTIALS, free_port, iam_checks, moto_server

from rpycdl.artifacts.store import COPY_CHUNK, MULTIPART_THRESHOLD, UPLOADING, Artifact, ArtifactStore
from rpycdl.errors import ArtifactStoreError, InvalidRequestError

KEYS = {"key": "testing", "secret": "testing", "region": "us-east-1"}
"""Credentials as from_url's arguments (moto takes any)."""


def s3_client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """moto's S3 server for the module, with a bucket "artifacts"."""
    with moto_server() as url:
        s3_client(url).create_bucket(Bucket="artifacts")
        yield url


@pytest.fixture
def aws_env(endpoint, tmp_path, monkeypatch) -> str:
    """The AWS variables a server would have, and no one's ~/.aws; returns the endpoint."""
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return endpoint


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> ArtifactStore:
    """A store of each kind, empty: a local directory, or a prefix of moto's bucket (endpoint and
    credentials from the environment, as boto reads them)."""
    if request.param == "local":
        return ArtifactStore.from_url(f"file://{tmp_path}/store")
    request.getfixturevalue("aws_env")
    return ArtifactStore.from_url(f"s3://artifacts/{tmp_path.name}")


def outputs(root: Path) -> Path:
    """A job's output directory: nested directories, an empty file, a name with spaces, a file of more than
    one COPY_CHUNK, and links and a FIFO to skip."""
    (root / "ckpt" / "deep").mkdir(parents=True)
    (root / "model.pt").write_bytes(os.urandom(COPY_CHUNK + 5))
    (root / "ckpt" / "epoch 1.pt").write_bytes(b"one")
    (root / "ckpt" / "deep" / "x.bin").write_bytes(os.urandom(1000))
    (root / "empty").write_bytes(b"")
    (root / "link").symlink_to(root / "model.pt")
    (root / "linked dir").symlink_to(root / "ckpt", target_is_directory=True)
    (root / "outside").symlink_to("/etc/hostname")
    os.mkfifo(root / "fifo")
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` and what it holds (a link's target, a file's hash)."""
    return {str(path.relative_to(root)): os.readlink(path) if path.is_symlink() else
            hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-" for path in root.rglob("*")}


def read_all(store: ArtifactStore, user: str, job: str, name: str, chunk: int) -> bytes:
    data = bytearray()
    while piece := store.read(user, job, name, len(data), chunk):
        assert len(piece) <= chunk
        data += piece
    return bytes(data)


def test_upload_list_and_read_back(store, tmp_path):
    store.check()
    source = outputs(tmp_path / "out")
    before = snapshot(source)
    progress: list[int] = []
    uploaded = store.upload("alice", "job1", source, on_progress=progress.append)
    expected = [Artifact("ckpt/deep/x.bin", 1000), Artifact("ckpt/epoch 1.pt", 3), Artifact("empty", 0),
                Artifact("model.pt", COPY_CHUNK + 5)]
    assert uploaded == expected == store.list("alice", "job1")
    assert sum(progress) == COPY_CHUNK + 1008 and len(progress) >= 4
    for artifact in expected:
        for chunk in (7, 1024**2) if artifact.size < 10_000 else (1024**2,):
            assert read_all(store, "alice", "job1", artifact.name, chunk) == (source / artifact.name).read_bytes()
    assert store.read("alice", "job1", "model.pt", COPY_CHUNK, 100) == (source / "model.pt").read_bytes()[-5:]
    assert store.read("alice", "job1", "model.pt", COPY_CHUNK + 5, 10) == b""
    assert store.read("alice", "job1", "empty", 0, 10) == b""
    assert snapshot(source) == before  # the outputs untouched

    newer = tmp_path / "newer"
    (newer / "later").mkdir(parents=True)
    (newer / "later" / "step 2.pt").write_bytes(b"two")
    (newer / "empty").write_bytes(b"newer")
    assert store.upload_file("alice", "job1", newer, "later/step 2.pt") == Artifact("later/step 2.pt", 3)
    assert store.upload_file("alice", "job1", newer, "empty") == Artifact("empty", 5)  # replaced
    assert [(a.name, a.size) for a in store.list("alice", "job1")] == [
        ("ckpt/deep/x.bin", 1000), ("ckpt/epoch 1.pt", 3), ("empty", 5), ("later/step 2.pt", 3),
        ("model.pt", COPY_CHUNK + 5)]
    assert store.read("alice", "job1", "empty", 1, 100) == b"ewer"

    store.upload_file("alice", "job10", newer, "empty")  # a job whose id starts alike
    assert store.list("alice", "job10") == [Artifact("empty", 5)] and len(store.list("alice", "job1")) == 5
    assert store.list("alice", "nothing") == [] and store.list("bob", "job1") == []
    for name in ("missing.pt", "ckpt", "ckpt/deep", "empty/x"):
        with pytest.raises(InvalidRequestError, match="no artifact"):
            store.read("alice", "job1", name, 0, 10)
    with pytest.raises(InvalidRequestError, match="offset"):
        store.read("alice", "job1", "empty", -1, 10)


def test_only_regular_files_are_uploaded_by_name(store, tmp_path):
    source = outputs(tmp_path / "out")
    for name in ("link", "linked dir", "fifo", "ckpt", "no such file", "linked dir/epoch 1.pt"):
        with pytest.raises(InvalidRequestError, match=f"no regular file {name!r}"):
            store.upload_file("alice", "job1", source, name)
    with pytest.raises(InvalidRequestError, match="no regular file"):  # the directory itself a link
        store.upload_file("alice", "job1", source / "linked dir", "epoch 1.pt")
    for path in ("linked dir", "model.pt", "no such dir"):
        with pytest.raises(InvalidRequestError, match="no directory"):
            store.upload("alice", "job1", source / path)
    assert store.list("alice", "job1") == []
    assert store.upload("alice", "job1", tmp_path / "out" / "ckpt" / "deep") == [Artifact("x.bin", 1000)]


def test_unchanged_files_are_skipped_and_a_file_changing_is_not_put_in_place(store, tmp_path):
    source = outputs(tmp_path / "out")
    first = {artifact.name: artifact.source for artifact in store.upload("alice", "job1", source)}
    assert store.upload("alice", "job1", source, skip=first) == []  # nothing changed since
    (source / "empty").write_bytes(b"now")
    assert store.upload("alice", "job1", source, skip=first) == [Artifact("empty", 3)]

    def grow(_: int) -> None:  # the job writes on while its file goes up
        with open(source / "model.pt", "ab") as model:
            model.write(b"more")

    with pytest.raises(ArtifactStoreError, match="model.pt changed while it was uploaded"):
        store.upload("alice", "job1", source, on_progress=grow)
    assert store.read("alice", "job1", "model.pt", COPY_CHUNK, 100) == (source / "model.pt").read_bytes()[
        COPY_CHUNK:COPY_CHUNK + 5]  # the version before stays, whole
    if store.url.startswith("file://"):
        assert list((Path(store.url.removeprefix("file://")) / UPLOADING).iterdir()) == []


def test_a_local_store_takes_files_by_renaming_them(store, tmp_path):
    source = outputs(tmp_path / "out")
    os.link(source / "ckpt" / "epoch 1.pt", tmp_path / "elsewhere")  # another name links to this one
    content = (source / "model.pt").read_bytes()
    progress: list[int] = []
    uploaded = store.upload("alice", "job1", source, progress.append, move=True)
    assert [artifact.name for artifact in uploaded] == ["ckpt/deep/x.bin", "ckpt/epoch 1.pt", "empty", "model.pt"]
    assert read_all(store, "alice", "job1", "model.pt", 1024**2) == content and sum(progress) == COPY_CHUNK + 1008
    local = store.url.startswith("file://")
    assert (source / "model.pt").exists() is not local  # moved into a local store, copied to S3
    assert (source / "ckpt" / "epoch 1.pt").read_bytes() == b"one"  # linked elsewhere: copied
    assert (source / "link").is_symlink() and (source / "fifo").exists()  # never taken


def test_a_local_store_lays_out_whole_files(tmp_path):
    root = tmp_path / "artifacts"
    store = ArtifactStore.from_url(str(root) + "/")  # a plain directory, as the embedded default
    source = outputs(tmp_path / "out")
    store.upload("alice", "job1", source)
    assert (root / "alice" / "job1" / "ckpt" / "epoch 1.pt").read_bytes() == b"one"
    assert sorted(p.name for p in (root / "alice" / "job1").iterdir()) == ["ckpt", "empty", "model.pt"]
    assert list((root / UPLOADING).iterdir()) == []  # each file written there first, then moved in whole
    assert store.url == str(root) + "/"


def test_a_large_file_goes_up_in_parts(endpoint, tmp_path):
    store = ArtifactStore.from_url("s3://artifacts/multipart", endpoint_url=endpoint, **KEYS)
    (tmp_path / "out").mkdir()
    big = tmp_path / "out" / "big.bin"
    big.write_bytes(os.urandom(MULTIPART_THRESHOLD + 1))
    progress: list[int] = []
    assert store.upload("alice", "job2", tmp_path / "out", progress.append) == [Artifact("big.bin", big.stat().st_size)]
    assert sum(progress) == big.stat().st_size
    head = s3_client(endpoint).head_object(Bucket="artifacts", Key="multipart/alice/job2/big.bin")
    assert head["ETag"].strip('"').endswith("-2")  # two parts: MULTIPART_THRESHOLD bytes, and one
    data = read_all(store, "alice", "job2", "big.bin", 16 * 1024**2)
    assert hashlib.sha256(data).digest() == hashlib.sha256(big.read_bytes()).digest()


def test_a_forked_process_uses_the_store_too(store, tmp_path):
    for name in ("before-fork", "from-child"):
        (tmp_path / name).write_bytes(b"x")
    store.upload_file("alice", "job1", tmp_path, "before-fork")  # the parent's filesystem object made
    pid = os.fork()
    if pid == 0:  # the child: a server's connection process
        try:
            store.upload_file("alice", "job1", tmp_path, "from-child")
            os._exit(0 if len(store.list("alice", "job1")) == 2 else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 30
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if ended[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert ended[0] == pid and os.waitstatus_to_exitcode(ended[1]) == 0
    assert [artifact.name for artifact in store.list("alice", "job1")] == ["before-fork", "from-child"]


def test_endpoint_down(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries off (s3fs still retries): a shorter test
    down = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    store = ArtifactStore.from_url("s3://artifacts", endpoint_url=down, **KEYS)
    assert time.monotonic() - started < 1  # nothing contacted yet
    source = outputs(tmp_path / "out")
    before = snapshot(source)
    for attempt in (store.check, lambda: store.upload("alice", "job3", source), lambda: store.list("alice", "job3")):
        with pytest.raises(ArtifactStoreError, match=f"no answer from {down} "):
            attempt()
    assert snapshot(source) == before


def test_missing_bucket(aws_env, tmp_path):
    store = ArtifactStore.from_url("s3://no-such-bucket/prefix")
    source = outputs(tmp_path / "out")
    attempts = (store.check, lambda: store.upload("alice", "job3", source), lambda: store.list("alice", "job3"),
                lambda: store.read("alice", "job3", "model.pt", 0, 10))
    for attempt in attempts:
        with pytest.raises(ArtifactStoreError, match="the bucket 'no-such-bucket' does not exist"):
            attempt()
    assert (source / "model.pt").stat().st_size == COPY_CHUNK + 5


def test_refused_credentials(aws_env, tmp_path):
    store = ArtifactStore.from_url("s3://artifacts")
    source = outputs(tmp_path / "out")
    before = snapshot(source)
    with iam_checks(aws_env):
        for attempt in (store.check, lambda: store.upload("alice", "job3", source)):
            with pytest.raises(ArtifactStoreError, match="refused the credentials"):
                attempt()
    assert snapshot(source) == before
    store.check()  # the same store, once the credentials are taken again


def test_unwritable_local_directory(tmp_path):
    source = outputs(tmp_path / "out")
    before = snapshot(source)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    stores = [ArtifactStore.from_url(str(blocked / "store"))]
    if os.geteuid() != 0:  # root writes in any directory
        (tmp_path / "read-only").mkdir(mode=0o500)
        stores.append(ArtifactStore.from_url(str(tmp_path / "read-only")))
    for store in stores:
        for attempt in (store.check, lambda: store.upload("alice", "job3", source)):  # noqa: B023
            with pytest.raises(ArtifactStoreError, match=re.escape(f"artifact store {store.url}: ")):
                attempt()
    assert snapshot(source) == before and blocked.read_text() == "not a directory"


def test_bad_urls():
    for url in ("relative/dir", "ftp://host/x", "file://relative", "s3://", "s3:///x", "s3://bad bucket/x"):
        with pytest.raises(InvalidRequestError, match="artifact store"):
            ArtifactStore.from_url(url)


HOSTILE = ["../x", "a/../../x", "/abs", "a\nb", "", ".", "..", None, 5]
"""Hostile as a user, a job id or a name."""

CASES = [(position, value) for position in ("user", "job_id") for value in HOSTILE + ["a/b", "a b", UPLOADING]] + \
    [("name", value) for value in HOSTILE + ["a//b", "a\\b", "a\rb", "a\0b", "x/", "./x", "a/./b"]]


@pytest.mark.parametrize("position, value", CASES, ids=[f"{p}={v!r}" for p, v in CASES])
def test_hostile_names_are_refused_and_write_nothing(tmp_path, position, value):
    local = ArtifactStore.from_url(str(tmp_path / "store"))
    # a store whose endpoint is down: the names are refused before anything is contacted
    s3 = ArtifactStore.from_url("s3://artifacts", endpoint_url=f"http://127.0.0.1:{free_port()}", **KEYS)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("x")
    args = {"user": "alice", "job_id": "job", "name": "x", position: value}
    before = sorted(tmp_path.rglob("*"))
    for store in (local, s3):
        calls = [lambda: store.upload_file(args["user"], args["job_id"], tmp_path / "out", args["name"]),  # noqa: B023
                 lambda: store.read(args["user"], args["job_id"], args["name"], 0, 1)]  # noqa: B023
        if position != "name":
            calls += [lambda: store.upload(args["user"], args["job_id"], tmp_path / "out"),  # noqa: B023
                      lambda: store.list(args["user"], args["job_id"])]  # noqa: B023
        for call in calls:
            with pytest.raises(InvalidRequestError) as refused:
                call()
            assert repr(value) in str(refused.value)
    assert sorted(tmp_path.rglob("*")) == before
