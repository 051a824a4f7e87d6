"""GPU device nodes fenced: those a job may not open (gpu_nodes_denied: every GPU's node but its own), refused on
cgroup v2 by a BPF device program attached to the job's cgroup, as runc and Slurm do where there is no devices
controller (on v1 the devices controller refuses them: rpycdl.security.cgroups). The program is a few instructions
built here (no compiler, no library): it reads the device's type, major and minor from its context (struct
bpf_cgroup_dev_ctx) and returns 0 (refused) for a listed character device, 1 for any other."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import re
import struct
from collections.abc import Callable, Sequence

from rpycdl.scheduler import procs

NVIDIA_MAJOR = 195
"""The major number of NVIDIA's GPU device nodes (/dev/nvidia0 is 195:0; 255 and 254 are the control nodes)."""
_SYSCALL = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
"""bpf(2)'s number on each architecture."""
BPF_PROG_LOAD, BPF_PROG_ATTACH = 5, 8
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6  # the attach type
BPF_F_ALLOW_MULTI = 2  # run with the programs of the cgroups above: a device any of them refuses stays refused
DEV_CHAR = 2  # bpf_cgroup_dev_ctx.access_type & 0xffff of a character device
_INSN = struct.Struct("<BBhi")  # code, dst | src << 4, offset, immediate


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return _INSN.pack(code, dst | src << 4, off, imm)


def program(deny: Sequence[tuple[int, int]]) -> bytes:
    """The program's instructions: refuse the character devices (major, minor) of `deny`, allow every other.

        r2 = ctx->access_type & 0xffff; r3 = ctx->major; r4 = ctx->minor
        if r2 != DEV_CHAR: goto allow
        for each (major, minor): if r3 == major and r4 == minor: goto refuse
        allow: return 1
        refuse: return 0
    """
    load, and_k, jne_k, jeq_k, mov_k, leave = 0x61, 0x57, 0x55, 0x15, 0xB7, 0x95
    pairs = len(deny)
    insns = [_insn(load, 2, 1, 0), _insn(and_k, 2, imm=0xFFFF), _insn(load, 3, 1, 4), _insn(load, 4, 1, 8),
             _insn(jne_k, 2, off=2 * pairs, imm=DEV_CHAR)]
    for index, (major, minor) in enumerate(deny):
        insns += [_insn(jne_k, 3, off=1, imm=major), _insn(jeq_k, 4, off=2 * (pairs - index), imm=minor)]
    insns += [_insn(mov_k, 0, imm=1), _insn(leave), _insn(mov_k, 0, imm=0), _insn(leave)]
    return b"".join(insns)


@functools.cache
def _bpf() -> Callable[..., int]:
    """bpf(2), through the C library's syscall()."""
    number = _SYSCALL.get(platform.machine())
    if number is None:
        raise OSError(f"bpf(2) is not known on {platform.machine()}")
    call = procs.libc().syscall
    call.restype = ctypes.c_long
    return functools.partial(call, ctypes.c_long(number))


def _call(command: int, attr: ctypes.Array[ctypes.c_char]) -> int:
    result = _bpf()(ctypes.c_long(command), ctypes.c_void_p(ctypes.addressof(attr)), ctypes.c_uint(ctypes.sizeof(attr)))
    if result < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"bpf: {os.strerror(number)}")
    return int(result)


def deny(cgroup_dir: str, devices: Sequence[tuple[int, int]]) -> None:
    """Attach to the cgroup v2 directory `cgroup_dir` a program that refuses the character `devices` (as root).

    Raises:
        OSError: the kernel refused to load or attach it (no BPF, or a cgroup above that allows no other program).
    """
    if not devices:
        return
    code = ctypes.create_string_buffer(program(devices))
    license_ = ctypes.create_string_buffer(b"MIT")
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<IIQQ", attr, 0, BPF_PROG_TYPE_CGROUP_DEVICE, len(code.raw) // _INSN.size,
                     ctypes.addressof(code), ctypes.addressof(license_))
    prog = _call(BPF_PROG_LOAD, attr)
    try:
        target = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            attach = ctypes.create_string_buffer(128)
            struct.pack_into("<IIII", attach, 0, target, prog, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)
            _call(BPF_PROG_ATTACH, attach)
        finally:
            os.close(target)
    finally:
        os.close(prog)  # the cgroup holds the program now


def gpu_nodes_denied(granted: set[int], served: set[int], dev: str = "/dev") -> tuple[tuple[int, int], ...]:
    """The GPU device nodes (major, minor) a job granted the GPUs of minors `granted` may not open: those of the
    server's other GPUs (`served`) and of every other GPU node of the host's `dev` (/dev/nvidia<N>)."""
    minors = {minor for minor in served if minor >= 0} | _host_gpu_minors(dev)
    return tuple((NVIDIA_MAJOR, minor) for minor in sorted(minors - granted))


@functools.cache
def _host_gpu_minors(dev: str) -> frozenset[int]:
    """The minors of the host's GPU device nodes (/dev/nvidia<N>), read once per process: not at every job start."""
    minors = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(dev):
            if re.fullmatch(r"nvidia\d+", entry.name):
                with contextlib.suppress(OSError):
                    node = entry.stat(follow_symlinks=False)
                    if os.major(node.st_rdev) == NVIDIA_MAJOR:
                        minors.add(os.minor(node.st_rdev))
    return frozenset(minors)
