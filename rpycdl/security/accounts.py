"""Whose Unix account runs a job: on a server started as root, the account of its owner's verified
identity (same name, or as a user map says), a guest account for unverified identities, or a
refusal naming why; on any other server, the server's own account ("one account"). And the switch a
job process makes to that account, before it runs anything of the job's.

A user map is TOML:

    [accounts]            # identity = account name, or "uid:gid" (a container without the site's accounts)
    alice = "alice"
    ci-bot = "2001:2001"

    [admins]              # identities that may act on anyone's jobs, besides admin certificates
    names = ["carol"]
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import dataclass, field

from rpycdl.errors import InvalidRequestError, NotAllowedError
from rpycdl.security.auth import Identity, is_user_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

OWNER_ACCOUNTS = "owner accounts"
"""Isolation mode of a root server: every job runs as its owner's account."""
ONE_ACCOUNT = "one account"
"""Isolation mode of a server that is not root (or told --one-account): jobs run as the server's account,
so they can reach each other's files and the server's."""

JOB_UMASK = 0o077
"""A job's umask: what it creates is its owner's alone."""


@dataclass(frozen=True)
class Account:
    """A Unix account a job runs as.

    Attributes:
        user: its name (what $USER says; the identity itself for a uid:gid mapping).
        uid, gid: its ids; groups: its supplementary groups (initgroups' for a named account).
        home: its home directory ($HOME; "/" for a uid:gid mapping).
    """

    user: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    home: str = "/"

    def to_dict(self) -> dict[str, object]:
        return {"user": self.user, "uid": self.uid, "gid": self.gid, "groups": list(self.groups), "home": self.home}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Account:
        return cls(str(data["user"]), int(data["uid"]), int(data["gid"]),  # type: ignore[call-overload]
                   tuple(int(g) for g in data["groups"]), str(data["home"]))  # type: ignore[union-attr]


@dataclass(frozen=True)
class Accounts:
    """How a server picks the account of a job: its isolation mode and its rules.

    Attributes:
        mode: OWNER_ACCOUNTS or ONE_ACCOUNT.
        user_map: identity -> account name or "uid:gid" (owner accounts only).
        admins: identities the user map makes admins.
        guest: the account unverified identities run as (owner accounts); None refuses them.
        require_verified: refuse jobs of unverified identities (shared-secret clients), in any mode.
    """

    mode: str = ONE_ACCOUNT
    user_map: dict[str, str] = field(default_factory=dict)
    admins: frozenset[str] = frozenset()
    guest: str | None = None
    require_verified: bool = False

    @property
    def isolated(self) -> bool:
        return self.mode == OWNER_ACCOUNTS

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "user_map": self.user_map, "admins": sorted(self.admins), "guest": self.guest,
                "require_verified": self.require_verified}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Accounts:
        return cls(str(data["mode"]), dict(data["user_map"]), frozenset(data["admins"]),  # type: ignore[arg-type]
                   data["guest"], bool(data["require_verified"]))  # type: ignore[arg-type]

    @classmethod
    def for_server(cls, root: bool, one_account: bool = False, user_map: str | None = None,
                   guest: str | None = None, require_verified: bool = False) -> Accounts:
        """A server's rules from its flags: owner accounts on a root server unless told --one-account.

        Raises:
            InvalidRequestError: flags that cannot go together, a user map that cannot be read, or a guest
                account that does not exist.
        """
        isolated = root and not one_account
        if (user_map or guest) and not isolated:
            raise InvalidRequestError("--user-map and --guest-user choose the accounts jobs run as, which only a "
                                      "server started as root can do (and not with --one-account)")
        if guest and require_verified:
            raise InvalidRequestError("--guest-user runs unverified clients' jobs, which --require-verified refuses: "
                                      "give one or the other")
        if guest:
            try:
                named_account(guest, "the guest account (--guest-user)")
            except NotAllowedError as exc:
                raise InvalidRequestError(str(exc)) from None
        accounts, admins = load_user_map(user_map) if user_map else ({}, frozenset())
        return cls(OWNER_ACCOUNTS if isolated else ONE_ACCOUNT, accounts, admins, guest, require_verified)

    def admin(self, identity: Identity) -> bool:
        """Whether the identity may act on anyone's jobs: an admin certificate, or named by the user map."""
        return identity.admin or (identity.verified and identity.user in self.admins)

    def account(self, identity: Identity) -> Account | None:
        """The account a job of `identity` runs as; None: the server's own (one account).

        Raises:
            NotAllowedError: the identity may not run jobs here (unverified without a guest account, or
                with --require-verified), or has no account, or would run as root.
        """
        if self.require_verified and not identity.verified:
            raise NotAllowedError(f"{identity.label} is not verified, and this server runs only jobs of verified "
                                  "identities (--require-verified): connect with your TLS certificate")
        if not self.isolated:
            return None
        if not identity.verified:
            if self.guest is None:
                raise NotAllowedError(
                    f"{identity.label} is not verified (no client certificate), and this server runs each job as "
                    "its owner's account: connect with your TLS certificate, or ask the operator for a guest "
                    "account for unverified clients (rpycdl serve --guest-user ACCOUNT)")
            return named_account(self.guest, "the guest account (--guest-user)")
        mapped = self.user_map.get(identity.user, identity.user)
        if ":" in mapped:
            return id_account(identity.user, mapped)
        return named_account(mapped, f"the account of {identity.user}" + (" (--user-map)" if identity.user
                                                                          in self.user_map else ""))


