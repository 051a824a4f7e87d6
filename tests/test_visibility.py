"""Others see a job, not its secrets (rpycdl.security.visibility): with real servers, the team's certificates
(alice, bob, and root, an admin) and a real monitor, bob sees that alice's jobs exist (id, owner, state,
GPUs, times) but not their command, name, working directory, client address, error, artifacts or log,
through the API, the CLI, the monitor's JSON and its log; alice and root see all of it. A declared name
(the shared secret) never opens a verified user's job, and a working directory's digest opens nothing
to a user who did not send that content."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import Background, gate_job, open_gate, wait_until

import rpycdl
from rpycdl import JobState, cli
from rpycdl.security.visibility import PUBLIC, REDUCED
from rpycdl.site.local import start
from rpycdl.wire import codec

API_KEY = "--api-key=sk-alice-0123456789"
"""What alice's command line carries, which nobody else may read."""
NAME, ERROR, OUTPUT = "alice-private-run", "alice's private failure", "alice's private output"
SECRET = "a shared secret of the site, long enough"


def failing() -> Any:
    def fail(message: str) -> None:
        raise ValueError(message)

    return fail


def _project(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "data" / "secret.txt").write_text("alice's data\n")
    return root


@pytest.fixture
def alices_jobs(tls_server, tmp_path) -> Iterator[dict[str, Any]]:
    """On the TLS server's two GPUs: alice's running command (with an API key on its command line, a name and a
    working directory), her attached job holding the other GPU, one of hers waiting, and one that failed."""
    alice = tls_server("alice")
    gate = tmp_path / "gate"
    failed = alice.root.submit(failing(), ERROR, ngpus=1)
    assert failed.wait(30).state is JobState.FAILED
    script = f"echo {OUTPUT!r}; until [ -e {str(gate)!r} ]; do sleep 0.05; done"
    running = alice.root.submit_command(["sh", "-c", script, "train", API_KEY], ngpus=1, name=NAME,
                                        working_dir=_project(tmp_path / "project"))
    wait_until(lambda: running.status().state is JobState.RUNNING, 30, "alice's command to run")
    attached = Background(tls_server("alice"), gate_job(str(gate)), "attached", ngpus=1)
    attached.wait_state("running")
    wait_until(lambda: attached.job_id in {row["job_id"] for row in alice.root.jobs()}, 30, "its row")
    waiting = alice.root.submit_command(["echo", API_KEY], ngpus=1, name="alice-next")
    wait_until(lambda: waiting.status().queued == 0 and waiting.status().state is JobState.PENDING, 30, "a waiter")
    yield {"failed": failed, "running": running, "attached": attached, "waiting": waiting, "gate": gate,
           "digest": running.info["request"]["working_dir"]}
    open_gate(str(gate))
    attached.join()
    waiting.wait(30)


def _log(job: rpycdl.Job) -> str:
    return "".join(job.logs())


def _hidden(rows: Any) -> None:
    """Nothing of alice's that is hers alone is in `rows` (any JSON)."""
    text = json.dumps(rows, default=str)  # the client's rows have datetimes
    for secret in (API_KEY, NAME[:15], ERROR, "alice-next", '"client"', "from 127.0.0.1", "working_dir"):
        assert secret not in text, (secret, text[:3000])


def _reduced(row: dict[str, Any]) -> None:
    assert row[REDUCED] is True and set(row) <= PUBLIC | {REDUCED, "queued"}, row  # queued: the client's, of ahead
    assert row["user"] == "alice" and row["job_id"] and row["state"] and row["submitted"], row


