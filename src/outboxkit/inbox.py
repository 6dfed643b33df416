"""The inbox: a consumer applies each event once, by recording its id in the same transaction.

At-least-once delivery plus a ``(consumer_name, event_id)`` primary key written
in the consumer's own transaction gives exactly-once *effects*: the record and
the side effect commit together or not at all, and a redelivered event finds
its record and is skipped. Like the write side, the inbox refuses to run where
it could not be atomic with the caller's change (autocommit, a pool, no
transaction begun).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg

from outboxkit._transactions import (
    check_dbapi_autocommit,
    check_psycopg,
    for_paramstyle,
    is_asyncpg_connection,
    sqlalchemy_async_connection,
    sqlalchemy_sync_connection,
    type_name,
)
from outboxkit.errors import NotInTransactionError
from outboxkit.store.inbox_sql import DEFAULT_INBOX_TABLE, InboxStatements
from outboxkit.store.postgres import numbered

__all__ = ["Inbox"]


class Inbox:
    """Records processed events per consumer in one table (``outboxkit migrate --inbox``).

    ::

        with conn.transaction(), inbox.handle(conn, "billing", event.event_id) as fresh:
            if fresh:
                charge(conn, event)  # runs once per event, commits with the record

    An exception in the block propagates and must abort the transaction (it
    does with ``conn.transaction()``/``session.begin()``): the record then
    rolls back with the effect and the redelivered event is applied.
    """

    def __init__(self, table: str = DEFAULT_INBOX_TABLE) -> None:
        self.table = table
        self._sql = InboxStatements(table)
        self._mark_dollar = numbered(self._sql.mark)
        self._seen_dollar = numbered(self._sql.is_processed)

    def __repr__(self) -> str:
        return f"Inbox(table={self.table!r})"

    # -- sync -----------------------------------------------------------------

    @contextmanager
    def handle(self, conn: Any, consumer: str, event_id: uuid.UUID | str) -> Iterator[bool]:
        """Record the event for ``consumer``; yields True if it is new (apply it), else False."""
        yield self.mark(conn, consumer, event_id)

    def mark(self, conn: Any, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Insert the record in ``conn``'s open transaction; True if it was not there yet."""
        return self._fetch_sync(conn, self._sql.mark, self._mark_dollar, consumer, event_id)

    def seen(self, conn: Any, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Whether ``consumer`` already processed the event (committed, or in this transaction)."""
        return self._fetch_sync(conn, self._sql.is_processed, self._seen_dollar, consumer, event_id)

    def _fetch_sync(
        self, conn: Any, stmt: str, stmt_dollar: str, consumer: str, event_id: uuid.UUID | str
    ) -> bool:
        params = (_consumer(consumer), _event_id(event_id))
        if isinstance(conn, psycopg.Connection):
            check_psycopg(conn)
            row = conn.execute(stmt, params).fetchone()
            return bool(row and row[0])
        sa = sqlalchemy_sync_connection(conn)
        if sa is not None:
            check_dbapi_autocommit(sa.connection.dbapi_connection, conn)
            sql = for_paramstyle(sa.dialect.paramstyle, stmt, stmt_dollar)
            first = sa.exec_driver_sql(sql, (params[0], str(params[1]))).first()
            return bool(first and first[0])
        raise _unsupported(conn, async_api=False)

    # -- async ----------------------------------------------------------------

    @asynccontextmanager
    async def ahandle(
        self, conn: Any, consumer: str, event_id: uuid.UUID | str
    ) -> AsyncIterator[bool]:
        """Async :meth:`handle`: psycopg ``AsyncConnection``, asyncpg, SQLAlchemy async."""
        yield await self.amark(conn, consumer, event_id)

    async def amark(self, conn: Any, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Async :meth:`mark`."""
        return await self._fetch_async(conn, self._sql.mark, self._mark_dollar, consumer, event_id)

    async def aseen(self, conn: Any, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Async :meth:`seen`."""
        return await self._fetch_async(
            conn, self._sql.is_processed, self._seen_dollar, consumer, event_id
        )

    async def _fetch_async(
        self, conn: Any, stmt: str, stmt_dollar: str, consumer: str, event_id: uuid.UUID | str
    ) -> bool:
        params = (_consumer(consumer), _event_id(event_id))
        if isinstance(conn, psycopg.AsyncConnection):
            check_psycopg(conn)
            cur = await conn.execute(stmt, params)
            row = await cur.fetchone()
            return bool(row and row[0])
        if is_asyncpg_connection(conn):
            if conn.is_closed() or not conn.is_in_transaction():
                raise NotInTransactionError(
                    "asyncpg connection has no open transaction; use the inbox inside"
                    " `async with conn.transaction():` so the record commits with your change"
                )
            return bool(await conn.fetchval(stmt_dollar, *params))
        sa = await sqlalchemy_async_connection(conn)
        if sa is not None:
            sync_conn = sa.sync_connection
            assert sync_conn is not None
            check_dbapi_autocommit(sync_conn.connection.dbapi_connection, conn)
            sql = for_paramstyle(sync_conn.dialect.paramstyle, stmt, stmt_dollar)
            result = await sa.exec_driver_sql(sql, (params[0], str(params[1])))
            first = result.first()
            return bool(first and first[0])
        raise _unsupported(conn, async_api=True)


def _consumer(consumer: str) -> str:
    if not isinstance(consumer, str) or not consumer.strip():
        raise ValueError("the consumer name must be a non-empty string, e.g. 'billing'")
    return consumer


def _event_id(event_id: uuid.UUID | str) -> uuid.UUID:
    if isinstance(event_id, uuid.UUID):
        return event_id
    try:
        return uuid.UUID(str(event_id))
    except ValueError:
        raise ValueError(f"event id {event_id!r} is not a UUID") from None


def _unsupported(conn: Any, *, async_api: bool) -> Exception:
    name = type_name(conn)
    if "pool" in name.lower():
        return NotInTransactionError(
            f"got a connection pool ({name}); take a connection and use the inbox inside"
            " its transaction"
        )
    if async_api:
        hint = (
            "psycopg.AsyncConnection, asyncpg.Connection or SQLAlchemy AsyncSession/AsyncConnection"
        )
        if isinstance(conn, psycopg.Connection) or type(conn).__module__.startswith("sqlalchemy"):
            hint += " (this is a sync connection: use handle()/mark()/seen())"
    else:
        hint = "psycopg.Connection or SQLAlchemy Session/Connection"
        if isinstance(conn, psycopg.AsyncConnection) or type(conn).__module__.startswith(
            ("asyncpg", "sqlalchemy.ext.asyncio")
        ):
            hint += " (this is an async connection: use ahandle()/amark()/aseen())"
    return TypeError(f"cannot use the inbox through {name}; expected {hint}")