def named_account(name: str, what: str) -> Account:
    """The account called `name` on this host.

    Raises:
        NotAllowedError: there is none, or it is root.
    """
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise NotAllowedError(f"{what}, {name!r}, does not exist on this server: the operator creates it, or maps "
                              "the identity to an account (rpycdl serve --user-map FILE)") from None
    if entry.pw_uid == 0:
        raise NotAllowedError(f"{what} is {name!r}, uid 0: jobs never run as root; map it to another account "
                              "(rpycdl serve --user-map FILE)")
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(entry.pw_name, entry.pw_gid)),
                   entry.pw_dir or "/")


def id_account(identity: str, ids: str) -> Account:
    """The account "uid:gid" (from a user map) for `identity`."""
    uid, _, gid = ids.partition(":")
    if not (uid.isdigit() and gid.isdigit()) or int(uid) == 0:
        raise NotAllowedError(f"the user map gives {identity} the account {ids!r}: not uid:gid of an account other "
                              "than root")
    return Account(identity, int(uid), int(gid), (int(gid),))


def load_user_map(path: str) -> tuple[dict[str, str], frozenset[str]]:
    """Read a user map (the module's docstring): its accounts and its admins.

    Raises:
        InvalidRequestError: unreadable, not TOML, or not of that shape (the message names the file).
    """
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequestError(f"cannot read the user map {path}: {exc}") from None
    accounts, admins = data.get("accounts", {}), data.get("admins", {}).get("names", [])
    unknown = set(data) - {"accounts", "admins"}
    if unknown or not isinstance(accounts, dict) or not isinstance(admins, list):
        raise InvalidRequestError(f"the user map {path} has [accounts] (identity = account) and [admins] "
                                  f"(names = [...]) only{f', not {sorted(unknown)}' if unknown else ''}")
    for identity, account in accounts.items():
        if not is_user_name(identity) or not isinstance(account, str) or not account:
            raise InvalidRequestError(f"the user map {path}: {identity} = {account!r} is not identity = "
                                      "\"account\" or \"uid:gid\"")
    if not all(is_user_name(name) for name in admins):
        raise InvalidRequestError(f"the user map {path}: [admins] names must be identities")
    return dict(accounts), frozenset(admins)


def switch_to(account: Account) -> None:
    """Become `account` for good, as a job process does before it unpickles anything: supplementary groups,
    then group, then user (root can do each only before the next), then its HOME, USER and LOGNAME, and a
    private umask. The process stays dumpable, so that its owner can debug it: nothing of the server is in
    its memory (it was forked by rpycdl.server.forkserver, which never held any)."""
    os.setgroups(list(account.groups) or [account.gid])
    os.setresgid(account.gid, account.gid, account.gid)
    os.setresuid(account.uid, account.uid, account.uid)
    os.environ.update(HOME=account.home, USER=account.user, LOGNAME=account.user)
    os.umask(JOB_UMASK)
