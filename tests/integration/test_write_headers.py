"""An event without headers is sent as NULL and stored as '{}', through every write path.

The write sends no JSON for the common event without headers: the INSERT folds a
constant '{}' instead of parsing a document per row (store.postgres._VALUE). A row must
still read back as it always did, and a batch that mixes both kinds keeps each one's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import psycopg

from outboxkit import Event, Outbox
from tests.integration.test_write import shop_dsn as shop_dsn  # the fixture, shared
from tests.support.relaying import rows

TENANT = {"tenant": "acme"}


def _events() -> list[Event]:
    """Without headers, with, without: NULL and JSON side by side in one batch."""
    return [
        Event(topic="orders", event_type="order.placed", payload={"i": i}, headers=h)
        for i, h in enumerate([{}, TENANT, {}])
    ]


def _put(outbox: Outbox, conn: psycopg.Connection, events: list[Event]) -> None:
    with conn.transaction():
        for e in events:
            outbox.put(conn, e)


def _put_many(outbox: Outbox, conn: psycopg.Connection, events: list[Event]) -> None:
    with conn.transaction():
        outbox.put_many(conn, events)


def _execute_with(outbox: Outbox, conn: psycopg.Connection, events: list[Event]) -> None:
    with conn.transaction():
        outbox.execute_with(conn, "INSERT INTO orders (customer) VALUES ('ada')", events=events)


def _transaction(outbox: Outbox, conn: psycopg.Connection, events: list[Event]) -> None:
    with outbox.transaction(conn) as tx:
        for e in events:
            tx.put(e)


Write = Callable[[Outbox, psycopg.Connection, list[Event]], None]


WRITES: list[Write] = [_put, _put_many, _execute_with, _transaction]


def test_events_without_headers_read_back_as_an_empty_object(shop_dsn: str) -> None:
    # every statement variant: one row and many, with and without the ordered key locks
    with psycopg.connect(shop_dsn, autocommit=True) as conn:
        for ordered in (False, True):
            for write in WRITES:
                write(Outbox(ordered=ordered), conn, _events())
    assert [r["headers"] for r in rows(shop_dsn)] == [{}, TENANT, {}] * 2 * len(WRITES)


def test_asyncpg_writes_events_without_headers_as_an_empty_object(shop_dsn: str) -> None:
    async def write() -> None:
        conn = await asyncpg.connect(shop_dsn)
        try:
            async with conn.transaction():
                outbox = Outbox()
                await outbox.aput(conn, _events()[0])
                await outbox.aput_many(conn, _events())
        finally:
            await conn.close()

    asyncio.run(write())
    assert [r["headers"] for r in rows(shop_dsn)] == [{}, {}, TENANT, {}]
