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
from outboxkit.consumers.base import ReceivedEvent, from_cloudevents, from_envelope
from outboxkit.errors import ConfigurationError, EnvelopeError, InvalidEventError
from outboxkit.events import Event
from outboxkit.publishers import kafka as kafka_publisher
from outboxkit.publishers import rabbitmq as rabbitmq_publisher
from outboxkit.publishers import sqs as sqs_publisher
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.webhook import WebhookPublisher
from outboxkit.wire import kafka as kafka_wire
from outboxkit.wire import nats as nats_wire
from outboxkit.wire import rabbitmq as rabbitmq_wire
from outboxkit.wire import redis as redis_wire
from outboxkit.wire import sqs as sqs_wire
from outboxkit.wire import webhook as webhook_wire
from outboxkit.wire.cloudevents import Envelope, decode_header_value, encode_header_value

CREATED = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.UTC)
# When the fact happened: before the row was written, at another offset, with microseconds.
OCCURRED = dt.datetime(2026, 11, 22, 15, 29, 58, 123456, tzinfo=dt.timezone(dt.timedelta(hours=5)))


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
        occurred_at=OCCURRED,
        schema_version="3",
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
    assert event.occurred_at == OCCURRED
    assert event.schema_version == message.schema_version


# -- every wire module: encode, then decode, gives the same event -------------------------


def _via_kafka(message: OutboundMessage) -> Envelope:
    key = message.key.encode() if message.key is not None else None
    headers: list[tuple[str, bytes | None]] = list(kafka_wire.encode_headers(message))
    return kafka_wire.decode(key, message.payload, headers)


def _via_nats(message: OutboundMessage) -> Envelope:
    return nats_wire.decode(message.payload, nats_wire.encode_headers(message))


def _via_rabbitmq(message: OutboundMessage) -> Envelope:
    amqp = rabbitmq_publisher._message(message)
    return rabbitmq_wire.decode(
        amqp.body,
        amqp.headers,
        content_type=amqp.content_type,
        message_type=amqp.type,
        message_id=amqp.message_id,
    )


def _via_redis(message: OutboundMessage) -> Envelope:
    fields = redis_wire.encode(message)  # Redis hands every name and value back as bytes
    return redis_wire.decode(
        {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    )


def _via_sqs(message: OutboundMessage) -> Envelope:
    body, attributes = sqs_wire.encode(message)
    return sqs_wire.decode(body, attributes)


def _via_webhook(message: OutboundMessage) -> Envelope:
    sent = WebhookPublisher("http://127.0.0.1/hooks")._headers(message, message.payload)
    # As a server reads them: names case-insensitive, plus what every HTTP client adds.
    headers = {k.decode().lower(): v.decode() for k, v in sent}
    headers |= {"host": "127.0.0.1", "user-agent": "python-httpx", "accept": "*/*"}
    return webhook_wire.decode(message.payload, headers)


def _hostile() -> OutboundMessage:
    message = outbound(
        b"\x00\xff binary \x07",
        **{"content-type": "application/octet-stream", "tracestate": "vendor=a b,other=%41"},
    )
    message.key = "clé 100%41"
    message.event_type = 'note "added" ✓'
    message.aggregate_type = "note ✓"
    message.aggregate_id = "100%41 München"
    message.schema_version = 'v2 "beta"'
    return message


@pytest.mark.parametrize(
    "through",
    [_via_kafka, _via_nats, _via_rabbitmq, _via_redis, _via_sqs, _via_webhook],
    ids=["kafka", "nats", "rabbitmq", "redis", "sqs", "webhook"],
)
@pytest.mark.parametrize("make", [outbound, _hostile], ids=["plain", "hostile"])
def test_every_wire_format_decodes_what_it_encodes(through: Any, make: Any) -> None:
    message = make()
    event = from_envelope("orders", through(message))
    assert_same(event, message)
    assert event.headers["traceparent"] == message.headers["traceparent"]
    assert event.payload == message.payload, "payload bytes unchanged"


def test_kafka_record_round_trips() -> None:
    message = outbound()
    headers = kafka_wire.encode_headers(message)
    event = kafka_consumer.decode("orders", b"customer-7", message.payload, headers, 2)
    assert_same(event, message)
    assert event.delivery_count == 2
    assert event.json() == {"order": 7}


def test_nats_message_round_trips_and_drops_nats_headers() -> None:
    message = outbound()
    headers = {**nats_wire.encode_headers(message), "Nats-Expected-Stream": "ORDERS"}
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
    fields = redis_wire.encode(message)
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


# -- ce-* header values of the HTTP and NATS bindings (§3.1.3.2) ---------------------------

HOSTILE = ["100%41", "München", 'say "hi" ', "%", "%zz%C0%A0", "🚀 € 日本", "tab\tcr\r", "~!#$&'()"]


def test_percent_encoding_is_the_bindings_example_and_round_trips() -> None:
    # The example of the HTTP binding 1.0.2 §3.1.3.2, byte for byte (upper-case hex).
    assert encode_header_value("Euro \u20ac \U0001f600") == "Euro%20%E2%82%AC%20%F0%9F%98%80"
    assert encode_header_value("100%41") == "100%2541"
    assert encode_header_value("order.placed") == "order.placed"  # plain ASCII untouched
    for value in HOSTILE:
        encoded = encode_header_value(value)
        assert encoded.isascii() and encoded.isprintable()
        assert " " not in encoded and '"' not in encoded
        assert decode_header_value(encoded) == value


def test_percent_decoding_accepts_what_the_binding_allows_and_rejects_bad_utf8() -> None:
    assert decode_header_value("M%c3%bcnchen") == "München"  # lower-case hex
    assert decode_header_value("%41BC") == "ABC"  # unnecessarily encoded
    assert decode_header_value('"quoted \\"value\\" %25"') == 'quoted "value" %'
    with pytest.raises(ValueError, match="not UTF-8"):
        decode_header_value("%C0%A0")  # overlong encoding of a space: MUST be rejected


def test_nats_message_with_a_non_utf8_attribute_is_an_envelope_error() -> None:
    headers = {"ce-id": str(uuid.uuid4()), "ce-subject": "%FF"}
    with pytest.raises(EnvelopeError, match="ce-subject"):
        nats_consumer.decode("orders", b"{}", headers)


def test_nats_and_webhook_headers_encode_hostile_attributes_kafka_and_amqp_do_not() -> None:
    message = outbound()
    message.aggregate_id = "100%41 München"
    message.schema_version = 'v2 "beta"'
    nats = nats_wire.encode_headers(message)
    assert nats["ce-subject"] == "100%2541%20M%C3%BCnchen"
    assert nats["ce-schemaversion"] == "v2%20%22beta%22"
    assert nats["ce-datacontenttype"] == "application/json"
    assert nats_consumer.decode("orders", b"{}", nats).aggregate_id == "100%41 München"
    webhook = dict(WebhookPublisher("http://127.0.0.1/hooks")._headers(message, b"{}"))
    assert webhook[b"ce-subject"] == b"100%2541%20M%C3%BCnchen"
    assert webhook[b"content-type"] == b"application/json"  # an HTTP header: not encoded
    kafka = dict(kafka_wire.encode_headers(message))
    assert kafka["ce_subject"] == "100%41 München".encode()
    amqp = rabbitmq_wire.encode_headers(message)
    assert amqp["cloudEvents_subject"] == "100%41 München"


# -- occurred_at and schema_version ---------------------------------------------------------


def test_occurred_at_defaults_to_now_and_must_be_timezone_aware() -> None:
    before = dt.datetime.now(dt.UTC)
    event = Event(topic="t", event_type="x", payload={})
    assert before <= event.occurred_at <= dt.datetime.now(dt.UTC)
    assert event.schema_version is None
    assert Event(topic="t", event_type="x", payload={}, occurred_at=OCCURRED).occurred_at == (
        OCCURRED
    )
    with pytest.raises(InvalidEventError, match="timezone-aware"):
        Event(topic="t", event_type="x", payload={}, occurred_at=dt.datetime(2026, 1, 1))
    with pytest.raises(InvalidEventError, match="must be a datetime"):
        Event(topic="t", event_type="x", payload={}, occurred_at="2026-01-01")  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "stored"), [(3, "3"), (0, "0"), ("2.1", "2.1"), ("v 2", "v 2")])
