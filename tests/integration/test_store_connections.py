"""A PostgreSQL queue store opens one connection per role, however many callers ask at once.

Counting a fleet's connections (docs/fleet.md) found a relay with two settle connections:
its first batches settled at once, each found no settle connection yet and opened one, and
the first was dropped while open. The store now connects once per role.
"""

from __future__ import annotations

import asyncio

from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.publishers.base import OutboundMessage
from tests.support.relaying import relay_connections


async def test_settles_that_start_at_once_share_one_new_connection(db_dsn: str) -> None:
    store = PgQueueStore(db_dsn, "outbox", OutboundMessage)
    try:
        settles = await asyncio.gather(*(store._connection("settle") for _ in range(4)))
        claims = await asyncio.gather(*(store._connection("claim") for _ in range(4)))
        assert len({id(conn) for conn in settles}) == 1
        assert len({id(conn) for conn in claims}) == 1
        held = relay_connections(db_dsn)
        assert held == {"outboxkit-relay:settle": 1, "outboxkit-relay:claim": 1}
    finally:
        await store.close()
    assert relay_connections(db_dsn) == {}
