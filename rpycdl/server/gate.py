"""The server parent's gate: every connection is accepted, greeted and authenticated here, many at once in one
loop over non-blocking sockets (rpycdl.security.handshake), before it gets a process of its own; it bounds the
connections still authenticating (--max-startups, with random early drop between its low and high marks, as
OpenSSH's MaxStartups), those of one source address (--per-source-startups) and the time each may take, and
hands on the connections that got in (DLServer forks or wakes their connection process).

A connection that has not authenticated costs a socket and a few objects here: memory, no process. A new one
from a source at its bound replaces the oldest of that source's that has sent nothing yet, so that a flood of
silent connections from one address cannot keep a user of the same address out: rpycdl's client says hello
(rpycdl.security.auth.HELLO) as soon as it is connected, before it waits in the listening socket's queue, so its
connection has spoken by the time the gate takes it. A new one is dropped itself only when all of its source's
are talking.
"""

from __future__ import annotations

import random
import selectors
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from rpycdl.defaults import ACCEPT_BATCH, ACCEPT_DEFER
from rpycdl.errors import AuthFailedError, InvalidRequestError
from rpycdl.security import auth
from rpycdl.security.handshake import ServerCredentials, ServerHandshake
from rpycdl.server.drops import Tally

AUTH_FAILED = "authentication failed"


@dataclass(frozen=True)
class Startups:
    """--max-startups LOW:RATE:HIGH and --per-source-startups, and the grace time of a handshake."""

    low: int
    rate: int  # percent
    high: int
    per_source: int
    grace: float

    def drop_chance(self, pending: int) -> float:
        """The probability that a new connection is dropped while `pending` others are authenticating."""
        if pending < self.low:
            return 0.0
        if pending >= self.high:
            return 1.0
        return (self.rate + (100 - self.rate) * (pending - self.low) / (self.high - self.low)) / 100


def parse_max_startups(text: str, ceiling: int) -> tuple[int, int, int]:
    """LOW:RATE:HIGH (or N, for N:100:N) as --max-startups takes it.

    Raises:
        InvalidRequestError: not that, LOW above HIGH, RATE over 100, or HIGH over `ceiling`.
    """
    parts = text.split(":")
    try:
        low, rate, high = (int(parts[0]), 100, int(parts[0])) if len(parts) == 1 else map(int, parts)
    except ValueError:
        raise InvalidRequestError(f"--max-startups takes LOW:RATE:HIGH such as 64:30:256, or N: not {text!r}") from None
    if not (1 <= low <= high <= ceiling and 0 <= rate <= 100):
        raise InvalidRequestError(f"--max-startups {text}: need 1 <= LOW <= HIGH <= {ceiling} and RATE from 0 to 100")
    return low, rate, high


@dataclass(eq=False)
class _Startup:
    handshake: ServerHandshake
    source: str
    fd: int  # the socket's, kept: a failed handshake may have closed it


