"""The GPU lock manager itself, shared by several real processes through one lock directory.

Every process here is a real process (multiprocessing, "fork" context) with its own
GPULockManager, exactly as connection processes of different servers use it."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from helpers import unavailable, wait_until

from rpycdl.errors import InvalidRequestError, QueueTimeoutError
from rpycdl.scheduler.ledger import JobRecord, Ledger
from rpycdl.scheduler.locks import GPULockManager
from rpycdl.scheduler.queuedir import Need
from rpycdl.units import MiB

CTX = multiprocessing.get_context("fork")
NOBODY = 65534
UUIDS = [f"GPU-00000000-0000-4000-8000-{i:012d}" for i in range(4)]
SIZES = {uuid: 16 * 1024 * MiB for uuid in UUIDS}  # four 16 GiB GPUs


def _need(ngpus: int, share_mib: int = 0, sizes: dict[str, int] = SIZES) -> Need:
    """`ngpus` whole GPUs of UUIDS, or `share_mib` MiB of one of them."""
    return Need(ngpus, tuple(UUIDS), share_mib * MiB, sizes)


# -- helpers run in the child processes ------------------------------------------------


def _hammer(lock_dir: str, owners: str, rounds: int, seed: int, out) -> None:
    """Take 1, 2 or all GPUs `rounds` times; claim each granted GPU with an O_EXCL marker file
    while holding it, so a double grant shows up as FileExistsError whatever the timing."""
    locks = GPULockManager(lock_dir)
    rng = random.Random(seed)
    grants = []
    try:
        for _ in range(rounds):
            count = rng.choice([1, 2, len(UUIDS)])
            grant = locks.acquire(_need(count), {"pid": os.getpid()})
            markers = []
            for uuid in grant.uuids:
                fd = os.open(os.path.join(owners, uuid), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
                markers.append(os.path.join(owners, uuid))
            time.sleep(rng.uniform(0, 0.01))
            for marker in markers:
                os.unlink(marker)
            locks.release(grant)
            grants.append({"count": count, "uuids": list(grant.uuids), "ticket": grant.ticket,
                           "sequence": grant.sequence})
        out.put(("ok", grants))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(exc)))


def _waiter(lock_dir: str, count: int, hold: float, name: str, out, sleep_poll: float = 0.5,
            queue_timeout: float | None = None) -> None:
    """Wait for `count` GPUs, report the grant and when it came, hold them, release."""
    locks = GPULockManager(lock_dir, sleep_poll=sleep_poll)
    try:
        grant = locks.acquire(_need(count), {"name": name, "pid": os.getpid()}, queue_timeout=queue_timeout)
    except QueueTimeoutError as exc:
        out.put((name, "queue_timeout", str(exc), time.time()))
        return
    granted = time.time()
    out.put((name, "granted", {"uuids": list(grant.uuids), "ticket": grant.ticket, "sequence": grant.sequence},
             granted))
    time.sleep(hold)
    locks.release(grant)


def _holder(lock_dir: str, count: int, held, release, die: bool, let_go) -> None:
    """Take `count` GPUs, say so, and on `release` either release them or die holding them, noting in
    `let_go` when it did (a holder that a busy machine woke late lets go later than `release` was set)."""
    locks = GPULockManager(lock_dir)
    grant = locks.acquire(_need(count), {"name": "holder", "pid": os.getpid()})
    held.set()
    release.wait(60)
    let_go.value = time.time()
    if die:
        os._exit(0)  # no release, no wake-up: only the kernel frees the fcntl locks
    locks.release(grant)


# -- helpers in the test process ------------------------------------------------------------


def _queue_names(locks: GPULockManager) -> list[str]:
    return [waiter.get("name", "?") for waiter in locks.snapshot()["queue"]]


def _start(target, *args, **kwargs) -> multiprocessing.Process:
    process = CTX.Process(target=target, args=args, kwargs=kwargs, daemon=True)
    process.start()
    return process


@pytest.fixture
def procs():
    """Processes started by a test; any still running at its end are killed."""
    started: list[multiprocessing.Process] = []
    yield started
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(5)


def _hold_all(lock_dir: str, procs, count: int = len(UUIDS), die: bool = False):
    """A holder of `count` GPUs: the process, the event that makes it let go, and when it did (time.time())."""
    held, release, let_go = CTX.Event(), CTX.Event(), CTX.Value("d", 0.0)
    holder = _start(_holder, lock_dir, count, held, release, die, let_go)
    procs.append(holder)
    assert held.wait(10), "the holder never got its GPUs"
    return holder, release, let_go


def _enqueue(lock_dir: str, procs, out, name: str, count: int, hold: float = 0.05, **kwargs):
    """Start a waiter and return once it is in the queue, so arrival order is the start order."""
    locks = GPULockManager(lock_dir)
    process = _start(_waiter, lock_dir, count, hold, name, out, **kwargs)
    procs.append(process)
    wait_until(lambda: name in _queue_names(locks), 10, f"{name} to join the queue")
    return process


def _collect(out, n: int, timeout: float = 15) -> dict[str, tuple]:
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < n:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {sorted(results)} reported"
        name, *rest = out.get(timeout=remaining)
        results[name] = tuple(rest)
    return results


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_grants_are_exclusive_and_in_arrival_order_under_contention(lock_dir, tmp_path, procs):
    owners = tmp_path / "owners"
    owners.mkdir()
    out = CTX.Queue()
    workers, rounds = 6, 12
    for seed in range(workers):
        procs.append(_start(_hammer, lock_dir, str(owners), rounds, seed, out))
    grants = []
    for _ in range(workers):
        status, value = out.get(timeout=60)
        assert status == "ok", value  # FileExistsError here: two processes held one GPU
        grants.extend(value)
    for process in procs:
        process.join(10)
        assert process.exitcode == 0

    assert len(grants) == workers * rounds
    for grant in grants:
        assert len(grant["uuids"]) == grant["count"] == len(set(grant["uuids"]))
        assert set(grant["uuids"]) <= set(UUIDS)
    assert len({g["ticket"] for g in grants}) == len(grants)
    assert len({g["sequence"] for g in grants}) == len(grants)
    by_ticket = [g["sequence"] for g in sorted(grants, key=lambda g: g["ticket"])]
    assert by_ticket == sorted(by_ticket), "a later request was granted before an earlier one"
    assert GPULockManager(lock_dir).snapshot() == {"held": {}, "queue": []}


def test_waiters_are_granted_first_come_first_served(lock_dir, procs):
    holder, release, _ = _hold_all(lock_dir, procs)
    out = CTX.Queue()
    # "all" arrives third: the 1-GPU requests behind it must not overtake it although a GPU
    # is free while it waits for the two ahead of it.
    order = [("w0", 2), ("w1", 1), ("w2", 4), ("w3", 1), ("w4", 3), ("w5", 1), ("w6", 2)]
    for name, count in order:
        _enqueue(lock_dir, procs, out, name, count, hold=0.1)
    assert _queue_names(GPULockManager(lock_dir)) == [name for name, _ in order]

    release.set()
    results = _collect(out, len(order))
    assert all(results[name][0] == "granted" for name, _ in order), results
    sequences = [results[name][1]["sequence"] for name, _ in order]
    tickets = [results[name][1]["ticket"] for name, _ in order]
    assert tickets == sorted(tickets)
    assert sequences == sorted(sequences), f"grant order {sequences} is not arrival order"
    granted_at = [results[name][2] for name, _ in order]
    assert granted_at[3] >= granted_at[2], "w3 (1 GPU) overtook w2 (all GPUs)"
    for name, count in order:
        assert len(results[name][1]["uuids"]) == count


def test_dead_waiter_leaves_the_queue_and_does_not_block_the_next(lock_dir, procs):
    holder, release, _ = _hold_all(lock_dir, procs, count=3)  # one GPU stays free
    out = CTX.Queue()
    doomed = _enqueue(lock_dir, procs, out, "doomed", 4)
    _enqueue(lock_dir, procs, out, "next", 1, hold=0)
    # "next" could take the free GPU, but the earlier "doomed" reserves every GPU it waits for.
    time.sleep(0.7)
    assert out.empty(), "a later 1-GPU request overtook an earlier waiting one"
    assert _queue_names(GPULockManager(lock_dir)) == ["doomed", "next"]

    os.kill(doomed.pid, signal.SIGKILL)
    killed = time.time()
    doomed.join(5)
    name, status, grant, granted = out.get(timeout=5)
    assert (name, status) == ("next", "granted")
    assert granted - killed < 1.5, f"the next waiter waited {granted - killed:.2f} s after the dead one died"
    assert grant["uuids"] == [UUIDS[3]]
    wait_until(lambda: GPULockManager(lock_dir).snapshot()["queue"] == [], 2, "an empty queue")
    assert not list((Path(lock_dir) / "queue").iterdir()), "the dead waiter's files were left behind"
    release.set()


def test_release_wakes_the_next_waiter_without_waiting_for_a_poll(lock_dir, procs):
    holder, release, let_go = _hold_all(lock_dir, procs)
    out = CTX.Queue()
    # This waiter only re-checks on its own every 30 s: only a wake-up can get it going sooner.
    _enqueue(lock_dir, procs, out, "sleeper", 4, hold=0, sleep_poll=30.0)
    time.sleep(0.3)  # let it go to sleep
    release.set()
    name, status, _, granted = out.get(timeout=10)
    assert (name, status) == ("sleeper", "granted")
    assert granted - let_go.value < 1.0, f"granted {granted - let_go.value:.2f} s after the release"


def test_dead_holder_frees_its_gpus_for_the_next_waiter(lock_dir, procs):
    holder, die, let_go = _hold_all(lock_dir, procs, die=True)
    out = CTX.Queue()
    waiter = _enqueue(lock_dir, procs, out, "next", 2, hold=0)
    locks = GPULockManager(lock_dir)
    assert len(locks.snapshot()["held"]) == len(UUIDS)

    die.set()
    name, status, grant, granted = out.get(timeout=10)
    assert (name, status) == ("next", "granted")
    assert granted - let_go.value < 1.0, f"granted {granted - let_go.value:.2f} s after the holder died"
    holder.join(5)
    waiter.join(5)
    assert holder.exitcode == 0 and waiter.exitcode == 0
    assert locks.snapshot() == {"held": {}, "queue": []}, "a dead holder is still reported"


def test_queue_timeout_leaves_nothing_behind(lock_dir, procs):
    holder, release, _ = _hold_all(lock_dir, procs)
    out = CTX.Queue()
    started = time.time()
    procs.append(_start(_waiter, lock_dir, 1, 0, "impatient", out, queue_timeout=0.5))
    name, status, message, ended = out.get(timeout=10)
    assert (name, status) == ("impatient", "queue_timeout")
    assert 0.5 <= ended - started < 3
    assert "0.5 s" in message
    assert GPULockManager(lock_dir).snapshot()["queue"] == []
    assert not list((Path(lock_dir) / "queue").iterdir())
    release.set()
    holder.join(5)
    assert GPULockManager(lock_dir).snapshot() == {"held": {}, "queue": []}


def _hammer_as(uid: int, lock_dir: str, owners: str, rounds: int, seed: int, out) -> None:
    """_hammer as another user, like a server in a container running as a non-root uid."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    _hammer(lock_dir, owners, rounds, seed, out)
    Ledger(os.path.join(lock_dir, "state")).save(JobRecord(f"job{uid}", "server", "client", 1))


