"""Each publisher counts a message's size as its broker does (no servers).

A count one byte short lets an oversized message through (on NATS it then drops the
connection and every neighbour's PubAck with it); one byte long refuses a message the
broker would take. Each count is checked against the broker's client library itself.
"""

from __future__ import annotations

import datetime as dt
import uuid
from types import SimpleNamespace
from typing import Any

import aio_pika
import aiormq.exceptions
import botocore.exceptions
import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from nats.aio.client import Client as NATS

from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.redis import RedisStreamsPublisher
from outboxkit.publishers.sqs import SqsPublisher
from outboxkit.wire import kafka as kafka_wire
from outboxkit.wire import nats as nats_wire
from outboxkit.wire import redis as redis_wire


def _message(**overrides: Any) -> OutboundMessage:
    fields: dict[str, Any] = {
        "event_id": uuid.UUID("0190a0a0-0000-7000-8000-000000000001"),
        "topic": "orders",
        "key": "clé-1",
        "event_type": "order.placed",
        "aggregate_type": "order",
        "aggregate_id": "42",
        "payload": b'{"n": 1}',
        "headers": {"tenant": "acmé ✓", "note": " padded "},
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    }
    fields.update(overrides)
    return OutboundMessage(**fields)


async def _hpub_total(payload: bytes, headers: dict[str, str]) -> int:
    """The total size nats-py announces in its HPUB line: what the server checks."""
    nc = NATS()
    sent: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        sent.append(cmd)

    nc._send_command = capture  # type: ignore[method-assign]
    nc._flush_queue = None
    await nc._send_publish("orders", "", payload, len(payload), headers)
    first_line = sent[0].split(b"\r\n", 1)[0]
    return int(first_line.split()[-1])


@pytest.mark.parametrize("payload", [b"", b"{}", "é ✓".encode() * 1000])
async def test_nats_size_is_the_total_nats_py_sends(payload: bytes) -> None:
    headers = nats_wire.encode_headers(_message(payload=payload))
    assert nats_wire.message_size(payload, headers) == await _hpub_total(payload, headers)


def test_nats_oversize_is_none_up_to_the_limit_and_the_size_past_it() -> None:
    message = _message(payload=b"x" * 5000)
    headers = nats_wire.encode_headers(message)
    size = nats_wire.message_size(message.payload, headers)
    assert nats_wire.oversize(message.payload, headers, size) is None
    assert nats_wire.oversize(message.payload, headers, size - 1) == size
    assert nats_wire.oversize(message.payload, headers, 10**6) is None


def _librdkafka_accepts(message: OutboundMessage, max_bytes: int) -> bool:
    # produce() checks message.max.bytes locally, before any broker is contacted.
    producer = Producer({"bootstrap.servers": "127.0.0.1:9", "message.max.bytes": max_bytes})
    headers, timestamp = kafka_wire.encode_record(message)
    try:
        producer.produce(
            message.topic, message.payload, key=message.key, headers=headers, timestamp=timestamp
        )
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
            raise
        return False
    finally:
        producer.purge()
    return True


@pytest.mark.parametrize("payload_size", [2000, 5000, 70_000])
def test_kafka_record_size_is_the_size_librdkafka_checks(payload_size: int) -> None:
    message = _message(payload=b"x" * payload_size)
    headers, _ = kafka_wire.encode_record(message)
    size = kafka_wire.record_size(message.key, message.payload, headers)
    assert _librdkafka_accepts(message, size)
    assert not _librdkafka_accepts(message, size - 1)


def test_kafka_broker_refusal_dead_letters_the_largest_and_hands_back_its_neighbours() -> None:
    publisher = KafkaPublisher({"bootstrap.servers": "127.0.0.1:9"})
    refused = PublishResult.permanent("kafka MSG_SIZE_TOO_LARGE: Broker: ...", "MSG_SIZE_TOO_LARGE")
    messages = [
        _message(payload=b"a" * 100),
        _message(payload=b"b" * 9000),
        _message(payload=b"c" * 100, topic="other"),
        _message(payload=b"d" * 200),
    ]
    results = [refused, refused, PublishResult.success(), refused]
    publisher._judge_refused_as_too_large(messages, results)
    assert results[2].ok
    big = results[1]
    assert (big.retryable, big.error_class) == (False, "message_too_large")
    assert "message.max.bytes" in (big.error or "") and "'orders'" in (big.error or "")
    for neighbour in (results[0], results[3]):
        assert neighbour.retryable and not neighbour.counts_attempt, "handed back, not charged"