def test_others_see_that_a_job_exists_not_its_command_name_client_error_or_log(tls_server, team, alices_jobs,
                                                                               capsys):
    bob, alice, root = tls_server("bob"), tls_server("alice"), tls_server("root")
    jobs = {name: alices_jobs[name] for name in ("failed", "running", "waiting")}
    ids = {job.id for job in jobs.values()} | {alices_jobs["attached"].job_id}

    seen = [row for row in bob.root.jobs(all=True) if row["job_id"] in ids]
    assert len(seen) == 4
    for row in seen:
        _reduced(row)
    _hidden(seen)
    for job in jobs.values():
        for row in (bob.root.job(job.id).info, rpycdl.job(job.id, host="127.0.0.1", port=tls_server.port,
                                                            **team.user("bob")).info):
            _reduced(row)
            _hidden(row)
    running = bob.root.job(jobs["running"].id)
    assert running.status().state is JobState.RUNNING and running.info["gpus"] == 1  # through job_wait too
    assert jobs["waiting"].id in {row["job_id"] for row in [bob.root.job(jobs["waiting"].id).info]}
    ended = bob.root.job(jobs["failed"].id).wait(1)
    assert ended.state is JobState.FAILED and ended.error == ""
    for read in (lambda: list(running.logs()), lambda: running.result(wait=False), running.artifacts, running.cancel):
        with pytest.raises(rpycdl.NotAllowedError, match="belongs to alice and you are bob"):
            read()

    status = bob.root.gpu_status()
    holders = [holder for gpu in status["gpus"] for holder in gpu["holders"]]
    assert {holder["job_id"] for holder in holders} == {jobs["running"].id, alices_jobs["attached"].job_id}
    assert [waiter["job_id"] for waiter in status["queue"]] == [jobs["waiting"].id]
    for entry in (*holders, *status["queue"]):
        assert entry[REDUCED] is True and entry["user"] == "alice" and entry["since"]
    _hidden(status["gpus"])
    _hidden(status["queue"])

    for owner in (alice, root):  # her own, and an admin: all of it
        rows = {row["job_id"]: row for row in owner.root.jobs(all=True)}
        assert API_KEY in rows[jobs["running"].id]["request"]["command"] and rows[jobs["running"].id]["name"] == NAME
        assert rows[jobs["running"].id]["request"]["working_dir"] == alices_jobs["digest"]
        assert ERROR in rows[jobs["failed"].id]["error"] and rows[jobs["running"].id]["client"].startswith("127.0.0.1:")
        assert REDUCED not in rows[jobs["running"].id]
        assert all(holder["client"].startswith("127.0.0.1:") for gpu in owner.root.gpu_status()["gpus"]
                   for holder in gpu["holders"])
    assert _log(root.root.job(jobs["running"].id)) == f"{OUTPUT}\n"

    flags = ["--host", "127.0.0.1", "--port", str(tls_server.port)]

    def command(user: str, *argv: str) -> str:
        as_user = [f"--{key.replace('_', '-')}={value}" for key, value in team.user(user).items()]
        assert cli.main([*argv, *flags, *as_user]) == 0
        return capsys.readouterr().out

    table = command("bob", "jobs", "--all")
    lines = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert ids <= set(lines) and all(" alice " in lines[job_id] for job_id in ids)
    assert lines[jobs["running"].id].split()[1] == "-"  # its name, hidden
    _hidden(table)
    _hidden(command("bob", "jobs", "--all", "--json"))
    shown = command("bob", "status")
    assert f"job {jobs['running'].id} of alice on pytorch since" in shown
    assert f"job {jobs['waiting'].id} of alice wants 1 GPU, on pytorch, waiting" in shown
    _hidden(shown)
    table = command("root", "jobs", "--all")
    assert ERROR in table and NAME[:15] in table  # the table cuts names to 15 characters
    assert f"job {jobs['running'].id} of alice from 127.0.0.1:" in command("root", "status")
    assert API_KEY in command("alice", "jobs", "--all", "--json")


def test_a_declared_name_does_not_open_a_verified_users_job(tls_server, server, connect, alices_jobs):
    plain = connect(server("pytorch", "fake:2"))  # the same host's jobs, from a server that takes declared names
    assert json.loads(plain._conn.root.identify("alice"))["label"] == "alice (unverified)"
    running = alices_jobs["running"]
    row = plain.root.job(running.id).info
    _reduced(row)
    _hidden([row, *[row for row in plain.root.jobs(all=True) if row["user"] == "alice"]])
    with pytest.raises(rpycdl.InvalidRequestError, match="no job"):
        plain.root.job(NAME)  # her name finds nothing for a declared alice
    for read in (lambda: list(plain.root.job(running.id).logs()), plain.root.job(running.id).cancel):
        with pytest.raises(rpycdl.NotAllowedError, match="belongs to alice and you are alice \\(unverified\\)"):
            read()
    with pytest.raises(rpycdl.InvalidRequestError, match="not a working directory you sent this server"):
        codec.decode_outcome(plain.call("submit_command", ["cat", "data/secret.txt"], 1, None, None, None, None, None,
                                        alices_jobs["digest"]))
    assert not plain.root.has_working_dir(alices_jobs["digest"])
    assert tls_server("alice").root.job(NAME).id == running.id  # her own name, for her


def test_a_working_directory_serves_only_the_users_who_sent_it(tls_server, tmp_path):
    alice, bob = tls_server("alice"), tls_server("bob")
    project = _project(tmp_path / "project")
    mine = alice.root.submit_command(["cat", "data/secret.txt"], ngpus=1, working_dir=project)
    assert mine.wait(30).state is JobState.SUCCEEDED and _log(mine) == "alice's data\n"
    digest = mine.info["request"]["working_dir"]
    assert alice.root.has_working_dir(digest) and not bob.root.has_working_dir(digest)
    submits = [None] * 5  # gpus, gpu_memory, timeout, queue_timeout, name
    runs = [None] * 8  # ngpus, stdout, stderr, timeout, queue_timeout, on_state, gpus, gpu_memory
    for name, *request in (("submit_command", ["cat", "data/secret.txt"], 1, *submits, digest),
                           ("submit", codec.encode_payload(len, "x"), 1, *submits, digest),
                           ("run", codec.encode_payload(len, "x"), *runs, digest)):
        with pytest.raises(rpycdl.InvalidRequestError, match="not a working directory you sent this server"):
            codec.decode_outcome(bob.call(name, *request))
    assert not bob.root.has_working_dir(digest)
    # bob's client remembers that directory as sent (one manifest here for both): asked, the server says not by
    # him, so he sends it once himself, and then has it too
    his = bob.root.submit_command(["cat", "data/secret.txt"], ngpus=1, working_dir=project)
    assert his.wait(30).state is JobState.SUCCEEDED and _log(his) == "alice's data\n"
    assert his.info["request"]["working_dir"] == digest and bob.root.has_working_dir(digest)
    assert alice.root.has_working_dir(digest)


