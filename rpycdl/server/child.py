"""The job process's own side, from its fork to its exit: it leads its own session, dies with its
parent, takes what to run from the go pipe (its environment, the account it runs as, its payload and
the payload's out-of-band buffers) before it unpickles anything, becomes its owner's account
(rpycdl.security.accounts), enters its working directory, installs the memory caps of a share, runs the
payload, and writes its outcome to the result pipe: a header (how many out-of-band buffers, then the
size and read-only flag of each), the buffers (lent to the pipe by reference, bulk.lend_to_pipe), then
the outcome bytes until the end. A load check (run_check) only unpickles the payload, as its owner."""

from __future__ import annotations

import _thread
import builtins
import contextlib
import ctypes
import io
import json
import mmap
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rpycdl.defaults import (
    ARRAY_INDEX_VARIABLE,
    ATTEMPT_VARIABLE,
    OUTPUT_FLUSH_DELAY,
    SECRET_VARIABLE_PREFIXES,
    STORE_SECRET_VARIABLES,
    WORKING_DIR_VARIABLE,
)
from rpycdl.errors import InvalidRequestError
from rpycdl.gpu import caps
from rpycdl.scheduler import procs
from rpycdl.scheduler.jobrecord import JobRecord
from rpycdl.security import accounts, cgroups
from rpycdl.security.accounts import Account
from rpycdl.security.fence import Fence
from rpycdl.wire import bulk, codec, tracebacks

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NAME = 15
PR_SET_DUMPABLE = 4
GO = struct.Struct("<IQ?")  # go pipe header: length of its JSON, length of the payload, out-of-band results
COUNT = struct.Struct("<I")  # result pipe header: how many out-of-band buffers,
ENTRY = struct.Struct("<Q?")  # then the size and read-only flag of each,
SIZE = struct.Struct("<Q")  # then the outcome's size, and the outcome


def job_environment(record: JobRecord) -> dict[str, str]:
    """The variables that tell a job which it is: its id, its attempt (rpycdl.attempt()) and, an array's element,
    its index (rpycdl.array_index())."""
    env = {procs.JOB_ID_VARIABLE: record.job_id, ATTEMPT_VARIABLE: str(record.attempt)}
    if record.array_index is not None:
        env[ARRAY_INDEX_VARIABLE] = str(record.array_index)
    return env


def gpu_environment(indices: Sequence[int], uuids: Sequence[str]) -> dict[str, str]:
    """The variables that make exactly the granted GPUs visible: CUDA_VISIBLE_DEVICES by `indices`, CUDA's in
    the server's processes (GPU.index: in PCI bus order, as CUDA_DEVICE_ORDER=PCI_BUS_ID counts, among the GPUs
    they may open, which a confinement such as a Slurm job's cgroup may make fewer than the host's); the
    variables read outside them, by a container runtime on the host, by UUID."""
    uuid_list = ",".join(uuids)
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in indices),
        "NV_GPU": uuid_list,
        "NVIDIA_VISIBLE_DEVICES": uuid_list,
        "RPYCDL_GPU_UUIDS": uuid_list,
    }


def die_with_parent(parent: int, die: bool = True) -> None:
    """Have the kernel SIGKILL this process when `parent`, its parent, exits (PR_SET_PDEATHSIG);
    exit now if it has already. With `die` False, undo that: this process outlives its parent."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL if die else 0)  # not Linux: the parent's sweep still cleans up
    if die and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def become_subreaper() -> None:
    """Make this process a child subreaper: what its descendants leave when their parent dies becomes its child
    (PR_SET_CHILD_SUBREAPER), not init's."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def name_process(name: str) -> None:
    """Name this process as `ps` and /proc/PID/comm show it (15 bytes at most): rpycdl-server,
    rpycdl-spare, rpycdl-conn, rpycdl-job."""
    prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def prctl(option: int, value: Any) -> None:
    """prctl(2), where there is one."""
    try:
        procs.libc().prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def cannot_load(exc: BaseException) -> InvalidRequestError:
    """What a client is told of a callable this server cannot unpickle (a module it lacks), the
    same whether its request found out while waiting (LoadCheck) or as its job started."""
    if isinstance(exc, InvalidRequestError):
        return exc
    return InvalidRequestError(f"the callable cannot be loaded on this server: {type(exc).__name__}: {exc}")


