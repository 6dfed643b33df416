"""MariaDB/MySQL's :class:`~outboxkit.backends.ports.GaugeReader`: the metrics' kept PyMySQL
connection and its admin's live status (the same two bounded readings, in a thread)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from outboxkit.backends.mariadb import admin
from outboxkit.backends.ports import GaugeReader, GaugeRows, SlotReading
from outboxkit.errors import ConfigurationError, OutboxkitError


class MariaDBGaugeReader(GaugeReader):
    errors = (OutboxkitError,)

    def __init__(self, dsn: str, table: str, *, no_slot: str) -> None:
        self.dsn = dsn
        self.table = table
        self._no_slot = no_slot
        self._conn: Any = None

    async def read(self, cap: int) -> GaugeRows:
        try:
            if self._conn is None or not admin.usable(self._conn):
                self._conn = await asyncio.to_thread(admin.connect, self.dsn)
            live = await asyncio.to_thread(admin.live_status, self._conn, self.table, cap=cap)
        except OutboxkitError:
            await self.close()
            raise
        topics = live.status.topics
        return GaugeRows(
            [
                (t.topic, t.pending, t.in_flight, t.oldest_pending_age_s)
                for t in topics
                if t.pending or t.in_flight
            ],
            [(t.topic, t.failed) for t in topics if t.failed],
        )

    async def slot(self, slot: str) -> SlotReading:
        raise ConfigurationError(self._no_slot)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