class Gate:
    """The gate of one listening socket. turn() waits for something to happen (a connection, a handshake's
    bytes, one of the descriptors watch() was given), takes it, and returns the handshakes that completed."""

    def __init__(self, listener: socket.socket, credentials: ServerCredentials, startups: Startups,
                 tally: Tally, chance: Callable[[], float] = random.random) -> None:
        listener.setblocking(False)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, ACCEPT_DEFER)
        self._listener = listener
        self._credentials = credentials
        self._startups = startups
        self._tally = tally
        self._chance = chance
        self._pending: dict[int, _Startup] = {}  # by descriptor, oldest first
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)

    def watch(self, fd: int, callback: Callable[[], None]) -> None:
        """Call `callback` in a turn in which `fd` is readable."""
        self._selector.register(fd, selectors.EVENT_READ, callback)

    @property
    def pending(self) -> int:
        """How many connections are still authenticating."""
        return len(self._pending)

    def turn(self, timeout: float) -> list[tuple[ServerHandshake, str]]:
        """One turn: the handshakes that completed in it, each with its source address."""
        now = time.monotonic()
        nearest = min((s.handshake.deadline for s in self._pending.values()), default=now + timeout)
        events = self._selector.select(max(0.0, min(timeout, nearest - now)))
        done: list[tuple[ServerHandshake, str]] = []
        incoming = False
        for key, _ in events:
            if key.fileobj is self._listener:
                incoming = True
            elif callable(key.data):
                key.data()
            elif self._pending.get(key.fd) is key.data:  # (not dropped earlier in this turn)
                self._advance(key.data, done)
        if incoming:
            self._accept(done)
        self._expire()
        return done

    def _accept(self, done: list[tuple[ServerHandshake, str]]) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the listener closed: the next turn tries again
                return
            source = str(address[0])
            if not self._admit(sock, source):
                continue
            startup = _Startup(self._credentials.handshake(sock, self._startups.grace), source, sock.fileno())
            self._pending[startup.fd] = startup
            self._selector.register(startup.fd, selectors.EVENT_READ, startup)
            self._advance(startup, done)

    def _admit(self, sock: socket.socket, source: str) -> bool:
        """Whether a new connection may start its handshake, making room for it if its source is at its bound."""
        limits = self._startups
        mine = [s for s in self._pending.values() if s.source == source]
        if len(mine) >= limits.per_source:
            silent = next((s for s in mine if not s.handshake.heard), None)
            why = f"over --per-source-startups ({limits.per_source} connections of one address still authenticating)"
            if silent is None:
                self._tally.dropped(source, "per_source", why)
                auth.drop(sock, f"{why}; try again")
                return False
            self._drop(silent, "per_source", why)
            return True
        if self._chance() < limits.drop_chance(len(self._pending)):
            why = (f"over --max-startups ({len(self._pending)} connections still authenticating, "
                   f"{limits.low}:{limits.rate}:{limits.high})")
            self._tally.dropped(source, "startups", why)
            auth.drop(sock, f"{why}; try again")
            return False
        return True

    def _advance(self, startup: _Startup, done: list[tuple[ServerHandshake, str]]) -> None:
        try:
            complete = startup.handshake.advance()
        except AuthFailedError as exc:
            self._forget(startup)
            startup.handshake.sock.close()
            self._tally.refused(startup.source, "auth", AUTH_FAILED, str(exc))
            return
        if complete:
            self._forget(startup)
            done.append((startup.handshake, startup.source))

    def _expire(self) -> None:
        now = time.monotonic()
        for startup in [s for s in self._pending.values() if s.handshake.deadline <= now]:
            failed = startup.handshake.failed
            if failed is not None:  # it lingered after a failed TLS handshake
                self._forget(startup)
                startup.handshake.sock.close()
                self._tally.refused(startup.source, "auth", AUTH_FAILED, str(failed))
            elif not startup.handshake.heard and not self._credentials.mode:
                # a client with credentials waits for a greeting that a server without authentication never
                # sends: it is told so, rather than to try again
                self._drop(startup, "grace", f"nothing said in {self._startups.grace:g} s", unasked=True)
            else:
                self._drop(startup, "grace", f"handshake not completed in {self._startups.grace:g} s")

    def _drop(self, startup: _Startup, reason: str, why: str, unasked: bool = False) -> None:
        self._forget(startup)
        self._tally.dropped(startup.source, reason, why)
        sock = startup.handshake.sock
        if unasked:
            auth.unasked(sock, why)
        else:
            auth.drop(sock, None if isinstance(sock, ssl.SSLSocket) else f"{why}; try again")

    def _forget(self, startup: _Startup) -> None:
        del self._pending[startup.fd]
        self._selector.unregister(startup.fd)

    def close_in_child(self) -> None:
        """In a process just forked from the gate's: close its copies of the connections still authenticating
        (the gate drops them; a copy would keep them open) and of the listening socket."""
        for startup in self._pending.values():
            startup.handshake.sock.close()
        self._selector.close()
        self._listener.close()

    def close(self) -> None:
        """Close every connection still authenticating, and the selector (not the listening socket)."""
        for startup in list(self._pending.values()):
            self._forget(startup)
            startup.handshake.sock.close()
        self._selector.close()