@dataclass
class Go:
    """What a job process is told to run, down its go pipe, before it unpickles anything.

    Attributes:
        env: variables to set (its GPUs, its directories, its ids).
        account: the account it runs as (a root server's); None: the one it was forked as.
        body: the payload (wire.codec.check_payload's body).
        layout: the payload's out-of-band buffers, which follow it on the pipe.
        out_of_band: whether its result's large buffers may go out of band.
        session: a session's first Go (its calls follow, one Go each).
        fence: how it is fenced (a server that fences: Fence), or None.
    """

    env: dict[str, str]
    account: Account | None
    body: bytes
    layout: codec.Layout = ()
    out_of_band: bool = False
    session: bool = False
    fence: Fence | None = None

    def header(self, files: Sequence[int] = ()) -> bytes:
        """The message up to the buffers: GO, the JSON of the rest, the body. `files`: the buffers (by index)
        whose files come on the files socket instead of their bytes on the pipe (bulk.Spooled)."""
        text = json.dumps({"env": self.env, "account": None if self.account is None else self.account.to_dict(),
                           "layout": self.layout, "files": list(files), "session": self.session,
                           "fence": None if self.fence is None else self.fence.to_dict()}).encode()
        return GO.pack(len(text), len(self.body), self.out_of_band) + text + self.body


def read_go(fd: int, files: int) -> tuple[Go, list[Any]] | None:
    """Read a Go and its buffers from the blocking pipe `fd` (each into fresh memory), or as a private
    mapping of a file whose descriptor comes on the socket `files`; None if the pipe closed first (a spare
    whose request never came)."""
    header = _read_exactly(fd, GO.size)
    if header is None:
        return None
    size, body_size, out_of_band = GO.unpack(header)
    told = json.loads(_read_exactly(fd, size) or b"null")
    body = _read_exactly(fd, body_size) if body_size else b""
    if told is None or body is None:
        return None
    layout = codec.check_layout(tuple(tuple(entry) for entry in told["layout"]))
    buffers: list[Any] = []
    for index, (length, readonly) in enumerate(layout):
        if index in told["files"]:
            _, (file,), _, _ = socket.recv_fds(socket.socket(fileno=os.dup(files)), 1, 1)
            buffers.append(mmap.mmap(file, length, flags=mmap.MAP_PRIVATE))  # written pages: the job's own
            os.close(file)
            continue
        buffer, cells = bulk.allocate(length, readonly)
        with memoryview(cells) as raw, raw.cast("B") as view:
            done = 0
            while done < length:
                read = os.readv(fd, [view[done:]])
                if not read:
                    return None
                done += read
        del cells
        buffers.append(buffer)
    account = None if told["account"] is None else Account.from_dict(told["account"])
    fence = None if told.get("fence") is None else Fence.from_dict(told["fence"])
    return Go(told["env"], account, body, layout, out_of_band, told.get("session", False), fence), buffers


def _read_exactly(fd: int, count: int) -> bytes | None:
    data = bytearray()
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _become(go: Go, parent: int, cgroup: cgroups.JobCgroup | None = None) -> None:
    """Become the job's owner (if the server is root), fenced first (a server that fences), dying with `parent`
    still, with its variables."""
    if go.fence is not None:
        go.fence.enter(cgroup, go.env)
    if go.account is not None:
        accounts.switch_to(go.account)
        prctl(PR_SET_DUMPABLE, 1)  # the kernel clears it when the ids change: its owner may debug it
        die_with_parent(parent)  # likewise cleared
    os.environ.update(go.env)
    working_dir = os.environ.get(WORKING_DIR_VARIABLE)
    if working_dir:  # before the payload is loaded: its functions may come from the directory's modules
        os.chdir(working_dir)
        sys.path.insert(0, working_dir)
    elif go.account is not None:
        os.chdir(go.account.home if os.access(go.account.home, os.X_OK) else "/")


