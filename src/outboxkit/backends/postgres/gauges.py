"""PostgreSQL's :class:`~outboxkit.backends.ports.GaugeReader`: the metrics' kept psycopg
connection, the two bounded gauge statements (``METRICS_*`` in postgres.py) and the WAL
relay's slot (``CDC_SLOT`` in cdc_sql.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from outboxkit.backends.ports import GaugeReader, GaugeRows, SlotReading
from outboxkit.backends.postgres import cdc_sql
from outboxkit.backends.postgres._connection import aconnect
from outboxkit.backends.postgres.postgres import Statements


class PgGaugeReader(GaugeReader):
    errors = (psycopg.Error,)

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn = dsn
        self._sql = Statements(table)
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            conn = self._conn = await aconnect(self.dsn, application_name="outboxkit-relay:metrics")
        return conn

    async def read(self, cap: int) -> GaugeRows:
        try:
            return await read_gauges(await self._connection(), self._sql, cap)
        except psycopg.Error:
            await self.close()
            raise

    async def slot(self, slot: str) -> SlotReading:
        try:
            return await read_slot(await self._connection(), slot)
        except psycopg.Error:
            await self.close()
            raise

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def read_gauges(conn: psycopg.AsyncConnection[Any], sql: Statements, cap: int) -> GaugeRows:
    """The table's gauges on ``conn`` (two bounded statements on the partial indexes)."""
    params = {"cap": cap}
    cur = await conn.execute(sql.metrics_pending_by_topic, params)
    pending = await cur.fetchall()
    cur = await conn.execute(sql.metrics_failed_by_topic, params)
    return GaugeRows(pending, await cur.fetchall())


async def read_slot(conn: psycopg.AsyncConnection[Any], slot: str) -> SlotReading:
    """``slot`` as pg_replication_slots reports it (one cheap statement)."""
    cur = await conn.execute(cdc_sql.CDC_SLOT, {"slot": slot})
    row = await cur.fetchone()
    if row is None:
        return SlotReading(None, "missing")
    return SlotReading(row[2], row[0].get("wal_status"))