@pytest.mark.slow
def test_processes_of_two_users_share_one_lock_directory(procs):
    # A root server on the host and a non-root one in a container share the lock directory:
    # every file either creates there (locks, FIFOs, the job ledger, counters) stays usable by the other.
    if os.geteuid() != 0:
        unavailable("needs root to switch a process to another user", "run this test as root")
    shared = Path(tempfile.mkdtemp(prefix="rpycdl-users-"))
    try:
        os.chmod(shared, 0o755)
        lock_dir, owners = str(shared / "locks"), shared / "owners"
        owners.mkdir(mode=0o777)
        os.chmod(owners, 0o777)
        GPULockManager(lock_dir)  # root creates the layout
        out = CTX.Queue()
        for seed in range(4):
            target = _hammer if seed % 2 else _hammer_as
            args = (lock_dir, str(owners), 8, seed, out) if seed % 2 else (NOBODY, lock_dir, str(owners), 8, seed, out)
            procs.append(_start(target, *args))
        for _ in range(4):
            status, value = out.get(timeout=60)
            assert status == "ok", value  # PermissionError here: a file of one user blocked the other
        for process in procs:
            process.join(10)
            assert process.exitcode == 0
        assert GPULockManager(lock_dir).snapshot() == {"held": {}, "queue": []}
        ledger = Ledger(os.path.join(lock_dir, "state"))  # made by the other user: root writes it too
        assert ledger.get(f"job{NOBODY}") is not None and ledger.save(JobRecord("jobroot", "server", "client", 1))
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# -- shares of a GPU --------------------------------------------------------------------------

