"""A broker outage never dead-letters a healthy event.

Before: every batch published while NATS was down failed with "not connected" or
``NoServersError`` and counted an attempt, so an outage longer than the retry
schedule dead-lettered healthy events (the chaos run found 253 of 7 613 after a
few 3-second outages with max_attempts=4). Now a publish the broker never judged
is handed back with the attempt refunded, paced by a per-relay backoff.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.testing import EmbeddedNats
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka, consume_nats, ensure_stream


async def test_events_written_during_a_nats_outage_are_not_dead_lettered(
    db_dsn: str, fresh_nats: EmbeddedNats
) -> None:
    suffix = uuid.uuid4().hex[:8]
    stream, subject = f"OUTAGE{suffix.upper()}", f"outage{suffix}.orders"
    await ensure_stream(fresh_nats.url, stream, [f"outage{suffix}.>"])
    publisher = NatsPublisher.from_url(f"{fresh_nats.url}?stream={stream}&timeout=1")
    options: dict[str, Any] = {"max_attempts": 2, "retry_base": 0.05, "retry_cap": 0.3}
    async with running_relay(db_dsn, publisher, **options):
        write_events(db_dsn, make_events(subject, 20))
        await wait_for(lambda: count(db_dsn) == 0, what="the first events to be published")
        fresh_nats.stop()
        write_events(db_dsn, make_events(subject, 200))
        await asyncio.sleep(4)  # many times the whole retry schedule of two attempts
        assert count(db_dsn, "status = 2") == 0
        assert max(r["attempts"] for r in rows(db_dsn)) <= options["max_attempts"]
        fresh_nats.start()
        await wait_for(lambda: count(db_dsn) == 0, timeout=30, what="the backlog to drain")
    messages = await consume_nats(fresh_nats.url, stream, subject, 220)
    assert len({m.headers["Nats-Msg-Id"] for m in messages}) == 220


async def test_events_written_during_a_kafka_outage_are_not_dead_lettered(
    db_dsn: str, kafka_behind_proxy: Any
) -> None:
    """librdkafka queues while every broker is down and times the messages out later: those
    timeouts came back as failures and counted attempts. Now a failure while the client
    reports all brokers down is the outage's, handed back without counting."""
    topic = f"outage-{uuid.uuid4().hex[:8]}"
    # librdkafka gives up on a message after 2 s (before the relay's 0.8 x lease): several
    # rounds of timeouts during the outage, each reported as a failure.
    publisher = KafkaPublisher.from_url(f"{kafka_behind_proxy.url}?delivery_timeout_ms=2000")
    options: dict[str, Any] = {
        "max_attempts": 2,
        "retry_base": 0.05,
        "retry_cap": 0.3,
        "lease": 3.0,
    }
    async with running_relay(db_dsn, publisher, **options):
        write_events(db_dsn, make_events(topic, 20))
        await wait_for(lambda: count(db_dsn) == 0, what="the first events to be published")
        kafka_behind_proxy.proxy.cut()
        write_events(db_dsn, make_events(topic, 100))
        await asyncio.sleep(10)
        assert count(db_dsn, "status = 2") == 0
        kafka_behind_proxy.proxy.resume()
        await wait_for(lambda: count(db_dsn) == 0, timeout=60, what="the backlog to drain")
    messages = await asyncio.to_thread(
        consume_kafka, kafka_behind_proxy.bootstrap, topic, 120, 20.0
    )
    ids = [dict(m.headers())["idempotency-key"] for m in messages]
    assert len(set(ids)) == 120, "nothing lost"
    assert len(ids) == 120, "no message queued in librdkafka before the outage came back twice"
