"""psycopg 3 ``Connection`` and ``AsyncConnection``: the fast path of the write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from outboxkit.drivers import psycopg_private as private
from outboxkit.drivers.base import AsyncAdapter, CursorCache, Statement, SyncAdapter
from outboxkit.errors import NotInTransactionError

_ACTIVE = TransactionStatus.ACTIVE
_INTRANS = TransactionStatus.INTRANS
_INERROR = TransactionStatus.INERROR


def check_usable(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> int:
    """Refuse a closed connection or a failed transaction; return the transaction status
    (libpq's int: a ``TransactionStatus`` built per call cost 0.5-1 µs a write)."""
    if conn.closed:
        raise NotInTransactionError("the psycopg connection is closed")
    status = conn.pgconn.transaction_status  # conn.info builds a new object per access
    if status == _INERROR:
        raise NotInTransactionError(
            "the transaction has already failed (an earlier statement raised);"
            " roll back and retry the whole unit of work"
        )
    return status


def check_in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Refuse unless a statement on ``conn`` would run in the caller's transaction."""
    status = check_usable(conn)
    # Pipeline mode: statements are queued and libpq cannot tell whether a BEGIN is
    # among them without a round trip. psycopg counts its open transaction() blocks;
    # a non-autocommit connection has begun one implicitly.
    if status == _ACTIVE and (not conn.autocommit or private.open_transaction_blocks(conn) > 0):
        return
    if conn.autocommit and status != _INTRANS:
        raise NotInTransactionError(
            "the psycopg connection is in autocommit mode with no transaction open;"
            " write inside `with conn.transaction():` so the event commits with your change"
        )


class PsycopgSync(SyncAdapter):
    label = "psycopg.Connection"
    modules = ()  # told apart by class: psycopg has both kinds

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return issubclass(conn_type, psycopg.Connection)

    def check(self, conn: psycopg.Connection[Any]) -> None:
        check_in_transaction(conn)

    def execute(
        self,
        conn: psycopg.Connection[Any],
        stmt: Statement,
        params: Sequence[Any],
        cursors: CursorCache | None,
    ) -> None:
        check_in_transaction(conn)
        self.run(conn, stmt, params, cursors)

    def fetch_value(
        self, conn: psycopg.Connection[Any], stmt: Statement, params: Sequence[Any]
    ) -> Any:
        check_in_transaction(conn)
        return self.run_fetch_value(conn, stmt, params)

    def joins(self, conn: psycopg.Connection[Any]) -> bool:
        # psycopg begins the wrapper's transaction with the first statement, as it
        # would for the wrapper itself; only a closed or failed connection is refused.
        check_usable(conn)
        return True

    def run(
        self,
        conn: psycopg.Connection[Any],
        stmt: Statement,
        params: Sequence[Any],
        cursors: CursorCache | None,
    ) -> None:
        if cursors is None:
            conn.execute(stmt.text, params)
            return
        cached = cursors.entry
        if cached is not None and cached[0] is conn:
            cursor = cached[1]
        else:
            cursor = conn.cursor()
            cursors.entry = (conn, cursor)
        cursor.execute(stmt.text, params)

    def run_fetch_value(
        self, conn: psycopg.Connection[Any], stmt: Statement, params: Sequence[Any]
    ) -> Any:
        row = conn.execute(stmt.text, params).fetchone()
        return row[0] if row else None


class PsycopgAsync(AsyncAdapter):
    label = "psycopg.AsyncConnection"
    modules = ()  # told apart by class: psycopg has both kinds

    @classmethod
    def handles(cls, conn_type: type) -> bool:
        return issubclass(conn_type, psycopg.AsyncConnection)

    def check(self, conn: psycopg.AsyncConnection[Any]) -> None:
        check_in_transaction(conn)

    async def execute(
        self,
        conn: psycopg.AsyncConnection[Any],
        stmt: Statement,
        params: Sequence[Any],
        cursors: CursorCache | None,
    ) -> None:
        check_in_transaction(conn)
        await self.run(conn, stmt, params, cursors)

    async def fetch_value(
        self, conn: psycopg.AsyncConnection[Any], stmt: Statement, params: Sequence[Any]
    ) -> Any:
        check_in_transaction(conn)
        return await self.run_fetch_value(conn, stmt, params)

    def joins(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        check_usable(conn)
        return True

    async def run(
        self,
        conn: psycopg.AsyncConnection[Any],
        stmt: Statement,
        params: Sequence[Any],
        cursors: CursorCache | None,
    ) -> None:
        if cursors is None:
            await conn.execute(stmt.text, params)
            return
        cached = cursors.entry
        if cached is not None and cached[0] is conn:
            cursor = cached[1]
        else:
            cursor = conn.cursor()
            cursors.entry = (conn, cursor)
        await cursor.execute(stmt.text, params)

    async def run_fetch_value(
        self, conn: psycopg.AsyncConnection[Any], stmt: Statement, params: Sequence[Any]
    ) -> Any:
        cur = await conn.execute(stmt.text, params)
        row = await cur.fetchone()
        return row[0] if row else None
