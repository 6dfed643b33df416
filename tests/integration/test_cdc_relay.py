"""The WAL relay (`--source cdc`) against a PostgreSQL with wal_level=logical and real brokers."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg

from outboxkit import Event
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.wal_envelope import encode_envelope, message_prefix
from tests.support.cdc_relaying import running_cdc_relay, setup_cdc, slot_lag
from tests.support.relaying import count, make_events, wait_for, write_events
from tests.support.servers import consume_nats, ensure_stream


def _topic(prefix: str = "orders") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _write_wal(dsn: str, events: list[Event], *, rollback: bool = False) -> None:
    """WAL-only events (as ``Outbox(storage="wal")`` writes them), in one transaction."""
    with psycopg.connect(dsn) as conn:
        with conn.cursor() as cur:
            for e in events:
                cur.execute(
                    "SELECT pg_logical_emit_message(true, %s, %s)",
                    (message_prefix("outbox"), encode_envelope(e)),
                )
        if rollback:
            conn.rollback()
        else:
            conn.commit()


async def test_table_inserts_and_wal_messages_arrive_at_nats_in_commit_order(
    logical_db_dsn: str, nats_server: Any
) -> None:
    slot = setup_cdc(logical_db_dsn)
    root = f"cdc{uuid.uuid4().hex[:8]}"
    await ensure_stream(nats_server.url, root.upper(), [f"{root}.>"])
    table_events = make_events(f"{root}.orders", 20)
    wal_events = make_events(f"{root}.orders", 20)
    write_events(logical_db_dsn, table_events[:10])
    _write_wal(logical_db_dsn, wal_events[:10])
    write_events(logical_db_dsn, table_events[10:])
    _write_wal(logical_db_dsn, wal_events[10:])
    expected = table_events[:10] + wal_events[:10] + table_events[10:] + wal_events[10:]
    async with running_cdc_relay(logical_db_dsn, NatsPublisher.from_url(nats_server.url)) as relay:
        await wait_for(lambda: relay.stats.published == 40, what="40 published")
        await wait_for(lambda: count(logical_db_dsn) == 0, what="table rows removed")
        await wait_for(lambda: slot_lag(logical_db_dsn, slot) < 1024, what="slot confirmed")
    msgs = await consume_nats(nats_server.url, root.upper(), f"{root}.>", 40, 20.0)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == [str(e.event_id) for e in expected]
    for m, e in zip(msgs, expected, strict=True):
        assert m.data == e.payload
        assert m.subject == e.topic
        assert m.headers["ce-type"] == "order.placed"
        assert m.headers["tenant"] == "acme"
        assert m.headers["ce-partitionkey"] == e.key
