"""The job process's own side, from its fork to its exit: it leads its own session, dies with its
parent, takes its environment (its GPUs; its working directory, entered) from the go pipe before it
unpickles anything, installs the memory caps of a share, runs the payload, and writes its outcome to
the result pipe: a header (how many out-of-band buffers, then the size and read-only flag of each),
the buffers (lent to the pipe by reference, bulk.lend_to_pipe), then the outcome bytes until the end."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from rpycdl.defaults import STORE_SECRET_VARIABLES, WORKING_DIR_VARIABLE
from rpycdl.errors import InvalidRequestError
from rpycdl.gpu import caps
from rpycdl.wire import bulk, codec

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
GO = struct.Struct("<I?")  # go pipe header: length of the environment's JSON, out-of-band results
COUNT = struct.Struct("<I")  # result pipe header: how many out-of-band buffers,
ENTRY = struct.Struct("<Q?")  # then the size and read-only flag of each


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


def name_process(name: str) -> None:
    """Name this process as `ps` and /proc/PID/comm show it (15 bytes at most): rpycdl-server,
    rpycdl-spare, rpycdl-conn, rpycdl-job."""
    prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def prctl(option: int, value: Any) -> None:
    """prctl(2), where there is one."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def cannot_load(exc: BaseException) -> InvalidRequestError:
    """What a client is told of a callable this server cannot unpickle (a module it lacks), the
    same whether its request found out while waiting (LoadCheck) or as its job started."""
    if isinstance(exc, InvalidRequestError):
        return exc
    return InvalidRequestError(f"the callable cannot be loaded on this server: {type(exc).__name__}: {exc}")


def run_job(body: bytes | None, buffers: Sequence[Any], *, go_r: int, out_w: int, err_w: int, res_w: int,
            parent: int) -> None:
    """Body of the job process: waits for its environment (and, in a spare, its payload `body`)
    on `go_r`, then runs the payload, its output on `out_w` and `err_w`, its outcome on `res_w`.
    Never returns."""
    try:
        os.setsid()  # its own session and process group: procs finds what it starts by them
        die_with_parent(parent)
        name_process("rpycdl-job")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        with os.fdopen(go_r, "rb") as go:
            message = go.read()
        if not message:  # closed before its GPUs came: nothing to run
            os._exit(0)
        size, out_of_band = GO.unpack_from(message)
        os.environ.update(json.loads(message[GO.size:GO.size + size]))
        for name in STORE_SECRET_VARIABLES:  # the artifact store's: the job's saves go through this process's owner
            os.environ.pop(name, None)
        working_dir = os.environ.get(WORKING_DIR_VARIABLE)
        if working_dir:  # before the payload is loaded: its functions may come from the directory's modules
            os.chdir(working_dir)
            sys.path.insert(0, working_dir)
        body = body or message[GO.size + size:]
        caps.install_caps()
        try:
            fn, args = codec.load_call(body, buffers)
        except BaseException as exc:  # noqa: BLE001 - told as what it is: a request this server cannot run
            fn, args = None, None
            outcome, result = codec.encode_error(cannot_load(exc), "".join(traceback.format_exception(exc))), []
        if fn is not None:
            try:
                outcome, result = codec.encode_value(fn(args), out_of_band)
            except BaseException as exc:  # noqa: BLE001 - the job's exception is its outcome
                outcome, result = codec.encode_error(exc, "".join(traceback.format_exception(exc))), []
        sys.stdout.flush()
        sys.stderr.flush()
        layout = codec.layout(result)
        write_all(res_w, COUNT.pack(len(layout)) + b"".join(ENTRY.pack(*entry) for entry in layout))
        for buffer in result:
            with buffer.raw() as view:
                bulk.lend_to_pipe(res_w, view)
        write_all(res_w, outcome)
        os.close(res_w)  # end of file tells the parent the outcome is complete
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        os._exit(2)
    os._exit(0)


def write_all(fd: int, data: Any) -> None:
    """Write all of `data` to the blocking pipe `fd`."""
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
