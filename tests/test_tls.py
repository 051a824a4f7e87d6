"""Mutual TLS: `rpycdl certs` makes a team's CA, servers and users prove themselves with its
certificates, wrong certificates are refused with clear errors, and the server keeps serving."""

from __future__ import annotations

import datetime
import os
import socket
import stat

import pytest
from helpers import connection_processes, server_pid, wait_until

import rpycdl
from rpycdl import cli
from rpycdl.security import certs
from rpycdl.site.local import one_account, start


@pytest.fixture
def tls_port(server, team) -> int:
    """A server that requires a client certificate from the team's CA."""
    return server("pytorch", "fake:2", *team.server_args())


def test_certs_writes_keys_readable_only_by_their_owner_and_never_overwrites(team, capsys):
    names = sorted(os.listdir(team.dir))
    assert names == ["ca.crt", "ca.key", "server-localhost.crt", "server-localhost.key", "user-alice.crt",
                     "user-alice.key", "user-bob.crt", "user-bob.key", "user-carol.crt", "user-carol.key",
                     "user-root.crt", "user-root.key"]
    for name in names:
        mode = stat.S_IMODE(os.stat(os.path.join(team.dir, name)).st_mode)
        assert mode == (0o600 if name.endswith(".key") else 0o644), (name, oct(mode))
    assert cli.main(["certs", "user", team.dir, "alice"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert cli.main(["certs", "user", team.dir, "../evil"]) == 2
    assert "bad user name" in capsys.readouterr().err
    assert cli.main(["certs", "server", team.dir, "--name", "gpu01", "--ip", "not-an-ip"]) == 2
    assert "bad IP address" in capsys.readouterr().err


def test_a_user_with_a_certificate_runs_code_and_is_named_by_it(tls_port, team):
    with rpycdl.connect(host="127.0.0.1", port=tls_port, **team.user("alice")) as conn:
        assert conn.identity == {"user": "alice", "verified": True, "admin": False, "label": "alice"}
        assert conn.root.run_code(lambda blob: len(blob), b"x" * (5 << 20)) == 5 << 20  # bulk frames through TLS
        (job,) = conn.root.jobs()
        assert (job["user"], job["user_verified"], job["state"]) == ("alice", True, "SUCCEEDED")


def test_discovery_with_credentials_from_the_config_file(tls_port, team, cluster, tmp_path, monkeypatch):
    config = tmp_path / "credentials.toml"
    config.write_text(f'tls_cert = "{team.dir}/user-bob.crt"\ntls_key = "{team.dir}/user-bob.key"\n'
                      f'tls_ca = "{team.dir}/ca.crt"\nregistry = "{cluster.registry_address}"\n')
    monkeypatch.setenv("RPYCDL_CONFIG", str(config))
    with rpycdl.connect("pytorch") as conn:
        assert conn.address == ("127.0.0.1", tls_port) and conn.identity["user"] == "bob"
        assert conn.root.run_code(lambda x: x + 1, 1) == 2


def test_a_rogue_server_announced_to_the_registry_gets_nothing(server, team, cluster, tmp_path):
    rogue_ca = tmp_path / "rogue-ca"
    certs.create_ca(rogue_ca)
    certs.issue_server(rogue_ca, ["localhost"], ["127.0.0.1"])
    rogue = server("pytorch", "fake:4", "--tls-cert", f"{rogue_ca}/server-localhost.crt",
                   "--tls-key", f"{rogue_ca}/server-localhost.key", "--tls-ca", f"{rogue_ca}/ca.crt")
    with pytest.raises(rpycdl.AuthFailedError, match="failed the certificate check"):
        rpycdl.connect(host="127.0.0.1", port=rogue, **team.user("alice"))
    good = server("pytorch", "fake:1", *team.server_args())  # fewer free GPUs than the rogue offers
    with rpycdl.connect("pytorch", registry_address=cluster.registry_address, **team.user("alice")) as conn:
        assert conn.address[1] == good


def test_a_server_certificate_for_another_host_is_refused(server, team, tmp_path):
    certs.issue_server(team.dir, ["gpu99"])
    try:
        port = server("pytorch", "fake:1", *team.server_args("gpu99"))
        with pytest.raises(rpycdl.AuthFailedError, match="IP address mismatch"):
            rpycdl.connect(host="127.0.0.1", port=port, **team.user("alice"))
    finally:
        for suffix in ("crt", "key"):
            os.unlink(f"{team.dir}/server-gpu99.{suffix}")


def _stranger(tmp_path) -> dict[str, str]:
    """Credentials of someone whose certificate another CA signed, who trusts the team's server."""
    other = tmp_path / "other-ca"
    certs.create_ca(other)
    certs.issue_user(other, "mallory")
    return {"tls_cert": f"{other}/user-mallory.crt", "tls_key": f"{other}/user-mallory.key"}


def _expired(team, tmp_path) -> dict[str, str]:
    issued = certs.issue_user(team.dir, "expired-user", days=1,
                              not_before=datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3))
    moved = {}
    for key, path in (("tls_cert", issued.cert), ("tls_key", issued.key)):
        moved[key] = str(tmp_path / path.name)
        os.rename(path, moved[key])
    return moved


@pytest.mark.parametrize("case", ["untrusted CA", "expired", "no certificate", "shared secret instead"])
def test_wrong_certificates_are_refused_and_the_server_keeps_serving(case, tls_port, team, cluster, tmp_path):
    pid = server_pid(cluster, tls_port)
    if case == "untrusted CA":
        kwargs, error = {**_stranger(tmp_path), "tls_ca": f"{team.dir}/ca.crt"}, "refused our client certificate"
    elif case == "expired":
        kwargs, error = {**_expired(team, tmp_path), "tls_ca": f"{team.dir}/ca.crt"}, "certificate expired"
    elif case == "no certificate":
        kwargs, error = {}, r"requires authentication \(tls\)"
    else:
        secret = tmp_path / "secret"
        secret.write_text("a secret the server does not use")
        secret.chmod(0o600)
        kwargs, error = {"secret_file": str(secret)}, "asks for tls authentication and this client has no tls"
    for _ in range(3):
        with pytest.raises(rpycdl.AuthFailedError, match=error):
            rpycdl.connect(host="127.0.0.1", port=tls_port, **kwargs)
    wait_until(lambda: connection_processes(pid) == [], what="the refused connection processes to exit")
    with rpycdl.connect(host="127.0.0.1", port=tls_port, **team.user("alice")) as conn:
        assert conn.root.run_code(lambda x: x, "still serving") == "still serving"
        assert conn.root.jobs()[0]["user"] == "alice"
        assert conn.root.gpu_status()["queue"] == []


def test_a_client_that_says_nothing_or_speaks_plain_rpyc_blocks_nobody(tls_port, team):
    idle = socket.create_connection(("127.0.0.1", tls_port))
    plain = socket.create_connection(("127.0.0.1", tls_port))
    plain.sendall(b"\x00\x00\x00\x10\x00" + b"not a client hello")
    try:
        with rpycdl.connect(host="127.0.0.1", port=tls_port, **team.user("bob")) as conn:
            assert conn.root.run_code(lambda x: x, 1) == 1
    finally:
        idle.close()
        plain.close()


def test_tls_lets_a_server_listen_beyond_loopback_without_insecure(team, lock_dir):
    process = start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--host", "0.0.0.0", "--port", "0",
                     "--registry", "none", "--lock-dir", lock_dir, *team.server_args(), *one_account()])
    try:
        process.wait_for(r"on 0\.0\.0\.0:\d+ as .*authentication: tls")
        assert "WARNING" not in "\n".join(process.lines)
    finally:
        process.stop()


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "{dir}/server-localhost.crt"], "missing: key, CA certificate"),
    (["--tls-cert", "{dir}/server-localhost.crt", "--tls-key", "{dir}/user-alice.key", "--tls-ca", "{dir}/ca.crt"],
     "cannot use the certificate"),
    (["--tls-cert", "{dir}/nope.crt", "--tls-key", "{dir}/ca.key", "--tls-ca", "{dir}/ca.crt"], "does not exist"),
])
def test_a_server_with_unusable_tls_files_refuses_to_start(team, lock_dir, flags, message):
    process = start(["serve", "--service", "pytorch", "--gpus", "fake:1", "--port", "0", "--registry", "none",
                     "--lock-dir", lock_dir, *[flag.format(dir=team.dir) for flag in flags]])
    assert process.popen.wait(30) == 1  # a start failure
    process.wait_for(message)


def test_a_key_readable_by_others_is_refused(team, tmp_path):
    key = tmp_path / "alice.key"
    key.write_bytes(open(f"{team.dir}/user-alice.key", "rb").read())
    key.chmod(0o644)
    with pytest.raises(rpycdl.InvalidRequestError, match="readable by others"):
        rpycdl.connect(host="127.0.0.1", port=1, **{**team.user("alice"), "tls_key": str(key)})
