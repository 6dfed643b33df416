"""Each publisher counts a message's size as its broker does (no servers).

A count one byte short lets an oversized message through (on NATS it then drops the
connection and every neighbour's PubAck with it); one byte long refuses a message the
broker would take. Each count is checked against the broker's client library itself.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from nats.aio.client import Client as NATS

from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.wire import kafka as kafka_wire
from outboxkit.wire import nats as nats_wire


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
