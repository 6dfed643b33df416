"""The relay reads claimed timestamps in UTC, whatever the server's TimeZone.

Its claim and settle sessions run ``SET TimeZone TO 'UTC'`` (backends/postgres/postgres.py,
``SESSION_UTC``): psycopg then builds each timestamptz without a zone conversion. The
instants must not move: an event written under another zone is claimed at the same time.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg

from outboxkit import Event, OutboundMessage, Outbox
from outboxkit.backends.postgres.queue_pg import PgQueueStore
from outboxkit.wire.kafka import encode_record


def _dsn_in_zone(dsn: str, zone: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params["options"] = f"-c TimeZone={zone}"
    return psycopg.conninfo.make_conninfo(**params)


async def test_claimed_times_are_utc_and_the_same_instants_under_another_server_zone(
    db_dsn: str,
) -> None:
    occurred = dt.datetime(2026, 3, 29, 1, 30, 15, 123456, tzinfo=dt.UTC)  # a DST night in Europe
    topic = "orders"
    dsn = _dsn_in_zone(db_dsn, "America/St_Johns")  # UTC-03:30: any slip shows
    with psycopg.connect(db_dsn) as conn, conn.transaction():
        Outbox(notify=False).put(
            conn, Event(topic=topic, event_type="t", payload={}, occurred_at=occurred)
        )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT created_at, current_setting('TimeZone') FROM outbox").fetchone()
    assert row is not None
    created, zone = row
    assert zone == "America/St_Johns" and created.utcoffset() != dt.timedelta(0)  # as a user sees

    store: PgQueueStore[Any] = PgQueueStore(dsn, "outbox", OutboundMessage)
    try:
        claim = await store.claim(
            limit=10, lease=30.0, token=uuid.uuid4(), owner="test", max_attempts=5
        )
        assert claim is not None
        [message] = claim.items
        assert message.created_at.tzinfo is dt.UTC and message.created_at == created
        assert message.occurred_at == occurred and message.occurred_at.tzinfo is dt.UTC
        headers, timestamp_ms = encode_record(message)
        assert dict(headers)["ce_time"] == b"2026-03-29T01:30:15.123456+00:00"
        assert timestamp_ms == int(occurred.timestamp() * 1000)
        await store.release(claim)
    finally:
        await store.close()
