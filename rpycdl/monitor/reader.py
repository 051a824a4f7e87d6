"""The monitor's standing on its host: a reader of the lock and state directories that makes and changes
nothing in them, never root where the servers run jobs as their owners (it becomes --user's account, which
reads the directories through their group); before the servers make them, it reads an empty host."""

from __future__ import annotations

import grp
import os
import pwd
import signal
import stat
import sys
import threading
import time
from pathlib import Path

from rpycdl.errors import InvalidRequestError, RpycdlError
from rpycdl.scheduler import dirfds, lockdir
from rpycdl.scheduler.ledger import Ledger
from rpycdl.security.accounts import OWNER_ACCOUNTS, Account, switch_to

WATCH_POLL = 1.0
"""Seconds between a monitor's looks at the directories, for the servers' marks that decide its standing."""


def become_reader(lock_dir: str, states: str, user: str | None) -> None:
    """Make this process the monitor of `lock_dir` and `states`: a reader (lockdir.read_only), as `user`'s account
    if given (this process being root), else as itself, but not as root on a host whose servers run jobs as
    their owners, nor through a directory another account than root could change. A monitor may start before
    the servers make the directories: what the checks need is looked at when they appear (and, as root, again
    every WATCH_POLL seconds: servers of the other mode may come later); a refusal then stops the monitor
    (refused() says why).

    Raises:
        InvalidRequestError: `user` names no account, root, or is given to a process that is not root.
        RpycdlError: root without `user` where the servers run jobs as their owners; directories `user`'s
            account cannot read, or that another account could change (a root monitor).
    """
    lockdir.read_only()
    account = None
    if user is not None:
        if os.geteuid() != 0:
            raise InvalidRequestError("--user is for a monitor started as root, which then runs as that account: "
                                      "this one runs as your account already; start it without --user")
        account = account_of(user)
        switch_to(account)
    elif os.geteuid() == 0:
        for path, what in ((lock_dir, "lock directory"), (states, "state directory")):
            dirfds.check_trusted(path, what)  # root reads there: nobody else may change what it names
    else:
        return
    made = (Path(lock_dir) / "queue.lock", Path(states) / Ledger.FILE)
    if all(path.exists() for path in made):
        _check_standing(lock_dir, states, account)
        if account is not None:
            return
    threading.Thread(target=_watch, args=(made, lock_dir, states, account), daemon=True).start()


def refused() -> str | None:
    """Why the monitor stopped itself, having found it may not read the host as it runs (None: it did not)."""
    return _REFUSED[0]


_REFUSED: list[str | None] = [None]


def _check_standing(lock_dir: str, states: str, account: Account | None) -> None:
    """Raise RpycdlError, saying what to do, if this process may not read the directories as it runs now."""
    if account is not None:
        _check_readable(lock_dir, states, account)
    elif OWNER_ACCOUNTS in lockdir.isolation_marks(Path(lock_dir)):
        raise RpycdlError(f"rpycdl monitor runs as root, and the servers of {lock_dir} run jobs as their "
                          "owners: a process reading users' jobs and answering the network does not run as root "
                          "there. Give it an account of the lock directory's group to run as (--user ACCOUNT; "
                          "docs/monitor.md, Which account)")


def _watch(made: tuple[Path, ...], lock_dir: str, states: str, account: Account | None) -> None:
    """Check this process's standing once the directories are made (and as root, for good); stop it if refused."""
    while True:
        if all(path.exists() for path in made):
            try:
                _check_standing(lock_dir, states, account)
            except RpycdlError as exc:
                _REFUSED[0] = str(exc)
                print(f"rpycdl monitor: {exc}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGINT)  # the server stops as on Ctrl-C; the command exits 1
                return
            if account is not None:
                return
        time.sleep(WATCH_POLL)


def account_of(user: str) -> Account:
    """The account `user` names: an account name of this host, or "uid:gid" (a container's, without accounts).

    Raises:
        InvalidRequestError: no such account, or root.
    """
    uid, _, gid = user.partition(":")
    if uid.isdigit() and gid.isdigit():
        account = Account(user, int(uid), int(gid), (int(gid),))
    else:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise InvalidRequestError(f"--user {user}: no such account on this host (a name, or uid:gid)") from None
        account = Account(entry.pw_name, entry.pw_uid, entry.pw_gid,
                          tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)), entry.pw_dir or "/")
    if account.uid == 0:
        raise InvalidRequestError(f"--user {user} is root: give the monitor an account of its own")
    return account


def _check_readable(lock_dir: str, states: str, account: Account) -> None:
    """Refuse, saying what to do, if `account` (this process now) cannot read the lock and state directories."""
    for path in (lock_dir, os.path.join(lock_dir, "held"), states, os.path.join(states, Ledger.FILE)):
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
            if os.path.isdir(path):
                os.listdir(path)
        except PermissionError:
            status = os.stat(path)
            group = _group_name(status.st_gid)
            raise RpycdlError(f"the monitor's account {account.user} cannot read {path} (group {group}, mode "
                              f"{stat.S_IMODE(status.st_mode):o}): put the account in group {group} (usermod -aG "
                              f"{group} {account.user}), or run it as an account of that group (--user UID:GID "
                              "of it; docs/monitor.md, Which account)") from None


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
