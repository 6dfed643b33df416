"""Every field of an event is bounded and clean at construction; publishers re-check (no servers).

The attacks of issue 12 at the unit level: a CR LF in a topic or a header value
(protocol injection on NATS), a reserved header name (``Nats-Msg-Id``,
``Nats-Rollup``, ``ce-id``, ...), a 50 MB key, NUL in any text field, a
``put_many`` of unbounded size, and a topic addressing any Redis key or queue.
"""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from outboxkit import Event, Outbox, limits
from outboxkit.backends import backend_for
from outboxkit.errors import ConfigurationError, InvalidEventError
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.nats import NatsPublisher, _subject_problem
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.redis import RedisStreamsPublisher
from outboxkit.publishers.routing import Destinations


def _event(**overrides: Any) -> Event:
    fields: dict[str, Any] = {"topic": "orders", "event_type": "order.placed", "payload": {}}
    fields.update(overrides)
    return Event(**fields)


def _message(**overrides: Any) -> OutboundMessage:
    fields: dict[str, Any] = {
        "event_id": uuid.UUID("0190a0a0-0000-7000-8000-000000000001"),
        "topic": "orders",
        "key": "customer-1",
        "event_type": "order.placed",
        "aggregate_type": "order",
        "aggregate_id": "42",
        "payload": b"{}",
        "headers": {"tenant": "acme"},
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    }
    fields.update(overrides)
    return OutboundMessage(**fields)


# -- construction -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"topic": "orders\r\nPUB billing.refund 5\r\nforge"}, "control character"),
        ({"topic": "orders placed"}, "whitespace"),
        ({"topic": "orders\u2028x"}, "whitespace"),
        ({"topic": "o" * 256}, "256 bytes, over the limit of 255"),
        ({"topic": "é" * 128}, "256 bytes, over the limit of 255"),  # bytes, not characters
        ({"event_type": "order\x00placed"}, "event_type contains a control character"),
        ({"event_type": "t" * 256}, "event_type is 256 bytes"),
        ({"key": "customer\x00-1"}, "key contains a control character"),
        ({"key": "k" * (limits.MAX_KEY_BYTES + 1)}, "key is 65537 bytes"),
        ({"aggregate_type": "order\n"}, "aggregate_type contains a control character"),
        ({"aggregate_type": "a" * 256}, "aggregate_type is 256 bytes"),
        ({"aggregate_id": "42\x00"}, "aggregate_id contains a control character"),
        ({"aggregate_id": "4" * 1025}, "aggregate_id is 1025 bytes"),
        ({"headers": {"x": "a\r\nNats-Msg-Id: forged"}}, "control character"),
        ({"headers": {"x": "a\x00b"}}, "control character"),
        ({"headers": {"x\r\nNats-Rollup": "sub"}}, "not an HTTP token"),
        ({"headers": {"bad name": "1"}}, "not an HTTP token"),
        ({"headers": {"h" * 129: "1"}}, "over 128 bytes"),
        ({"headers": {"x": "v" * 8193}}, "8193 bytes, over the limit of 8192"),
        ({"headers": {f"h{i}": "v" for i in range(65)}}, "65 headers, over the limit of 64"),
    ],
)
def test_hostile_or_oversized_fields_are_refused_at_construction(
    overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(InvalidEventError, match="see outboxkit.limits") as info:
        _event(**overrides)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    "name",
    [
        "Nats-Msg-Id",
        "nats-rollup",
        "NATS-Expected-Last-Sequence",
        "ce-id",
        "CE_type",
        "cloudEvents_id",
        "webhook-signature",
        "Idempotency-Key",
        "Content-Length",
        "transfer-encoding",
        "Host",
    ],
)
def test_header_names_a_broker_or_outboxkit_interprets_are_refused(name: str) -> None:
    with pytest.raises(InvalidEventError, match="is reserved") as info:
        _event(headers={name: "forged"})
    assert name in str(info.value)
    assert "rename it" in str(info.value)


def test_fields_at_their_limits_are_accepted() -> None:
    event = _event(
        topic="t" * 255,
        event_type="e" * 255,
        key="k" * limits.MAX_KEY_BYTES,
        aggregate_type="a" * 255,
        aggregate_id="i" * 1024,
        headers={
            **{f"h{i}": "v" for i in range(63)},
            "n" * 128: "v" * 8192,
        },
    )
    assert len(event.headers) == 64
    # Ordinary metadata keeps working: tabs in values, content-type, trace context.
    event = _event(
        payload=b"\x00raw",
        headers={"x-note": "a\tb", "content-type": "text/plain", "traceparent": "00-1-2-01"},
    )
    assert event.headers["content-type"] == "text/plain"


def test_the_outbox_bounds_keys_at_one_kib_by_default_and_can_raise_it() -> None:
    event = _event(key="k" * 1025)  # within the construction ceiling
    with pytest.raises(InvalidEventError, match="1025 bytes, over max_key_bytes=1024"):
        Outbox().put(object(), event)  # refused before any connection is touched
    roomy = Outbox(max_key_bytes=4096)
    assert roomy._check(event) is event
    with pytest.raises(ValueError, match="max_key_bytes must be between 1 and 65536"):
        Outbox(max_key_bytes=limits.MAX_KEY_BYTES + 1)