def test_schema_version_is_a_short_label_ints_as_decimal_strings(given: Any, stored: str) -> None:
    assert Event(topic="t", event_type="x", payload={}, schema_version=given).schema_version == (
        stored
    )


@pytest.mark.parametrize("bad", [True, -1, 2.0, "", "x" * 65, "two\nlines", b"3"])
def test_schema_version_refuses_what_is_not_a_version_label(bad: Any) -> None:
    with pytest.raises(InvalidEventError, match="schema_version"):
        Event(topic="t", event_type="x", payload={}, schema_version=bad)


def test_rows_from_before_schema_version_2_send_created_at_as_the_time() -> None:
    message = outbound()
    message.occurred_at = None
    assert message.cloudevents_attributes()["time"] == CREATED.isoformat()
    assert kafka_publisher._timestamp_ms(message) == 1795348800000
    message.occurred_at = OCCURRED
    assert kafka_publisher._timestamp_ms(message) == 1795343398123  # exact, truncated to ms
    assert rabbitmq_publisher._message(message).timestamp is not None


def test_sqs_schema_version_rides_in_headers_when_all_ten_attributes_are_taken() -> None:
    message = outbound(b"\xff binary", **{"content-type": "application/octet-stream"})
    entry, _ = sqs_publisher._entry(0, message, fifo=False)
    attributes = entry["MessageAttributes"]
    assert len(attributes) == 10
    assert "ce_schemaversion" not in attributes
    received = {"Body": entry["MessageBody"], "MessageAttributes": attributes}
    event = sqs_consumer.decode("orders", received)
    assert event.schema_version == "3"
    assert "ce_schemaversion" not in event.headers
    message.headers = {}  # room left: it is an attribute of its own
    entry, _ = sqs_publisher._entry(0, message, fifo=False)
    assert entry["MessageAttributes"]["ce_schemaversion"]["StringValue"] == "3"


@pytest.mark.parametrize("full", [True, False])
def test_ce_headers_are_exactly_the_attributes_percent_encoded(full: bool) -> None:
    message = outbound()
    if full:
        message.aggregate_id, message.key = "100%41 München", 'say "hi"'
        message.aggregate_type, message.schema_version = "Bücher & Co", "v 2"
    else:
        message.aggregate_id = message.key = message.aggregate_type = None
        message.schema_version, message.headers = None, {}
    expected = {
        f"ce-{name}": encode_header_value(value)
        for name, value in message.cloudevents_attributes().items()
        if name != "datacontenttype"
    }
    assert message.cloudevents_headers() == expected
