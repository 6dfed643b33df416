"""outboxkit behind PgBouncer in transaction pooling mode (Debian's 1.18 on these machines).

Transaction pooling hands each transaction whichever server connection is free: session
state (prepared statements before 1.21, session advisory locks, LISTEN) does not follow
the client. Every test here talks to PostgreSQL only through a real PgBouncer, and checks
what reached the broker.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outboxkit.publishers.nats import NatsPublisher
from tests.support.pgbouncer import PgBouncer
from tests.support.relaying import count, make_events, running_relay, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream, unique_name

pytestmark = pytest.mark.asyncio


@pytest.fixture
def pooled_dsn(db_dsn: str, pgbouncer: PgBouncer) -> str:
    """The test's database through the transaction pooler."""
    return pgbouncer.dsn_for(psycopg.conninfo.conninfo_to_dict(db_dsn)["dbname"])


async def _stream(nats_server: Any) -> tuple[str, str]:
    root = unique_name("pgb")
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    return root, root.upper()


async def test_the_relay_behind_pgbouncer_publishes_the_whole_backlog(
    db_dsn: str, pooled_dsn: str, nats_server: Any
) -> None:
    """PgBouncer 1.18 keeps no prepared statement across transactions: psycopg's automatic
    ones (prepare_threshold=5) broke every claim after the first few batches."""
    root, stream = await _stream(nats_server)
    events = make_events(f"{root}.orders", 300)
    for i in range(0, 300, 30):  # several claims, each statement run more than 5 times
        write_events(pooled_dsn, events[i : i + 30])
    async with running_relay(
        pooled_dsn, NatsPublisher.from_url(nats_server.url), batch_size=10, max_in_flight=2
    ):
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
    msgs = await consume_nats(nats_server.url, stream, f"{root}.>", None)
    ids = {m.headers["Nats-Msg-Id"] for m in msgs}
    assert ids == {str(e.event_id) for e in events}