def clean_environment(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The environment less every variable that may hold a credential: the store's, and any named by a
    prefix of SECRET_VARIABLE_PREFIXES."""
    return {name: value for name, value in environ.items()
            if name not in STORE_SECRET_VARIABLES and not name.startswith(SECRET_VARIABLE_PREFIXES)}


def keep_only(fds: Sequence[int]) -> None:
    """Close every descriptor of this process but 0, 1, 2 and `fds`: a job holds nothing of its parent's."""
    previous = -1
    for fd in [*sorted({0, 1, 2, *fds}), resource.getrlimit(resource.RLIMIT_NOFILE)[0]]:
        if fd > previous + 1:  # os.closerange(n, n) would close everything from n on
            os.closerange(previous + 1, fd)
        previous = fd


def _start(parent: int, name: str, fds: Sequence[int]) -> None:
    """What a job process or a load check does first: nothing of its parent's kept but `fds`, a session of
    its own, death with its parent."""
    keep_only(fds)
    os.setsid()  # its own session and process group: procs finds what it starts by them
    die_with_parent(parent)
    name_process(name)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)


def run_job(*, go_r: int, out_w: int, err_w: int, res_w: int, files: int, parent: int,
            cgroup: cgroups.JobCgroup | None = None) -> None:
    """Body of the job process: moves into its `cgroup` (its parent made it), waits for its Go on `go_r` (and
    `files`), then runs the payload, its output on `out_w` and `err_w`, its outcome on `res_w`. Never returns."""
    try:
        if cgroup is not None:
            cgroup.join()
        _start(parent, "rpycdl-job", (go_r, out_w, err_w, res_w, files))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout, sys.stderr = JobOutput.pair = (JobOutput(1), JobOutput(2))
        told = read_go(go_r, files)
        if told is None:  # closed before its GPUs came: nothing to run
            os._exit(0)
        _become(told[0], parent, cgroup)
        caps.install_caps()
        if told[0].session:  # Ctrl-C of a call (SIGINT, held back between calls) raises KeyboardInterrupt in it
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            signal.signal(signal.SIGINT, signal.default_int_handler)
        namespace = SessionGlobals() if told[0].session else None
        while told is not None:  # a job's one call; a session's calls, one Go each, until its pipe closes
            go, buffers = told
            told = None
            if go.body:
                _answer(go, buffers, res_w, namespace)
            del buffers  # a session's next call does not keep this one's arguments alive
            told = read_go(go_r, files) if go.session else None
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child: said on its stderr
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(2)
    os._exit(0)


class JobOutput(io.TextIOWrapper):
    """The job's stdout or stderr, on `fd`, line-buffered: the first write to either starts the thread that flushes
    the partial lines of both (flush_partial_lines, `pair` until then), so that a job that prints nothing starts no
    thread (one less to start, and to end when the job process exits)."""

    pair: tuple[JobOutput, ...] = ()

    def __init__(self, fd: int) -> None:
        super().__init__(open(fd, "wb", closefd=False), line_buffering=True)  # noqa: SIM115

    def write(self, text: str) -> int:
        if JobOutput.pair:
            pair, JobOutput.pair = JobOutput.pair, ()
            flush_partial_lines(*pair)
        return super().write(text)


def flush_partial_lines(*streams: Any) -> None:
    """Flush `streams` (the job's stdout and stderr, line-buffered) every OUTPUT_FLUSH_DELAY seconds from a
    thread of this process, so that output without a newline (`print("loading...", end="")`) reaches the
    client soon after it was printed instead of with its line's end. The thread takes no signal (they go to
    the job's own threads), and a fork waits for a flush under way, so that a child (a data loader's worker)
    never inherits a stream's lock held by a thread it does not have. It is started without waiting for it to
    run (threading.Thread.start waits: about 1.2 ms of each job's start on a busy 2-core machine)."""
    lock = threading.Lock()
    os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)

    def flush() -> None:
        while True:
            time.sleep(OUTPUT_FLUSH_DELAY)
            with lock:
                for stream in streams:
                    with contextlib.suppress(Exception):  # closed or replaced by the job: its business
                        stream.flush()

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        _thread.start_new_thread(flush, ())  # a daemon thread, which the job process's os._exit ends
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def _interruptible(session: bool) -> Iterator[None]:
    """In a session, let SIGINT through while the call runs, and drop one that came too late for it."""
    if not session:
        yield
        return
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        while signal.sigtimedwait({signal.SIGINT}, 0) is not None:
            pass


