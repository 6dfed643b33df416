"""A connection of the WAL relay's own (dead letters, bulk removal): opened on first use,
reopened after a loss, autocommit (each statement is its own transaction)."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from outboxkit.backends.postgres._connection import aconnect


class OwnConnection:
    """One autocommit connection, named ``outboxkit-relay:<role>`` in pg_stat_activity."""

    def __init__(self, dsn: str, role: str) -> None:
        self.dsn = dsn
        self.role = role
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def get(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await aconnect(self.dsn, application_name=f"outboxkit-relay:{self.role}")
        return self._conn

    async def drop_if_lost(self) -> bool:
        """Forget a connection that broke (the next ``get`` reconnects); True if it had."""
        conn = self._conn
        if conn is None or not (conn.broken or conn.closed):
            return False
        await self.close()
        return True

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
