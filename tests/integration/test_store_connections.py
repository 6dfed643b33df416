"""A PostgreSQL queue store opens one connection per role, however many callers ask at once.

Counting a fleet's connections (docs/fleet.md) found a relay with two settle connections:
its first batches settled at once, each found no settle connection yet and opened one, and
the first was dropped while open. The store now connects once per role.
"""

from __future__ import annotations

import asyncio

import psycopg

from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.publishers.base import OutboundMessage


def _held(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name LIKE 'outboxkit-relay:%'"
            " GROUP BY 1"
        ).fetchall()
    return {name: int(n) for name, n in rows}


async def test_settles_that_start_at_once_share_one_new_connection(db_dsn: str) -> None:
    store = PgQueueStore(db_dsn, "outbox", OutboundMessage)
    try:
        settles = await asyncio.gather(*(store._connection("settle") for _ in range(4)))
        claims = await asyncio.gather(*(store._connection("claim") for _ in range(4)))
        assert len({id(conn) for conn in settles}) == 1
        assert len({id(conn) for conn in claims}) == 1
        assert _held(db_dsn) == {"outboxkit-relay:settle": 1, "outboxkit-relay:claim": 1}
    finally:
        await store.close()
    assert _held(db_dsn) == {}
