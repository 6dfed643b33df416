"""The inbox: a consumer applies each event once, by recording its id in the same transaction.

At-least-once delivery plus a ``(consumer_name, event_id)`` primary key written
in the consumer's own transaction gives exactly-once *effects*: the record and
the side effect commit together or not at all, and a redelivered event finds
its record and is skipped. Like the write side, the inbox refuses to run where
it could not be atomic with the caller's change (autocommit, a pool, no
transaction begun).

The same ``Inbox`` serves PostgreSQL and MariaDB/MySQL: it asks the connection's backend
(``backends.backend_of``) for its statements (``Backend.inbox_sql``: PostgreSQL's
``backends/postgres/inbox_sql.py``, or MariaDB's, where the record is an ``INSERT IGNORE``
and a consumer name is at most 255 characters), once per database kind.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, NamedTuple

from outboxkit.backends import Backend, backend_for, backend_of
from outboxkit.backends.ports import InboxSql
from outboxkit.backends.postgres.inbox_sql import DEFAULT_INBOX_TABLE
from outboxkit.drivers import (
    AsyncConnection,
    Statement,
    SyncConnection,
    Use,
    async_adapter,
    sync_adapter,
)

__all__ = ["Inbox"]

_POSTGRES = backend_for("postgresql://")

_INBOX = Use(
    action="use the inbox",
    inside="use the inbox inside its transaction",
    sync_methods="handle()/mark()/seen()",
    async_methods="ahandle()/amark()/aseen()",
)


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
        # PostgreSQL's now (the table name checked at construction); another database's
        # at its first use (its own quoting).
        self._sql: dict[Backend, tuple[_Statements, InboxSql]] = {}
        self._statements(_POSTGRES)

    def __repr__(self) -> str:
        return f"Inbox(table={self.table!r})"

    def _statements(self, backend: Backend) -> tuple[_Statements, InboxSql]:
        found = self._sql.get(backend)
        if found is None:
            sql = backend.inbox_sql(self.table)
            statements = _Statements(
                Statement(sql.mark, sql.mark_dollar),
                Statement(sql.is_processed, sql.is_processed_dollar),
            )
            found = self._sql[backend] = (statements, sql)
        return found

    def _for(self, conn: Any, consumer: str) -> _Statements:
        """The statements of ``conn``'s database; ``consumer`` checked against its column."""
        statements, sql = self._statements(backend_of(conn))
        sql.check_consumer(consumer)
        return statements

    # -- sync -----------------------------------------------------------------

    @contextmanager
    def handle(
        self, conn: SyncConnection, consumer: str, event_id: uuid.UUID | str
    ) -> Iterator[bool]:
        """Record the event for ``consumer``; yields True if it is new (apply it), else False."""
        yield self.mark(conn, consumer, event_id)

    def mark(self, conn: SyncConnection, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Insert the record in ``conn``'s open transaction; True if it was not there yet."""
        params = (_consumer(consumer), _event_id(event_id))
        adapter = sync_adapter(conn, _INBOX)
        return adapter.fetch_flag(conn, self._for(conn, consumer).mark, params)

    def seen(self, conn: SyncConnection, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Whether ``consumer`` already processed the event (committed, or in this transaction)."""
        params = (_consumer(consumer), _event_id(event_id))
        adapter = sync_adapter(conn, _INBOX)
        return adapter.fetch_flag(conn, self._for(conn, consumer).seen, params)

    # -- async ----------------------------------------------------------------

    @asynccontextmanager
    async def ahandle(
        self, conn: AsyncConnection, consumer: str, event_id: uuid.UUID | str
    ) -> AsyncIterator[bool]:
        """Async :meth:`handle`: psycopg ``AsyncConnection``, asyncpg, SQLAlchemy async."""
        yield await self.amark(conn, consumer, event_id)

    async def amark(self, conn: AsyncConnection, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Async :meth:`mark`."""
        params = (_consumer(consumer), _event_id(event_id))
        adapter = async_adapter(conn, _INBOX)
        return await adapter.fetch_flag(conn, self._for(conn, consumer).mark, params)

    async def aseen(self, conn: AsyncConnection, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Async :meth:`seen`."""
        params = (_consumer(consumer), _event_id(event_id))
        adapter = async_adapter(conn, _INBOX)
        return await adapter.fetch_flag(conn, self._for(conn, consumer).seen, params)


class _Statements(NamedTuple):
    mark: Statement
    seen: Statement


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
