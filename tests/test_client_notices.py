"""Issue 29 without a notebook: the waiting line is there where a person looks and nowhere in batch use; a
queue timeout names who held the GPUs; a partial line reaches the client before its newline; a connection
closed by an interrupt is opened again by the next call, and a session on it says it ended. Real servers and
clients."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers import Background, cli_env, gate_job, open_gate

import rpycdl

CLIENT = """
import sys
import rpycdl

conn = rpycdl.connect(host="127.0.0.1", port=int(sys.argv[1]), quiet={quiet})
print(conn.root.run_code(lambda x: x + 1, 1), flush=True)
"""


def _waiting_client(port: int, quiet: str, **env: str) -> subprocess.Popen[str]:
    """A script whose call waits for the GPU, its stderr a pipe (batch use)."""
    return subprocess.Popen([sys.executable, "-c", CLIENT.format(quiet=quiet), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(**env))


@pytest.fixture
def held(server, connect, tmp_path):
    """A fake:1 server whose GPU a job holds until the gate opens: (port, holder, gate)."""
    port = server("pytorch", "fake:1")
    gate = str(tmp_path / "gate")
    holder = Background(connect(port), gate_job(gate), None)
    holder.wait_state("running")
    yield port, holder, gate
    open_gate(gate)


def _waited(conn: rpycdl.Connection, count: int) -> None:
    deadline = time.monotonic() + 20
    while len(conn.root.gpu_status()["queue"]) < count:
        assert time.monotonic() < deadline, "the clients never queued"
        time.sleep(0.05)


def test_batch_use_says_nothing_unless_asked(held, connect):
    port, holder, gate = held
    clients = {"batch": _waiting_client(port, "None"), "asked": _waiting_client(port, "False"),
               "quiet by environment": _waiting_client(port, "None", RPYCDL_QUIET="1")}
    _waited(connect(port), len(clients))
    open_gate(gate)
    said = {name: client.communicate(timeout=60) for name, client in clients.items()}
    assert all(out == "2\n" for out, _ in said.values()), said
    assert "waiting for" not in said["batch"][1] and "waiting for" not in said["quiet by environment"][1], said
    assert f"GPU 0 held by job {holder.job_id} of " in said["asked"][1], said["asked"][1]
    assert "running on GPU 0 after" in said["asked"][1], said["asked"][1]


def test_a_queue_timeout_names_who_held_the_gpus(held, connect):
    port, holder, _ = held
    with pytest.raises(rpycdl.QueueTimeoutError, match=f"GPU 0 held by job {holder.job_id} of "):
        connect(port).root.run_code(lambda x: x, 1, queue_timeout=0.5)


def test_a_partial_line_comes_before_its_newline(server, connect):
    def partial(seconds):
        import time

        print("loading...", end="")
        time.sleep(seconds)
        print("done")

    arrivals: list[tuple[float, str]] = []

    class Recorder:
        def write(self, text: str) -> None:
            arrivals.append((time.monotonic(), text))

        def flush(self) -> None:
            pass

    connect(server("pytorch", "fake:1")).root.run_code(partial, 2, stdout=Recorder())
    assert "".join(text for _, text in arrivals) == "loading...done\n"
    assert arrivals[0][1] == "loading..." and arrivals[-1][0] - arrivals[0][0] > 1.0, arrivals


def test_an_interrupted_connection_is_opened_again_and_a_session_on_it_says_it_ended(server, connect):
    conn = connect(server("pytorch", "fake:1"))
    session = conn.root.session().open()
    conn.interrupt()  # what Ctrl-C of a call on it does
    with pytest.raises(rpycdl.ConnectionLostError, match=r"closed \(interrupted\) while calling session_call; "
                                                           "the session ended"):
        session.run(lambda x: x, 1)
    assert conn.root.run_code(lambda x: x * 2, 21) == 42  # the same conn, opened again
    session.close()