def _rabbit(**options: Any) -> RabbitMQPublisher:
    return RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/", **options)


def _amqp_connection(version: bytes, frame_max: int) -> Any:
    tune = SimpleNamespace(frame_max=frame_max)
    amqp = SimpleNamespace(connection_tune=tune, server_properties={"version": version})
    return SimpleNamespace(transport=SimpleNamespace(connection=amqp))


@pytest.mark.parametrize(
    ("version", "limit"), [(b"3.13.7", 128 * 1024 * 1024), (b"4.0.5", 16 * 1024 * 1024)]
)
def test_rabbitmq_body_limit_follows_the_server_version(version: bytes, limit: int) -> None:
    publisher = _rabbit()
    publisher._read_limits(_amqp_connection(version, 131072))
    assert publisher._too_large(aio_pika.Message(b"x" * limit)) is None
    dead = publisher._too_large(aio_pika.Message(b"x" * (limit + 1)))
    assert dead is not None and not dead.retryable
    assert "max_message_size" in (dead.error or "")


def test_rabbitmq_headers_over_frame_max_are_judged_exactly() -> None:
    publisher = _rabbit()
    publisher._read_limits(_amqp_connection(b"3.13.7", 4096))
    fits = aio_pika.Message(b"{}", headers={"note": "n" * 3000})
    assert publisher._too_large(fits) is None
    heavy = aio_pika.Message(b"{}", headers={"note": "n" * 4096})
    dead = publisher._too_large(heavy)
    assert dead is not None and "frame_max is 4 096" in (dead.error or "")


def test_rabbitmq_channel_closed_over_another_message_hands_this_one_back() -> None:
    publisher = _rabbit()
    closed = aiormq.exceptions.ChannelPreconditionFailed(
        406, "PRECONDITION_FAILED - message size 5000 is larger than configured max size 4096"
    )
    culprit = publisher._channel_lost(closed, "here", _message(payload=b"x" * 5000))
    assert (culprit.retryable, culprit.error_class) == (False, "message_too_large")
    neighbour = publisher._channel_lost(closed, "here", _message(payload=b"{}"))
    assert neighbour.retryable and not neighbour.counts_attempt, "handed back, not charged"
    # The broker's configured limit is learnt: the next oversized body is never sent.
    dead = publisher._too_large(aio_pika.Message(b"x" * 4097))
    assert dead is not None and "max_message_size is 4 096" in (dead.error or "")


def test_redis_payload_or_headers_over_proto_max_bulk_len_are_refused() -> None:
    publisher = RedisStreamsPublisher("redis://127.0.0.1:6379/0")
    publisher._max_bulk = 2000
    ok = redis_wire.encode(_message(payload=b"x" * 2000))
    assert publisher._too_large(ok, "orders") is None
    big = redis_wire.encode(_message(payload=b"x" * 2001))
    dead = publisher._too_large(big, "orders")
    assert dead is not None and "proto-max-bulk-len is 2 000" in (dead.error or "")
    heavy = redis_wire.encode(_message(headers={f"h{i}": "v" * 200 for i in range(10)}))
    assert publisher._too_large(heavy, "orders") is not None, "the headers field counts too"


def test_sqs_request_whose_connection_closed_is_handed_back_not_charged() -> None:
    publisher = SqsPublisher("orders", region="us-east-1")
    closed = botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:9")
    result = publisher._failed(closed, "sqs: request failed", "ConnectionClosedError")
    assert result.retryable and not result.counts_attempt
    timed_out = botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:9")
    result = publisher._failed(timed_out, "sqs: request failed", "ReadTimeoutError")
    assert result.counts_attempt, "no answer in time: SQS may have judged it"


def test_sqs_dead_letter_names_the_limit_it_came_from() -> None:
    queue_limit = SqsPublisher("orders", region="us-east-1")._too_large(2000, 1024)
    assert "the queue's MaximumMessageSize is 1 024" in (queue_limit.error or "")
    url_limit = SqsPublisher("orders", region="us-east-1", max_message_bytes=1024)
    assert "max_message_bytes=1024" in (url_limit._too_large(2000, 1024).error or "")
