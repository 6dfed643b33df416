"""Every broker carries an event whole: id, type, key, headers, payload bytes, time, schema.

What arrives is read back with the consumer side's own decoder, so this is the wire
format's round trip through a real broker and the real relay; each harness then checks
what its binding adds (AMQP properties, Redis fields, SQS attributes, native ids).
"""

from __future__ import annotations

import datetime as dt

import pytest

from outboxkit import Event
from outboxkit.publishers import from_url
from tests.integration.brokers.harness import BROKERS, IN_PROCESS, BrokerHarness
from tests.support.relaying import count, running_relay, wait_for, write_events

pytestmark = pytest.mark.parametrize("broker", [*BROKERS, *IN_PROCESS], indirect=True)

TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def _events(topic: str) -> list[Event]:
    occurred = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)
    return [
        Event(
            topic=topic,
            event_type="order.placed",
            payload={"order": 1, "note": "é ✓"},
            key="customer-1",
            aggregate_type="order",
            aggregate_id="1",
            headers={"tenant": "acme", "traceparent": TRACEPARENT},
            occurred_at=occurred,
            schema_version=3,
        ),
        Event(
            topic=topic,
            event_type="file.raw",
            payload=b"\x00\xff\xfe binary",
            headers={"content-type": "application/octet-stream"},
        ),
        Event(
            topic=topic,
            event_type="note.added ✓ 100%",
            payload="bell \x07 ✓".encode(),
            key="clé 100%",
            aggregate_type="note",
            aggregate_id="n/1 ✓",
            schema_version="v2 ✓",
        ),
    ]


async def test_committed_events_arrive_whole_with_key_headers_payload_and_time(
    db_dsn: str, broker: BrokerHarness
) -> None:
    await broker.open(cuttable=False)
    topic = await broker.destination()
    events = _events(topic)
    write_events(db_dsn, events)
    async with running_relay(db_dsn, from_url(broker.publisher_url)):
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the relay drains")
    fetched = await broker.fetch(topic, len(events))
    decoded = [(broker.decode(topic, raw), raw) for raw in fetched]
    received = {got.event_id: (got, raw) for got, raw in decoded}
    assert len(fetched) == len(events), "each event arrived once"
    assert set(received) == {e.event_id for e in events}, "each event arrived"
    if broker.ordered:
        assert [got.event_id for got, _ in decoded] == [e.event_id for e in events]
    for event in events:
        got, raw = received[event.event_id]
        assert got.event_type == event.event_type
        assert got.key == event.key
        assert got.payload == event.payload, "payload bytes unchanged"
        user = {k: v for k, v in event.headers.items() if k != "content-type"}
        assert {k.lower(): v for k, v in got.headers.items()} == user
        assert got.content_type == event.headers.get("content-type", "application/json")
        assert got.occurred_at == event.occurred_at
        assert got.schema_version == event.schema_version
        assert got.aggregate_type == event.aggregate_type
        assert got.aggregate_id == event.aggregate_id
        broker.check_binding(event, raw)