def _get(url: str, context: ssl.SSLContext | None = None, headers: dict[str, str] | None = None
         ) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=20,
                                    context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _basic(user: str, password: str = SECRET) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_the_monitor_shows_a_jobs_details_and_log_only_to_its_owner_and_admins(tls_server, team, cluster, tmp_path,
                                                                              alices_jobs):
    ca = f"{team.dir}/ca.crt"
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    common = ["monitor", "--gpus", "fake:2", "--lock-dir", cluster.lock_dir, "--port", "0"]
    certified = start([*common, "--tls-cert", f"{team.dir}/server-localhost.crt", "--tls-key",
                       f"{team.dir}/server-localhost.key", "--tls-ca", ca], env={"RPYCDL_SECRET_FILE": ""})
    plain = start([*common, "--secret-file", str(secret)])
    try:
        https = "https://127.0.0.1:" + certified.wait_for(r"on https://127\.0\.0\.1:(\d+)/metrics").group(1)
        http = "http://127.0.0.1:" + plain.wait_for(r"on http://127\.0\.0\.1:(\d+)/metrics").group(1)
        running, failed = alices_jobs["running"], alices_jobs["failed"]
        wait_until(lambda: _log(running) == f"{OUTPUT}\n", 30, "her job's first line")

        def as_user(user: str | None) -> ssl.SSLContext:
            context = ssl.create_default_context(cafile=ca)
            if user is not None:
                context.load_cert_chain(f"{team.dir}/user-{user}.crt", f"{team.dir}/user-{user}.key")
            return context

        def host(user: str) -> dict[str, Any]:
            status, body = _get(f"{https}/api/host", as_user(user))
            assert status == 200, body
            return json.loads(body)

        def job(user: str, job_id: str) -> dict[str, Any]:
            status, body = _get(f"{https}/api/jobs/{job_id}", as_user(user))
            assert status == 200, body
            return json.loads(body)

        seen = host("bob")
        assert seen["viewer"] == "bob" and not seen["secret"]
        hers = [row for row in seen["jobs"] if row["user"] == "alice"]
        assert {row["job_id"] for row in hers} >= {running.id, failed.id} and all(row[REDUCED] for row in hers)
        holders = [holder for gpu in seen["gpus"] for holder in gpu["holders"]]
        assert running.id in {holder["job_id"] for holder in holders} and all(h[REDUCED] for h in holders)
        _hidden(seen)
        for job_id in (running.id, failed.id):
            answer = job("bob", job_id)
            assert answer["job"][REDUCED] and answer["logs"] is False and answer["job"]["state"]
            _hidden(answer)
        status, body = _get(f"{https}/api/jobs/{running.id}/log", as_user("bob"))
        assert status == 403 and b"belongs to alice and you are bob" in body and OUTPUT.encode() not in body

        for user in ("alice", "root"):
            rows = {row["job_id"]: row for row in host(user)["jobs"]}
            assert rows[running.id]["name"] == NAME and API_KEY in rows[running.id]["what"]
            assert ERROR in rows[failed.id]["error"]
            answer = job(user, running.id)
            assert answer["logs"] is True and answer["job"]["client"].startswith("127.0.0.1:")
            assert answer["job"]["request"]["working_dir"] == alices_jobs["digest"]
            assert _get(f"{https}/api/jobs/{running.id}/log", as_user(user)) == (200, f"{OUTPUT}\n".encode())
        with pytest.raises(OSError):  # no certificate: not even a connection
            _get(f"{https}/api/host", as_user(None))
        status, body = _get(f"{https}/metrics", as_user("bob"))
        assert status == 200 and running.id.encode() in body
        _hidden(body.decode())

        # a monitor that takes the site's secret: nobody, or a declared name, is not verified alice, nor an admin
        anyone = json.loads(_get(f"{http}/api/host")[1])
        assert anyone["viewer"] is None and anyone["secret"] is True
        assert all(row[REDUCED] for row in anyone["jobs"])
        _hidden(anyone)
        status, body = _get(f"{http}/api/jobs/{running.id}/log")
        assert status == 401 and b"owner" in body
        for user in ("alice", "root"):
            status, body = _get(f"{http}/api/jobs/{running.id}/log", headers=_basic(user))
            assert status == 403 and f"belongs to alice and you are {user} (unverified)".encode() in body
            answer = json.loads(_get(f"{http}/api/jobs/{running.id}", headers=_basic(user))[1])
            assert answer["viewer"] == f"{user} (unverified)" and answer["job"][REDUCED] and not answer["logs"]
            _hidden(answer)
        assert _get(f"{http}/api/host", headers=_basic("alice", "not the secret"))[0] == 403
    finally:
        certified.stop()
        plain.stop()
