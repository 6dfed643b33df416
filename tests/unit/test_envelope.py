"""Consumers decode exactly what each publisher encodes (no servers: the wire formats only)."""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from typing import Any

import pytest

from outboxkit.consumers import kafka as kafka_consumer
from outboxkit.consumers import nats as nats_consumer
from outboxkit.consumers import rabbitmq as rabbitmq_consumer
from outboxkit.consumers import redis as redis_consumer
from outboxkit.consumers import sqs as sqs_consumer
from outboxkit.consumers.base import EnvelopeError, ReceivedEvent, from_cloudevents
from outboxkit.errors import ConfigurationError
from outboxkit.publishers import kafka as kafka_publisher
from outboxkit.publishers import nats as nats_publisher
from outboxkit.publishers import rabbitmq as rabbitmq_publisher
from outboxkit.publishers import redis as redis_publisher
from outboxkit.publishers import sqs as sqs_publisher
from outboxkit.publishers.base import OutboundMessage

CREATED = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.UTC)


def outbound(payload: bytes = b'{"order": 7}', **headers: str) -> OutboundMessage:
    return OutboundMessage(
        event_id=uuid.UUID("01935f3c-0000-7000-8000-000000000007"),
        topic="orders",
        key="customer-7",
        event_type="order.placed",
        aggregate_type="order",
        aggregate_id="7",
        payload=payload,
        headers={
            "tenant": "acme",
            "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
            **headers,
        },
        created_at=CREATED,
    )


def assert_same(event: ReceivedEvent, message: OutboundMessage, topic: str = "orders") -> None:
    assert event.event_id == message.event_id
    assert event.topic == topic
    assert event.key == message.key
    assert event.event_type == message.event_type
    assert event.aggregate_type == message.aggregate_type
    assert event.aggregate_id == message.aggregate_id
    assert event.payload == message.payload
    assert event.headers == message.user_headers()
    assert event.content_type == message.content_type
    assert event.occurred_at == CREATED


def test_kafka_record_round_trips() -> None:
    message = outbound()
    headers = kafka_publisher._headers(message)
    event = kafka_consumer.decode("orders", b"customer-7", message.payload, headers, 2)
    assert_same(event, message)
    assert event.delivery_count == 2
    assert event.json() == {"order": 7}


def test_nats_message_round_trips_and_drops_nats_headers() -> None:
    message = outbound()
    headers = {**nats_publisher._headers(message), "Nats-Expected-Stream": "ORDERS"}
    event = nats_consumer.decode("orders", message.payload, headers, 3)
    assert_same(event, message)
    assert event.delivery_count == 3


def test_rabbitmq_message_round_trips() -> None:
    message = outbound(b"\x00\x01raw", **{"content-type": "application/octet-stream"})
    amqp = rabbitmq_publisher._message(message)
    event = rabbitmq_consumer.decode(amqp, "orders")
    assert_same(event, message)


def test_redis_entry_round_trips_as_redis_returns_it() -> None:
    message = outbound()
    fields = redis_publisher._fields(message)
    # Redis hands fields back as bytes, whatever went in.
    as_stored = {
        k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()
    }
    assert_same(redis_consumer.decode("orders", as_stored), message)


@pytest.mark.parametrize("payload", [b'{"order": 7}', b"\xff\xfe binary"])
def test_sqs_message_round_trips_text_and_base64_bodies(payload: bytes) -> None:
    content_type = "application/json" if payload.startswith(b"{") else "application/octet-stream"
    message = outbound(payload, **{"content-type": content_type})
    entry, _ = sqs_publisher._entry(0, message, fifo=False)
    received = {
        "Body": entry["MessageBody"],
        "MessageAttributes": entry["MessageAttributes"],
        "Attributes": {"ApproximateReceiveCount": "4"},
    }
    event = sqs_consumer.decode("orders", received)
    assert_same(event, message)
    assert event.delivery_count == 4
    if payload.startswith(b"\xff"):
        assert entry["MessageBody"] == base64.b64encode(payload).decode()


def test_message_without_an_event_id_is_an_envelope_error() -> None:
    with pytest.raises(EnvelopeError, match="no event id"):
        kafka_consumer.decode("orders", None, b"{}", [("ce_type", b"x")])
    with pytest.raises(EnvelopeError, match="not a UUID"):
        from_cloudevents(topic="orders", payload=b"", attributes={"id": "42"})


def test_broker_message_id_is_the_fallback_event_id() -> None:
    event_id = uuid.uuid4()
    event = nats_consumer.decode("orders", b"{}", {"Nats-Msg-Id": str(event_id)})
    assert event.event_id == event_id
    assert event.event_type == ""
    assert event.aggregate_type is None


def test_runner_options_are_checked() -> None:
    from outboxkit.consumers.redis import RedisStreamsConsumer

    async def handler(tx: Any, event: ReceivedEvent) -> None:
        pass

    with pytest.raises(ConfigurationError, match="consumer="):
        RedisStreamsConsumer("dbname=x", handler, consumer="", url="redis://h", streams="s")
    with pytest.raises(ConfigurationError, match="max_deliveries"):
        RedisStreamsConsumer(
            "dbname=x", handler, consumer="c", url="redis://h", streams="s", max_deliveries=0
        )
    with pytest.raises(ConfigurationError, match="stream"):
        RedisStreamsConsumer("dbname=x", handler, consumer="c", url="redis://h", streams=[])