class SessionGlobals:
    """The module globals of a session's calls: a function sent by value (defined in your script or inside
    another function; dill sends it with the globals it uses) runs with one namespace that lasts the session,
    so that what a call assigns (`global model`) is there for the next. A global a call assigned stays the
    session's; the others come from the script as it is at each call. Functions of importable modules keep
    their own module's globals, which last the session too."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "__main__"}
        self._owned: set[str] = set()
        self._sent: dict[str, Any] = {}

    def bind(self, fn: Any) -> Any:
        """`fn`, running in the session's namespace if it is a function of the script."""
        module = sys.modules.get(fn.__module__ or "") if isinstance(fn, types.FunctionType) else None
        if not isinstance(fn, types.FunctionType) or fn.__globals__ is getattr(module, "__dict__", None):
            return fn  # sent by name: its module's globals are its own, and last
        self._sent = {name: value for name, value in fn.__globals__.items() if name != "__builtins__"}
        self.namespace.update((name, value) for name, value in self._sent.items() if name not in self._owned)
        bound = types.FunctionType(fn.__code__, self.namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        bound.__kwdefaults__, bound.__dict__ = fn.__kwdefaults__, fn.__dict__
        return bound

    def settle(self) -> None:
        """After a call: what it assigned (a name the script did not send, or sent otherwise) is the session's."""
        self._owned.update(name for name, value in self.namespace.items()
                           if name not in self._sent or value is not self._sent[name])


def _answer(go: Go, buffers: list[Any], res_w: int, namespace: SessionGlobals | None = None) -> None:
    """Run the call of `go` and write its outcome to the result pipe: a header (how many out-of-band buffers,
    then the size and read-only flag of each), the buffers, the outcome's size, the outcome. A session's calls
    share `namespace`."""
    try:
        fn, args = codec.load_call(go.body, buffers)
        fn = namespace.bind(fn) if namespace is not None else fn
    except BaseException as exc:  # noqa: BLE001 - told as what it is: a request this server cannot run
        fn, args = None, None
        outcome, result = codec.encode_error(cannot_load(exc), tracebacks.formatted(exc)), []
    if fn is not None:
        try:
            with _interruptible(go.session):
                try:
                    value = fn(args)
                finally:
                    if namespace is not None:
                        namespace.settle()
            outcome, result = codec.encode_value(value, go.out_of_band)
        except BaseException as exc:  # noqa: BLE001 - the call's exception is its outcome (Ctrl-C's too)
            outcome, result = codec.encode_error(exc, tracebacks.formatted(exc)), []
    del fn, args, buffers
    sys.stdout.flush()
    sys.stderr.flush()
    layout = codec.layout(result)
    header = COUNT.pack(len(layout)) + b"".join(ENTRY.pack(*entry) for entry in layout)
    if not result:  # one write: the connection process wakes once
        write_all(res_w, header + SIZE.pack(len(outcome)) + outcome)
        return
    write_all(res_w, header)
    for buffer in result:
        with buffer.raw() as view:
            bulk.lend_to_pipe(res_w, view)
    write_all(res_w, SIZE.pack(len(outcome)) + outcome)


def run_check(*, go_r: int, res_w: int, files: int, parent: int) -> None:
    """Body of a load check: unpickles the payload of its Go as the job's owner would, with no GPU, and
    writes why it cannot be loaded (nothing if it can) to `res_w`. Never returns."""
    message = b""
    try:
        _start(parent, "rpycdl-check", (go_r, res_w, files))
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        told = read_go(go_r, files)
        if told is None:
            os._exit(0)
        go, buffers = told
        _become(go, parent)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        codec.load_call(go.body, buffers)
    except BaseException as exc:  # noqa: BLE001 - what failed is the answer
        message = str(cannot_load(exc)).encode(errors="replace")
    with contextlib.suppress(OSError):
        os.write(res_w, message[:4096])
    os._exit(0)


def write_all(fd: int, data: Any) -> None:
    """Write all of `data` to the blocking pipe `fd`."""
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
