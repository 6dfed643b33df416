"""A Kafka broker that forgets the relay's producer id fences it; the relay must recover alone.

The fault is real: the Tansu broker (memory storage) is stopped and started again on the same
port while the relay has whole batches in flight. The new broker knows nothing of the idempotent
producer's id, so librdkafka's retried ProduceRequests fail with UNKNOWN_PRODUCER_ID and the
producer enters librdkafka's fatal state ("unable to retry without risking duplication/
reordering"). confluent-kafka reports that fatal error by raising it from ``poll()``, not
through ``error_cb``; every later ``produce()`` raises ``_FATAL``.

Before the fix the exception killed the publisher's poll thread, so no delivery report was served
any more: the batches in flight waited for the publish timeout, every later batch failed at once
with ``error_class=_FATAL`` (attempts counted, one WARNING per event) and the producer was never
recreated, so healthy events were dead-lettered after ``max_attempts``.

To know exactly what the broker must end up with, the relay reaches the broker through a TCP proxy
that holds every byte while the load is produced: the old broker receives none of those events
and acknowledges none of them, so every one of them must be read back from the new broker. (The
warm-up events the old broker did acknowledge are lost with its memory storage; they only give
the producer a producer id and sequence numbers to be fenced on.)
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from outboxkit.publishers.kafka import KafkaPublisher
from tests.support.relaying import count, make_events, rows, running_relay, wait_for, write_events
from tests.support.servers import consume_kafka

pytestmark = pytest.mark.slow

_LOAD = 3000


async def test_kafka_producer_fenced_by_a_broker_restart_is_recreated_and_loses_nothing(
    db_dsn: str, kafka_behind_proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    topic = f"fenced-{uuid.uuid4().hex[:8]}"
    broker, proxy = kafka_behind_proxy.broker, kafka_behind_proxy.proxy
    publisher = KafkaPublisher.from_url(kafka_behind_proxy.url)
    async with running_relay(
        db_dsn, publisher, retention="keep", max_attempts=3, lease=15.0
    ) as relay:
        write_events(db_dsn, make_events(topic, 50))
        await wait_for(lambda: count(db_dsn, "status = 0") == 0, what="warm-up published")

        proxy.pause()  # the load's ProduceRequests are sent, held, never reach the old broker
        load = make_events(topic, _LOAD)
        write_events(db_dsn, load)
        await wait_for(
            lambda: relay.stats.claimed >= 50 + _LOAD, what="the whole load claimed, in flight"
        )
        await asyncio.sleep(0.5)  # librdkafka has sent its requests into the proxy
        caplog.clear()
        await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(broker.start)  # same port, empty: the producer id is unknown
        proxy.resume()

        await wait_for(
            lambda: count(db_dsn, "status = 0") == 0,
            timeout=60,
            what="every event settled after the restart",
        )
    settled = rows(db_dsn, f"topic = '{topic}'")
    load_ids = {str(e.event_id) for e in load}
    load_rows = [r for r in settled if str(r["event_id"]) in load_ids]
    assert {r["status"] for r in load_rows} == {1}, "no event dead-lettered"
    assert max(r["attempts"] for r in load_rows) == 1, "handed back without burning attempts"
    assert relay.stats.released > 0, "the fenced batches were handed back"

    ids: list[str] = []
    for wanted in (_LOAD, 2 * _LOAD):  # the second read only if duplicates hid some
        messages = await asyncio.to_thread(consume_kafka, broker.bootstrap, topic, wanted, 10.0)
        ids = [dict(m.headers() or [])["idempotency-key"].decode() for m in messages]
        if set(ids) >= load_ids:
            break
    assert set(ids) >= load_ids, f"{len(load_ids - set(ids))} event(s) missing at the broker"

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    recreated = [r for r in warnings if "recreat" in r.getMessage()]
    assert len(recreated) == 1, [r.getMessage() for r in warnings]
    assert "UNKNOWN_PRODUCER_ID" in recreated[0].getMessage(), "the cause is in the line"
    # The relay may say once that publishing is failing (relay/outage.py), never once per event.
    relay_lines = [r.getMessage() for r in warnings if r.name == "outboxkit.relay"]
    assert len(relay_lines) <= 2, relay_lines[:5]
    assert not [line for line in relay_lines if "event_id=" in line], relay_lines[:5]