def test_a_fifty_megabyte_key_never_gets_past_construction() -> None:
    with pytest.raises(InvalidEventError, match="key is 52428800 bytes"):
        _event(key="k" * 50 * 1024 * 1024)


def test_put_many_refuses_more_than_ten_thousand_events_without_reading_them_all() -> None:
    taken = 0

    def endless() -> Iterator[Event]:
        nonlocal taken
        event = _event()
        for _ in itertools.count():
            taken += 1
            yield event

    with pytest.raises(InvalidEventError, match="more than 10000 events") as info:
        Outbox().put_many(object(), endless())
    assert taken == limits.MAX_BATCH_EVENTS + 1
    assert "chunks of at most 10000" in str(info.value)
    with pytest.raises(InvalidEventError, match="more than 10000 events"):
        Outbox()._attached("SELECT 1", (), [_event()] * (limits.MAX_BATCH_EVENTS + 1))
    # Exactly the limit is one batch.
    outbox = Outbox()
    storage = outbox._writer_for(backend_for("postgresql://")).storage
    assert storage.many([_event()] * limits.MAX_BATCH_EVENTS, outbox._check) is not None


# -- publishers: rows written around Event() ---------------------------------------------


@pytest.mark.parametrize(
    ("subject", "reason"),
    [
        ("orders\r\nPUB billing.refund 5", "control character"),
        ("orders placed", "whitespace"),
        ("orders\tplaced", "whitespace"),
        ("orders.*", "wildcard"),
        ("orders.>", "wildcard"),
        ("orders..placed", "empty token"),
        (".orders", "empty token"),
        ("orders.", "empty token"),
        ("", "empty subject"),
    ],
)
def test_nats_refuses_subjects_the_server_would_misread(subject: str, reason: str) -> None:
    problem = _subject_problem(subject)
    assert problem is not None and reason in problem


def test_nats_accepts_ordinary_subjects() -> None:
    for subject in ("orders", "orders.placed", "shop.eu-1.orders_v2", "a.b.c.d.e"):
        assert _subject_problem(subject) is None


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({"x": "1\r\nNats-Msg-Id: forged"}, "control character"),
        ({"Nats-Rollup": "sub"}, "reserved by NATS"),
        ({"nats-expected-last-sequence": "0"}, "reserved by NATS"),
        ({"x y": "1"}, "not an HTTP token"),
    ],
)
def test_nats_publisher_refuses_headers_that_would_reach_the_server(
    headers: dict[str, str], reason: str
) -> None:
    """The NATS publisher leaves header names and values to its guard (one check, not two)."""
    publisher = NatsPublisher(["nats://127.0.0.1:4222"])
    refused = publisher.guard.refuse(_message(headers=headers))
    assert refused is not None and not refused.retryable
    assert reason in (refused.error or "")
    assert publisher._problem(_message(headers=headers)) is None  # not the subject's check
    assert publisher.guard.refuse(_message()) is None
    assert publisher._problem(_message(topic="orders.*")) is not None


def test_destinations_prefix_and_allow_list() -> None:
    open_ = Destinations()
    assert not open_.restricted
    assert open_.resolve("anything") == ("anything", None)
    prefixed = Destinations(prefix="outbox:")
    assert prefixed.resolve("orders") == ("outbox:orders", None)
    allowed = Destinations(allow=("orders.*", "billing"))
    assert allowed.resolve("orders.placed") == ("orders.placed", None)
    assert allowed.resolve("billing") == ("billing", None)
    stream, why = allowed.resolve("payments-ledger")
    assert stream is None and why is not None
    assert "not in the publisher's allow-list (allow=orders.*,billing)" in why
    both = Destinations(prefix="app:", allow=("orders.*",))
    assert both.resolve("orders.x") == ("app:orders.x", None)
    assert both.resolve("app:orders.x")[0] is None  # the glob applies to the topic
    with pytest.raises(ConfigurationError, match="allow= needs at least one"):
        Destinations.parse_allow(" , ")


def test_redis_and_rabbitmq_urls_take_a_namespace_and_an_allow_list() -> None:
    redis_publisher = RedisStreamsPublisher.from_url(
        "redis://127.0.0.1:6379/0?stream_prefix=outbox:&allow=orders.*,billing"
    )
    assert redis_publisher.destinations == Destinations("outbox:", ("orders.*", "billing"))
    rabbit = RabbitMQPublisher.from_url(
        "amqp://guest:guest@127.0.0.1:5672/?exchange=&routing_key_prefix=app.&allow=orders"
    )
    assert rabbit.destinations == Destinations("app.", ("orders",))
    with pytest.raises(ConfigurationError, match="stream_prefix, allow"):
        RedisStreamsPublisher.from_url("redis://127.0.0.1:6379/0?prefix=x")
