"""Who sent each job: the client certificate's user (verified) or the declared OS user
(unverified); a user cancels only their own jobs, an admin any; credentials come from flags,
else the environment, else the credentials file."""

from __future__ import annotations

import getpass
import json

import pytest
from helpers import Background, gate_job, open_gate

import rpycdl
from rpycdl import cli
from rpycdl.client import credentials


def test_only_the_owner_or_an_admin_cancels_a_job(tls_server, team, tmp_path, capsys):
    gate = str(tmp_path / "gate")
    first = Background(tls_server("alice"), gate_job(gate), "A")
    second = Background(tls_server("alice"), gate_job(gate), "B")
    first.wait_state("running")
    second.wait_state("running")
    bob = tls_server("bob")
    with pytest.raises(rpycdl.NotAllowedError, match=f"job {first.job_id} belongs to alice and you are bob"):
        bob.root.cancel(first.job_id)
    assert json.loads(bob._conn.root.identify("alice"))["user"] == "bob"  # a certificate's user stays
    with pytest.raises(rpycdl.NotAllowedError):
        bob.root.cancel(first.job_id)
    flags = ["--host", "127.0.0.1", "--port", str(tls_server.port)]
    bob_flags = [f"--{key.replace('_', '-')}={value}" for key, value in team.user("bob").items()]
    assert cli.main(["cancel", first.job_id, *flags, *bob_flags]) == 1
    assert ("only its owner or an admin can read its log, result and artifacts, cancel or delete it"
            in capsys.readouterr().err)

    assert cli.main(["status", *flags, *bob_flags]) == 0
    assert f"job {first.job_id} of alice on pytorch since" in capsys.readouterr().out  # not where she is
    assert tls_server("alice").root.cancel(second.job_id) == "RUNNING"
    assert tls_server("root").root.cancel(first.job_id) == "RUNNING"  # an admin
    for job in (first, second):
        job.join()
        assert isinstance(job.error, rpycdl.JobCancelledError), repr(job.error)
    assert not bob.closed and bob.root.run_code(lambda x: x, "bob's") == "bob's"

    assert cli.main(["jobs", *flags, *bob_flags]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert " alice " in lines[first.job_id] and " bob " in lines[bob.root.jobs()[0]["job_id"]]


def test_without_certificates_the_declared_user_is_recorded_unverified(server, connect, tmp_path):
    port = server("pytorch", "fake:1")
    mine = connect(port)
    me = getpass.getuser()
    assert mine.identity == {"user": me, "verified": False, "admin": False, "label": f"{me} (unverified)"}
    gate = str(tmp_path / "gate")
    job = Background(mine, gate_job(gate), 1)
    job.wait_state("running")
    other = connect(port)
    other._conn.root.identify("someone-else")
    with pytest.raises(rpycdl.NotAllowedError, match=f"belongs to {me} \\(unverified\\)"):
        other.root.cancel(job.job_id)
    with pytest.raises(rpycdl.InvalidRequestError, match="no job"):
        other.root.cancel("0123456789ab")
    open_gate(gate)
    assert job.result() == 1
    (record,) = mine.root.jobs()
    assert (record["user"], record["user_verified"]) == (me, False)


def test_credentials_come_from_flags_then_environment_then_the_file(tmp_path, monkeypatch):
    config = tmp_path / "rpycdl" / "credentials.toml"
    config.parent.mkdir()
    config.write_text('secret_file = "from-file"\ntls_ca = "/etc/team/ca.crt"\nregistry = "10.9.8.7:1234"\n')
    monkeypatch.setenv("RPYCDL_CONFIG", str(config))
    monkeypatch.setenv("RPYCDL_SECRET_FILE", "/env/secret")
    monkeypatch.delenv("RPYCDL_REGISTRY", raising=False)
    assert credentials.resolve(secret_file="/flag/secret").secret_file == "/flag/secret"
    settings = credentials.resolve()
    assert settings.secret_file == "/env/secret" and settings.tls_ca == "/etc/team/ca.crt"
    assert settings.registry == "10.9.8.7:1234" and settings.tls_cert is None
    monkeypatch.delenv("RPYCDL_SECRET_FILE")
    assert credentials.resolve().secret_file == str(config.parent / "from-file")  # relative to the file
    config.write_text('tls_cert = "a"\ncolour = "blue"\n')
    with pytest.raises(rpycdl.InvalidRequestError, match="unknown setting.*colour"):
        credentials.resolve()
    config.write_text("tls_cert = [1, 2]\n")
    with pytest.raises(rpycdl.InvalidRequestError, match="must be a non-empty string"):
        credentials.resolve()
    config.write_text("tls_cert = \n")
    with pytest.raises(rpycdl.InvalidRequestError, match="cannot read the credentials file"):
        credentials.resolve()


def test_tls_settings_must_come_together(team):
    with pytest.raises(rpycdl.InvalidRequestError, match="missing: key"):
        rpycdl.connect(host="127.0.0.1", port=1, tls_cert=team.user("alice")["tls_cert"],
                       tls_ca=team.user("alice")["tls_ca"])