def _share(locks: GPULockManager, memory: int, name: str, **kwargs):
    return locks.acquire(_need(1, memory), {"name": name, "pid": os.getpid()}, **kwargs)


def _share_holder(lock_dir: str, memory: int, held, release, die: bool) -> None:
    """Take `memory` MiB of one GPU, report which, and on `release` release it or die holding it."""
    grant = _share(GPULockManager(lock_dir), memory, "share")
    held.put(grant.uuids[0])
    release.wait(60)
    if die:
        os._exit(0)
    GPULockManager(lock_dir).release(grant)


def _share_waiter(lock_dir: str, memory: int, name: str, out) -> None:
    locks = GPULockManager(lock_dir)
    grant = _share(locks, memory, name) if memory else locks.acquire(_need(len(UUIDS)), {"name": name})
    out.put((name, list(grant.uuids), grant.sequence))
    locks.release(grant)


def test_shares_pack_onto_a_shared_gpu_before_taking_an_idle_one(lock_dir):
    locks = GPULockManager(lock_dir)
    first = _share(locks, 4096, "a")
    assert first.uuids == (UUIDS[0],) and first.share_bytes == 4096 * MiB
    # The second and third shares fit beside the first: GPUs 1 to 3 stay idle for whole-GPU jobs.
    second, third = _share(locks, 8192, "b"), _share(locks, 4096, "c")
    assert second.uuids == third.uuids == (UUIDS[0],)
    spans = sorted(first.ranges + second.ranges + third.ranges)
    assert sum(length for _, length in spans) == 16384
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False)), f"overlapping shares {spans}"
    fourth = _share(locks, 1024, "d")  # GPU 0 is full
    assert fourth.uuids == (UUIDS[1],)
    whole = locks.acquire(_need(2), {"name": "whole"})
    assert whole.uuids == (UUIDS[2], UUIDS[3])
    # Best fit: with 3 GiB free on GPU 0 and 15 GiB on GPU 1, a 2 GiB share goes to GPU 0.
    locks.release(third)
    locks.release(fourth)
    other = _share(locks, 15360, "e")
    assert other.uuids == (UUIDS[1],)
    assert _share(locks, 2048, "f").uuids == (UUIDS[0],)
    held = locks.snapshot()["held"]
    assert [h["share_bytes"] // MiB for h in held[UUIDS[0]]] == [4096, 8192, 2048]
    assert [h["name"] for h in held[UUIDS[0]]] == ["a", "b", "f"]
    assert [h["share_bytes"] // MiB for h in held[UUIDS[2]]] == [0]


def test_fractional_requests_are_checked(lock_dir):
    locks = GPULockManager(lock_dir)
    with pytest.raises(InvalidRequestError, match="the largest GPU has 16 GiB"):
        _share(locks, 16385, "too big")
    with pytest.raises(InvalidRequestError, match="one GPU"):
        locks.acquire(_need(2, 1024), {})
    with pytest.raises(InvalidRequestError, match="size known"):
        locks.acquire(_need(1, 1024, {}), {})
    assert locks.snapshot() == {"held": {}, "queue": []}


def test_a_whole_gpu_never_goes_to_a_job_while_shares_hold_it(lock_dir, procs):
    held, release = CTX.Queue(), CTX.Event()
    for _ in range(len(UUIDS)):  # a 12 GiB share on every GPU: none is idle
        procs.append(_start(_share_holder, lock_dir, 12288, held, release, False))
    assert sorted(held.get(timeout=10) for _ in UUIDS) == UUIDS
    locks = GPULockManager(lock_dir)
    with pytest.raises(QueueTimeoutError):
        locks.acquire(_need(1), {"name": "whole"}, queue_timeout=0.5)
    release.set()
    wait_until(lambda: not locks.snapshot()["held"], 5, "the shares to be released")
    whole = locks.acquire(_need(4), {"name": "whole"})
    out = CTX.Queue()
    procs.append(_start(_share_waiter, lock_dir, 1024, "share", out))
    time.sleep(0.7)
    assert out.empty(), "a share was granted on a GPU held whole"
    locks.release(whole)
    assert out.get(timeout=5)[0] == "share"


def test_a_share_does_not_overtake_an_earlier_whole_gpu_request(lock_dir, procs):
    held, release = CTX.Queue(), CTX.Event()
    procs.append(_start(_share_holder, lock_dir, 8192, held, release, False))
    assert held.get(timeout=10) == UUIDS[0]
    out = CTX.Queue()
    locks = GPULockManager(lock_dir)
    procs.append(_start(_share_waiter, lock_dir, 0, "all four", out))
    wait_until(lambda: "all four" in _queue_names(locks), 10, "the whole-GPU request to wait")
    procs.append(_start(_share_waiter, lock_dir, 4096, "small share", out))
    wait_until(lambda: "small share" in _queue_names(locks), 10, "the share to wait")
    # The share would fit beside the held one, but the earlier request for all four GPUs goes first.
    time.sleep(0.7)
    assert out.empty(), "a later share overtook an earlier whole-GPU request"
    release.set()
    granted = sorted([out.get(timeout=5), out.get(timeout=5)], key=lambda report: report[2])  # grant order
    assert [name for name, _, _ in granted] == ["all four", "small share"]


def test_a_dead_share_holder_frees_its_share(lock_dir, procs):
    held, release = CTX.Queue(), CTX.Event()
    holder = _start(_share_holder, lock_dir, 16384, held, release, True)
    procs.append(holder)
    assert held.get(timeout=10) == UUIDS[0]
    locks = GPULockManager(lock_dir)
    assert [h["share_bytes"] // MiB for h in locks.snapshot()["held"][UUIDS[0]]] == [16384]
    release.set()  # it dies holding the share: only the kernel frees it
    holder.join(5)
    assert locks.snapshot() == {"held": {}, "queue": []}
    assert _share(locks, 16384, "next").uuids == (UUIDS[0],)
