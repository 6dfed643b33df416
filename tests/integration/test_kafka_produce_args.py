"""The Kafka publisher calls ``Producer.produce()`` by position; each value lands where meant.

confluent-kafka's positional order is topic, value, key, partition, callback, on_delivery,
timestamp, headers. A slip is silent at the call: ``None`` in ``callback`` means no delivery
report at all (every batch then waits out the relay's publish timeout and is re-sent), a
swapped timestamp or key is simply wrong on the broker. This reads the record back.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.kafka import KafkaPublisher
from tests.support.servers import consume_kafka, unique_name


async def test_each_produce_argument_reaches_the_record_and_the_report_arrives(
    kafka_broker: Any,
) -> None:
    topic = unique_name("produce-args")
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    message = OutboundMessage(
        uuid.uuid4(), topic, "key-1", "order.placed", "order", "42", b'{"a":1}',
        {"tenant": "acme"}, when, 1, when, None,
    )  # fmt: skip
    publisher = KafkaPublisher({"bootstrap.servers": kafka_broker.bootstrap})
    await publisher.start()
    try:
        # The delivery report resolves the batch: well inside the relay's publish timeout.
        [result] = await asyncio.wait_for(publisher.publish_batch([message]), 15)
    finally:
        await publisher.close()
    assert result.ok, result
    [record] = await asyncio.to_thread(consume_kafka, kafka_broker.bootstrap, topic, 1)
    assert record.key() == b"key-1" and record.value() == b'{"a":1}'
    assert record.timestamp()[1] == 1767323045678  # CreateTime: the event's time, in ms
    headers = dict(record.headers() or [])
    assert headers["tenant"] == b"acme" and headers["ce_id"] == str(message.event_id).encode()
