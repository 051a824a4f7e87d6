"""The job ledger's tallies, mixed into rpycdl.scheduler.ledger.Ledger: `refusals` counts the requests the host's
servers refused (count_refusal), `drops` the connections they dropped before authenticating them (count_drops)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rpycdl.defaults import REFUSAL_BUSY_TIMEOUT
from rpycdl.scheduler.schema import DROPS, REFUSALS

log = logging.getLogger("rpycdl.ledger")


class TalliesLedger:
    """The ledger's counts of refusals and drops, in its own transactions (`_write`, `_db`)."""

    path: Path
    _write: Callable[..., contextlib.AbstractContextManager[Any]]
    _db: Callable[[], contextlib.AbstractContextManager[Any]]

    def count_refusal(self, service: str, reason: str, count: int = 1) -> None:
        """Count `count` requests a server of `service` refused, for `reason` (one of REFUSALS). It never raises,
        and waits REFUSAL_BUSY_TIMEOUT at most for another write: a refusal goes to its client as it is."""
        self._count("refusals", REFUSALS, service, {reason: count})

    def count_drops(self, service: str, counts: dict[str, int]) -> None:
        """Add the connections a server of `service` dropped before they authenticated, by reason (of DROPS);
        as count_refusal, it never raises and waits little."""
        if counts:
            self._count("drops", DROPS, service, counts)

    def _count(self, table: str, reasons: tuple[str, ...], service: str, counts: dict[str, int]) -> None:
        try:
            if set(counts) - set(reasons):
                raise ValueError(f"not a reason of {table}: {sorted(set(counts) - set(reasons))}")
            with self._write(REFUSAL_BUSY_TIMEOUT) as db:
                db.executemany(f"INSERT INTO {table} VALUES (?, ?, ?) ON CONFLICT (service, reason) DO UPDATE SET "
                               "count = count + excluded.count", [(service, r, n) for r, n in counts.items()])
        except Exception as exc:
            log.warning("%s of %s (%s) were not counted in %s: %s", table, service, counts, self.path, exc)

    def refusals(self) -> dict[tuple[str, str], int]:
        """The requests the host's servers refused since the ledger was made, by (service, reason)."""
        with self._db() as db:
            return {(service, reason): count for service, reason, count in
                    db.execute("SELECT service, reason, count FROM refusals")}

    def drops(self) -> dict[tuple[str, str], int]:
        """The connections the host's servers dropped before they authenticated, by (service, reason)."""
        with self._db() as db:
            return {(service, reason): count for service, reason, count in
                    db.execute("SELECT service, reason, count FROM drops")}
