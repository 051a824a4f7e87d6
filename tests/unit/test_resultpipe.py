"""The connection process's end of a job's result pipe (rpycdl.server.resultpipe): what it reads as the header
comes in pieces, and that it never spins on a pipe whose writer lives on and sends nothing (a process the job
started holds its end after the job process died)."""

from __future__ import annotations

import os
import threading

from rpycdl.server.child import COUNT, SIZE
from rpycdl.server.resultpipe import ResultPipe


def _pipe() -> tuple[int, int]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    return read, write


def test_a_header_in_pieces_is_waited_for_without_spinning():
    read, write = _pipe()
    try:
        pipe = ResultPipe(read, None, None)
        os.write(write, COUNT.pack(0)[:2])
        answered = []
        reader = threading.Thread(target=lambda: answered.append(pipe.read()))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "read() spun on a pipe with nothing more in it"
        assert answered == [True] and not pipe.done  # more to come
        os.write(write, COUNT.pack(0)[2:] + SIZE.pack(3) + b"abc")
        assert pipe.read() is False and pipe.done and bytes(pipe.outcome) == b"abc"
    finally:
        os.close(read)
        os.close(write)


def test_a_pipe_that_ends_early_is_incomplete():
    read, write = _pipe()
    pipe = ResultPipe(read, None, None)
    os.write(write, COUNT.pack(0) + SIZE.pack(10) + b"abc")
    os.close(write)
    assert pipe.read() is False and not pipe.done
    os.close(read)
