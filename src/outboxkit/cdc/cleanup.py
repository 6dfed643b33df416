"""Bulk removal of published table rows: the table source never updates a row per event.

The relay publishes inserted rows from the stream and leaves them as they are; the ids
the broker confirmed are collected and deleted in one statement before the slot is
confirmed past them (so a relay killed after a confirm leaves no published row behind),
or every ``interval`` seconds. The WAL still holds the inserts, so a relay killed before
confirming the slot re-publishes them from the stream, deleted or not.

The stream delivers a transaction as soon as its commit record is flushed, which is a
moment before the committing backend ends it in the ProcArray: a DELETE in that moment does
not see its rows yet (``outboxkit demo --source cdc`` under load left ~1 % of the rows so).
When a DELETE removes fewer rows than it was given, the transactions that inserted them
(pgoutput's Begin carries their xid) are waited for until a new snapshot sees them, and the
DELETE is run again; rows whose transactions are visible and still not there are gone
already (deleted before a restart re-streamed them).

A partitioned outbox table (``migrate --partition-by``) is never deleted from: every
``partition_interval`` seconds the relay drops the partitions whose rows all committed
before its last confirmed commit (``store.partitions.drop_published_partitions``; dead
letters keep theirs). ``enabled=False`` turns removal off.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from outboxkit._text import first_line
from outboxkit.backends.postgres.cdc_sql import CdcRelayStatements
from outboxkit.cdc._db import OwnConnection

log = logging.getLogger("outboxkit.relay")

#: Ids per DELETE; more wait for the next pass (the WAL keeps the rows' inserts anyway).
_CHUNK = 20_000
#: Ids remembered at most while deletes fail (past it, rows stay: `outboxkit purge` territory).
_MAX_IDS = 1_000_000
#: Seconds a pass waits for the inserting transactions to become visible; past it the rows
#: are kept for the next pass (and the slot not confirmed past them meanwhile).
_VISIBLE_WITHIN = 1.0


class Cleanup:
    """Collects ids of published rows and deletes them in bulk every ``interval`` seconds."""

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        enabled: bool = True,
        interval: float = 5.0,
        partition_interval: float = 60.0,
        confirmed_through: Callable[[], dt.datetime | None] = lambda: None,
    ) -> None:
        self.dsn = dsn
        self.table = table
        self.enabled = enabled
        self.interval = interval
        self.deleted = 0
        self._sql = CdcRelayStatements(table)
        self._ids: list[int] = []
        self._xids: set[int] = set()  # of the transactions that inserted them
        self._last = time.monotonic()
        self.partitioned = False
        self.partition_interval = partition_interval
        self._confirmed_through = confirmed_through
        self._last_drop = time.monotonic()
        self._db = OwnConnection(dsn, "cleanup")

    async def check(self) -> None:
        """Turn removal off for a partitioned table (partitions are dropped, not deleted from)."""
        if not self.enabled:
            return
        try:
            conn = await self._db.get()
            cur = await conn.execute(self._sql.cdc_is_partitioned, (self._sql.qualified,))
            row = await cur.fetchone()
        except psycopg.Error as exc:
            log.warning(
                "could not tell whether %s is partitioned (%s)", self.table, first_line(exc)
            )
            return
        if row is not None and row[0]:
            self.partitioned = True
            log.info(
                "table %s is partitioned: published rows leave with their partition, dropped"
                " once every row in it is confirmed",
                self.table,
            )

    def add(self, rows: Iterable[tuple[int, int]]) -> None:
        """Collect published rows: (row id, xid of the transaction that inserted it)."""
        if self.enabled and not self.partitioned and len(self._ids) < _MAX_IDS:
            for row_id, xid in rows:
                self._ids.append(row_id)
                self._xids.add(xid)

    async def flush(self, *, force: bool = False) -> bool:
        """Delete what was collected once ``interval`` passed (or ``force``); a failure keeps it.

        Returns whether nothing collected is left: with ``force`` the relay confirms the
        slot only then, or a DELETE that failed (a timeout under load, a lost connection)
        followed by a confirm and a crash would leave published rows pending for good.
        """
        if self.partitioned:
            await self._drop_partitions()
            return True
        if not self._ids or (not force and time.monotonic() - self._last < self.interval):
            return not self._ids
        self._last = time.monotonic()
        retried = False
        while self._ids:
            chunk = self._ids[:_CHUNK]
            try:
                conn = await self._db.get()
                cur = await conn.execute(self._sql.cdc_delete_published, (chunk,))
                deleted = cur.rowcount
                if deleted < len(chunk) and not await self._visible(conn):
                    log.warning(
                        "rows to remove are not visible after %.0fs: their transactions have"
                        " not ended; retrying later, the slot is not confirmed past them",
                        _VISIBLE_WITHIN,
                    )
                    return False
                if deleted < len(chunk):
                    cur = await conn.execute(self._sql.cdc_delete_published, (chunk,))
                    deleted += cur.rowcount
            except psycopg.Error as exc:
                stale = await self._db.drop_if_lost()
                if stale and not retried:  # e.g. the server restarted since the last pass
                    retried = True
                    continue
                log.warning(
                    "could not remove %d published row(s) (%s); retrying later, the slot"
                    " is not confirmed past them meanwhile",
                    len(self._ids),
                    first_line(exc),
                )
                return False
            self.deleted += deleted
            del self._ids[: len(chunk)]
            if not force:
                break
        if not self._ids:
            self._xids.clear()
        return not self._ids

    async def _visible(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Wait until a new snapshot sees every collected transaction as ended (False: not
        within ``_VISIBLE_WITHIN`` seconds). Checked only when a DELETE missed rows."""
        xids = sorted(self._xids)
        deadline = time.monotonic() + _VISIBLE_WITHIN
        delay = 0.001
        while True:
            cur = await conn.execute(self._sql.cdc_not_visible, (xids,))
            row = await cur.fetchone()
            if row is None or not row[0]:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.05)

    async def _drop_partitions(self) -> None:
        through = self._confirmed_through()
        if through is None or time.monotonic() - self._last_drop < self.partition_interval:
            return
        self._last_drop = time.monotonic()
        from outboxkit.backends.postgres.partitions import drop_published_partitions

        try:
            await asyncio.to_thread(
                drop_published_partitions, self.dsn, self.table, confirmed_through=through
            )
        except Exception as exc:  # maintenance must never stop the stream
            log.warning("could not drop published partitions of %s (%s)", self.table, exc)

    async def close(self) -> None:
        await self._db.close()
