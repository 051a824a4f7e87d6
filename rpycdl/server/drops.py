"""What the server parent's gate dropped or refused before a connection got a process, summed up: in the log,
one line per source and cause per interval (never a line, let alone a traceback, per connection), and in the
ledger's `drops` and `refusals` counts, which the monitor exports."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from rpycdl.defaults import DROP_COUNT_INTERVAL, DROP_LOG_INTERVAL
from rpycdl.scheduler.ledger import DROPS, Ledger

log = logging.getLogger("rpycdl.server")


class Tally:
    """The counts of one server's gate. dropped() and refused() are called by the gate as it goes; flush(),
    from the sweeper's thread, logs what each interval summed up and adds the counts to the ledger (whose
    writes may wait for another process's: never in the gate's loop)."""

    def __init__(self, ledger: Ledger, service: str, interval: float = DROP_LOG_INTERVAL) -> None:
        self._ledger = ledger
        self._service = service
        self._interval = interval
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], list] = {}  # (source, cause): [since, count after the first, detail]
        self._drops: Counter[str] = Counter()
        self._refusals: Counter[str] = Counter()
        self._counted = 0.0

    def dropped(self, source: str, reason: str, cause: str) -> None:
        """Count a connection dropped before it authenticated, for `reason` (one of DROPS)."""
        with self._lock:
            self._drops[reason] += 1
        self._note(source, f"dropped {{}} from {source}{{}}: {cause}", "")

    def refused(self, source: str, reason: str, cause: str, detail: str = "") -> None:
        """Count a connection refused (reason "auth", a failed handshake, or "connections", over
        --max-connections), `detail` saying what went wrong."""
        with self._lock:
            self._refusals[reason] += 1
        self._note(source, f"refused {{}} from {source}{{}}: {cause}", detail)

    def _note(self, source: str, line: str, detail: str) -> None:
        key = (source, line)
        with self._lock:
            window = self._windows.get(key)
            if window is not None:
                window[1] += 1
                window[2] = detail or window[2]
                return
            self._windows[key] = [time.monotonic(), 0, ""]
        log.warning(line.format("a connection", "") + (f" ({detail})" if detail else "")
                    + f"; more within {self._interval:.0f} s are summed up in one line")

    def flush(self, force: bool = False) -> None:
        """Log the intervals that ended (all of them if `force`), and add the counts to the ledger once every
        DROP_COUNT_INTERVAL (at once if `force`)."""
        now = time.monotonic()
        with self._lock:
            ended = [(key, window) for key, window in self._windows.items()
                     if force or now - window[0] >= self._interval]
            for key, _ in ended:
                del self._windows[key]
            counts = None
            if (force or now - self._counted >= DROP_COUNT_INTERVAL) and (self._drops or self._refusals):
                counts, self._drops, self._refusals = (self._drops, self._refusals), Counter(), Counter()
                self._counted = now
        for (_, line), (since, more, detail) in ended:
            if more:
                log.warning(line.format(f"{more} more connection{'s' if more > 1 else ''}",
                                        f" in {now - since:.0f} s") + (f" (the last: {detail})" if detail else ""))
        if counts is not None:
            drops, refusals = counts
            self._ledger.count_drops(self._service, {reason: drops[reason] for reason in DROPS if drops[reason]})
            for reason, count in refusals.items():
                self._ledger.count_refusal(self._service, reason, count)
