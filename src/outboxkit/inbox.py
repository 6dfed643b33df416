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

from outboxkit.drivers import (
    AsyncConnection,
    Statement,
    SyncConnection,
    Use,
    async_adapter,
    sync_adapter,
)
from outboxkit.store.inbox_sql import DEFAULT_INBOX_TABLE, InboxStatements
from outboxkit.store.postgres import numbered

__all__ = ["Inbox"]

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
        self._sql = InboxStatements(table)
        self._mark = Statement(self._sql.mark, numbered(self._sql.mark))
        self._seen = Statement(self._sql.is_processed, numbered(self._sql.is_processed))

    def __repr__(self) -> str:
        return f"Inbox(table={self.table!r})"

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
        return sync_adapter(conn, _INBOX).fetch_flag(conn, self._mark, params)

    def seen(self, conn: SyncConnection, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Whether ``consumer`` already processed the event (committed, or in this transaction)."""
        params = (_consumer(consumer), _event_id(event_id))
        return sync_adapter(conn, _INBOX).fetch_flag(conn, self._seen, params)

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
        return await async_adapter(conn, _INBOX).fetch_flag(conn, self._mark, params)

    async def aseen(self, conn: AsyncConnection, consumer: str, event_id: uuid.UUID | str) -> bool:
        """Async :meth:`seen`."""
        params = (_consumer(consumer), _event_id(event_id))
        return await async_adapter(conn, _INBOX).fetch_flag(conn, self._seen, params)


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
