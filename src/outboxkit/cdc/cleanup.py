"""Bulk removal of published table rows: the table source never updates a row per event.

The relay publishes inserted rows from the stream and leaves them as they are; the ids
the broker confirmed are collected and deleted in one statement every few seconds. The
WAL still holds the inserts, so a relay killed before confirming the slot re-publishes
them from the stream, deleted or not. A partitioned outbox table is never deleted from:
its expired partitions are dropped instead (``migrate --partition-by``'s maintenance);
``enabled=False`` turns removal off the same way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

import psycopg

from outboxkit._text import first_line
from outboxkit.store.cdc_sql import CdcRelayStatements

log = logging.getLogger("outboxkit.relay")

#: Ids per DELETE; more wait for the next pass (the WAL keeps the rows' inserts anyway).
_CHUNK = 20_000
#: Ids remembered at most while deletes fail (past it, rows stay: `outboxkit purge` territory).
_MAX_IDS = 1_000_000


class Cleanup:
    """Collects ids of published rows and deletes them in bulk every ``interval`` seconds."""

    def __init__(
        self, dsn: str, table: str, *, enabled: bool = True, interval: float = 5.0
    ) -> None:
        self.dsn = dsn
        self.table = table
        self.enabled = enabled
        self.interval = interval
        self.deleted = 0
        self._sql = CdcRelayStatements(table)
        self._ids: list[int] = []
        self._last = time.monotonic()
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def check(self) -> None:
        """Turn removal off for a partitioned table (partitions are dropped, not deleted from)."""
        if not self.enabled:
            return
        try:
            conn = await self._connection()
            cur = await conn.execute(self._sql.cdc_is_partitioned, (self._sql.qualified,))
            row = await cur.fetchone()
        except psycopg.Error as exc:
            log.warning(
                "could not tell whether %s is partitioned (%s)", self.table, first_line(exc)
            )
            return
        if row is not None and row[0]:
            self.enabled = False
            log.info(
                "table %s is partitioned: published rows are left to partition retention",
                self.table,
            )

    def add(self, ids: Iterable[int]) -> None:
        if self.enabled and len(self._ids) < _MAX_IDS:
            self._ids.extend(ids)

    async def flush(self, *, force: bool = False) -> None:
        """Delete what was collected once ``interval`` passed (or ``force``); a failure keeps it."""
        if not self._ids or (not force and time.monotonic() - self._last < self.interval):
            return
        self._last = time.monotonic()
        while self._ids:
            chunk = self._ids[:_CHUNK]
            try:
                conn = await self._connection()
                cur = await conn.execute(self._sql.cdc_delete_published, (chunk,))
            except psycopg.Error as exc:
                log.warning(
                    "could not remove %d published row(s) (%s); retrying later",
                    len(self._ids),
                    first_line(exc),
                )
                if self._conn is not None and self._conn.broken:
                    with contextlib.suppress(Exception):
                        await self._conn.close()
                return
            self.deleted += cur.rowcount
            del self._ids[: len(chunk)]
            if not force:
                return

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=10,
                application_name="outboxkit-relay:cleanup",
            )
        return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None
