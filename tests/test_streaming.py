"""The job's output reaches the client's stdout= and stderr= objects, and it arrives live."""

from __future__ import annotations

import time

from helpers import Background, open_gate, wait_until


class Sink:
    """A file-like object that records what it is given and when."""

    def __init__(self) -> None:
        self.chunks: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.chunks.append((time.monotonic(), text))
        return len(text)

    def flush(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)

    def arrival(self, needle: str) -> float | None:
        """When the text seen so far first contained `needle`."""
        seen = ""
        for when, text in self.chunks:
            seen += text
            if needle in seen:
                return when
        return None


def test_print_and_sys_stderr_reach_the_clients_objects(conn):
    out, err = Sink(), Sink()

    def job(_):
        import sys

        print("hello from print")
        print("second", "line", sep="-")
        sys.stderr.write("a warning on stderr\n")
        print("to stderr by print", file=sys.stderr)
        return "done"

    assert conn.root.run_code(job, None, stdout=out, stderr=err) == "done"
    assert out.text == "hello from print\nsecond-line\n"
    assert err.text == "a warning on stderr\nto stderr by print\n"


def test_output_of_processes_the_job_starts_is_streamed_too(conn):
    out, err = Sink(), Sink()

    def job(_):
        import os
        import subprocess

        subprocess.run(["sh", "-c", "echo child; echo child-err >&2"], check=True)
        os.write(1, b"raw fd 1\n")
        os.write(2, b"raw fd 2\n")
        subprocess.run(["sh", "-c", "(sleep 0.05; echo grandchild) & wait"], check=True)
        return os.getpid()

    conn.root.run_code(job, None, stdout=out, stderr=err)
    assert out.text.splitlines() == ["child", "raw fd 1", "grandchild"]
    assert err.text.splitlines() == ["child-err", "raw fd 2"]


def test_default_output_goes_to_the_clients_sys_stdout_and_stderr(conn, capsys):
    def job(_):
        import subprocess
        import sys

        print("to my stdout")
        subprocess.run(["sh", "-c", "echo to my stderr >&2"], check=True)
        sys.stdout.flush()

    conn.root.run_code(job, None)
    captured = capsys.readouterr()
    assert "to my stdout\n" in captured.out
    assert "to my stderr\n" in captured.err


def test_lots_of_output_arrives_complete_and_in_order_with_multibyte_text(conn):
    out = Sink()

    def job(n):
        for i in range(n):
            print(f"line {i:05d} é✓€")
        print("ü" * 100_000)  # multi-byte characters across pipe reads must not be mangled

    conn.root.run_code(job, 3000, stdout=out)
    lines = out.text.splitlines()
    assert lines[:3000] == [f"line {i:05d} é✓€" for i in range(3000)]
    assert lines[3000:] == ["ü" * 100_000]
    assert "\ufffd" not in out.text


def test_output_arrives_while_the_job_is_still_running(conn, connect, tmp_path):
    out, err = Sink(), Sink()
    gate = str(tmp_path / "gate")

    def job(gate):
        import os
        import sys
        import time

        print("first line, before blocking")
        sys.stderr.write("first error line\n")
        print("a partial line", end="", flush=True)
        while not os.path.exists(gate):
            time.sleep(0.01)
        print(" ... finished")
        return "done"

    running = Background(conn, job, gate, stdout=out, stderr=err)
    wait_until(lambda: "a partial line" in out.text and "first error line" in err.text, 15,
               "the job's first output while it blocks")
    assert not running.done, "the job finished although its gate was never opened"
    gate_opened = time.monotonic()
    open_gate(gate)
    assert running.result() == "done"
    finished = time.monotonic()
    first = out.arrival("first line, before blocking")
    assert first is not None and first < gate_opened < finished
    assert err.arrival("first error line") < gate_opened
    assert out.arrival("a partial line") < gate_opened
    assert out.text == "first line, before blocking\na partial line ... finished\n"
    assert out.arrival(" ... finished") > gate_opened


def test_a_partial_line_arrives_unflushed_while_the_job_blocks(conn, connect, tmp_path):
    """Output without a newline or a flush (a progress line) reaches the client while the job runs on: the job
    process flushes both streams' partial lines from the first write to either on."""
    out, err = Sink(), Sink()
    gate = str(tmp_path / "gate")

    def job(gate):
        import os
        import sys
        import time

        print("loading...", end="")
        sys.stderr.write("warming up")
        while not os.path.exists(gate):
            time.sleep(0.01)
        print(" done")
        return "done"

    running = Background(conn, job, gate, stdout=out, stderr=err)
    wait_until(lambda: "loading..." in out.text and "warming up" in err.text, 15, "the job's partial lines")
    assert not running.done, "the job finished although its gate was never opened"
    open_gate(gate)
    assert running.result() == "done"
    assert out.text == "loading... done\n" and err.text == "warming up"


def test_each_job_gets_only_its_own_output(conn, connect, tmp_path):
    gate = str(tmp_path / "gate")
    sinks = [Sink(), Sink()]

    def job(args):
        import os
        import time

        name, gate = args
        for i in range(20):
            print(f"{name} {i}")
            time.sleep(0.005)
            if i == 10:
                while not os.path.exists(gate):
                    time.sleep(0.01)

    first = Background(conn, job, ("A", gate), stdout=sinks[0])
    second = Background(connect(conn.address[1]), job, ("B", gate), stdout=sinks[1])
    wait_until(lambda: "A 10" in sinks[0].text and "B 10" in sinks[1].text, 15, "both jobs to run at once")
    open_gate(gate)
    first.result()
    second.result()
    assert sinks[0].text.splitlines() == [f"A {i}" for i in range(20)]
    assert sinks[1].text.splitlines() == [f"B {i}" for i in range(20)]
