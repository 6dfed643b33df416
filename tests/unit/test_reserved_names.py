"""Reserved header names, system destinations and unencodable text, refused twice (no servers).

Issue 26, items 2, 3 and 8: a ``Status`` header made NATS events unconsumable, a
``$JS.API.STREAM.DELETE.X`` topic deleted a stream, a lone surrogate passed ``Event()`` and
failed at ``put``; rows written by plain SQL with a Unicode space in the topic or a forged
``ce-id`` were published as they were. ``Event()`` and every publisher apply one function,
``limits.event_problem``; each publisher's ``Guard`` adds its broker's system destinations.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest

from outboxkit import Event, limits
from outboxkit.errors import ConfigurationError, InvalidEventError
from outboxkit.publishers import from_url
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.kafka import KafkaPublisher
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.redis import RedisStreamsPublisher
from outboxkit.publishers.reserved import Guard, allow_system_destinations, split_allow_system
from outboxkit.publishers.routing import RoutingPublisher
from outboxkit.publishers.sqs import SqsPublisher
from outboxkit.publishers.webhook import WebhookPublisher


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
        "headers": {"tenant": "acme", "content-type": "application/json"},
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    }
    fields.update(overrides)
    return OutboundMessage(**fields)


# -- item 2: header names a broker acts on ---------------------------------------------------


@pytest.mark.parametrize(
    ("name", "who"),
    [
        ("Status", "reserved by NATS"),
        ("status", "reserved by NATS"),
        ("Description", "reserved by NATS"),
        ("KV-Operation", "reserved by NATS"),
        ("Nats-TTL", "reserved by NATS"),
        ("Nats-Schedule", "reserved by NATS"),
        ("CC", "reserved by RabbitMQ"),
        ("BCC", "reserved by RabbitMQ"),
        ("x-death", "reserved by RabbitMQ"),
        ("x-first-death-reason", "reserved by RabbitMQ"),
        ("x-delivery-count", "reserved by RabbitMQ"),
        ("x-received-from", "reserved by RabbitMQ"),
        ("Connection", "reserved by HTTP"),
        ("Keep-Alive", "reserved by HTTP"),
        ("TE", "reserved by HTTP"),
        ("Trailer", "reserved by HTTP"),
        ("Upgrade", "reserved by HTTP"),
        ("Expect", "reserved by HTTP"),
        ("Proxy-Authorization", "reserved by HTTP"),
        ("Content-Length", "reserved by HTTP"),
        ("CE-ID", "reserved by outboxkit"),
        ("ce_id", "reserved by outboxkit"),
        ("webhook-signature", "reserved by outboxkit"),
    ],
)
def test_a_header_a_broker_acts_on_is_refused_naming_who_reserves_it(name: str, who: str) -> None:
    with pytest.raises(InvalidEventError, match=f"is {who}") as info:
        _event(headers={name: "500"})
    assert f"rename it, e.g. 'x-app-{name.lower()}'" in str(info.value)


def test_ordinary_x_headers_stay_allowed() -> None:
    headers = {"x-request-id": "r1", "x-delay": "5000", "x-app-status": "paid", "tenant": "a"}
    assert _event(headers=headers).headers == headers


# -- item 3: system destinations ----------------------------------------------------------


@pytest.mark.parametrize(
    "topic",
    [
        "$JS.API.STREAM.DELETE.VICTIM",
        "$SYS.REQ.SERVER.PING",
        "$KV.cfg.k",
        "$O.b.x",
        "$G",
        "_INBOX.x",
    ],
)
def test_a_system_topic_is_refused_at_construction_unless_allowed(topic: str) -> None:
    with pytest.raises(InvalidEventError, match="is a system destination"):
        _event(topic=topic)
    assert _event(topic=topic, allow_system_topic=True).topic == topic


def test_topics_that_merely_resemble_system_ones_are_accepted() -> None:
    for topic in ("orders.$JS", "_inbox.orders", "_INBOXES", "JS.API", "amq.orders", "__x"):
        assert _event(topic=topic).topic == topic


@pytest.mark.parametrize(
    ("guard", "destination"),
    [
        (Guard("nats"), "$JS.API.STREAM.DELETE.VICTIM"),
        (Guard("nats"), "_INBOX.abc"),
        (Guard("kafka"), "__consumer_offsets"),
        (Guard("kafka"), "__transaction_state"),
        (Guard("kafka"), "_schemas"),
        (Guard("kafka"), "_confluent-metrics"),
        (Guard("rabbitmq"), "amq.rabbitmq.reply-to.g1h2AA"),
        (Guard("rabbitmq"), "amq.gen-JzTY20BRgKO"),
        (Guard("redis"), "outboxkit:dedup:orders:0190a0a0-0000-7000-8000-000000000001"),
    ],
)
def test_each_broker_refuses_its_system_destinations_unless_allowed(
    guard: Guard, destination: str
) -> None:
    problem = guard.destination_problem(destination)
    assert problem is not None and "allow_system=GLOB" in problem
    refused = guard.refuse(_message(topic=destination))
    assert refused is not None and not refused.retryable
    allowed = Guard(guard.broker, [destination[:3] + "*"])
    assert allowed.destination_problem(destination) is None
    assert allowed.refuse(_message(topic=destination)) is None


def test_ordinary_destinations_pass_every_guard() -> None:
    for broker in ("nats", "kafka", "rabbitmq", "redis", "sqs", "webhook"):
        assert Guard(broker).refuse(_message(topic="orders.placed")) is None


def test_the_destination_a_prefix_makes_is_what_is_checked() -> None:
    guard = Guard("redis")
    assert guard.refuse(_message(topic="orders"), "outboxkit:dedup:orders") is not None
    assert guard.refuse(_message(topic="outboxkit:dedup:x"), "app:outboxkit:dedup:x") is None


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("nats://127.0.0.1:4222?timeout=3", NatsPublisher),
        ("kafka://127.0.0.1:9092", KafkaPublisher),
        ("amqp://guest:guest@127.0.0.1:5672/?exchange=events", RabbitMQPublisher),
        ("redis://127.0.0.1:6379/0?stream_prefix=app:", RedisStreamsPublisher),
        ("sqs://orders?region=us-east-1", SqsPublisher),
        ("https://example.invalid/hooks/{topic}?x=1", WebhookPublisher),
    ],
)
def test_every_broker_url_takes_allow_system(url: str, cls: type) -> None:
    assert not from_url(url).guard.allow_system  # type: ignore[attr-defined]
    sep = "&" if "?" in url else "?"
    publisher = from_url(f"{url}{sep}allow_system=$KV.cfg.*,__consumer_offsets")
    assert isinstance(publisher, cls)
    assert publisher.guard.allow_system == ("$KV.cfg.*", "__consumer_offsets")


def test_allow_system_leaves_the_rest_of_the_url_as_it_was() -> None:
    url = "https://h.invalid/hooks/{topic}?a=%7Bkey%7D&allow_system=%24KV.*&b=2#f"
    assert split_allow_system(url) == (
        "https://h.invalid/hooks/{topic}?a=%7Bkey%7D&b=2#f",
        ("$KV.*",),
    )
    assert split_allow_system("nats://h:4222?allow_system=$KV.*") == ("nats://h:4222", ("$KV.*",))
    assert split_allow_system("nats://h:4222?timeout=1") == ("nats://h:4222?timeout=1", ())
    with pytest.raises(ConfigurationError, match="needs at least one destination glob"):
        split_allow_system("nats://h:4222?allow_system=,")


def test_a_publisher_without_a_guard_cannot_be_given_allow_system() -> None:
    routed = RoutingPublisher(NatsPublisher(["nats://127.0.0.1:4222"]), ["a=b"])
    with pytest.raises(ConfigurationError, match="no system destinations to allow"):
        allow_system_destinations(routed, ["$KV.*"])


# -- item 8: the same rules at construction and at publish -----------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"topic": "orders\ud800"}, "topic contains a lone surrogate"),
        ({"event_type": "order\udfff"}, "event_type contains a lone surrogate"),
        ({"key": "k\ud83d"}, "key contains a lone surrogate"),
        ({"aggregate_type": "\udc00"}, "aggregate_type contains a lone surrogate"),
        ({"aggregate_id": "4\ud800"}, "aggregate_id contains a lone surrogate"),
        ({"headers": {"x-note": "a\ud800"}}, "header 'x-note' contains a lone surrogate"),
        ({"headers": {"x\ud800": "1"}}, "is not an HTTP token"),
        ({"schema_version": "v\ud800"}, "schema_version must be 1 to 64 printable"),
        ({"payload": {"note": "\ud800"}}, "surrogates not allowed"),
    ],
)
def test_a_lone_surrogate_is_refused_at_construction(
    overrides: dict[str, Any], reason: str
) -> None:
    with pytest.raises(InvalidEventError, match=reason):
        _event(**overrides)


def test_a_proper_surrogate_pair_is_just_a_character() -> None:
    assert _event(key="k\U0001f600", headers={"x-e": "\U0001f600"}).key == "k\U0001f600"


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"topic": "orders\u00a0placed"}, "topic contains whitespace"),
        ({"topic": "orders\u2003"}, "topic contains whitespace"),
        ({"topic": "orders\ud800"}, "lone surrogate"),
        ({"topic": "$JS.API.STREAM.DELETE.X"}, "is a system destination"),
        ({"topic": "  "}, "topic is empty"),
        ({"event_type": ""}, "event_type is empty"),
        ({"event_type": "a\nb"}, "control character"),
        ({"key": "k\x00"}, "control character"),
        ({"headers": {"CE-ID": "0190a0a0-0000-7000-8000-00000000beef"}}, "reserved by outboxkit"),
        ({"headers": {"ce_id": "forged"}}, "reserved by outboxkit"),
        ({"headers": {"ce-type": "forged"}}, "reserved by outboxkit"),
        ({"headers": {"Status": "500"}}, "reserved by NATS"),
        ({"headers": {"CC": "other-queue"}}, "reserved by RabbitMQ"),
        ({"headers": {f"h{i}": "v" for i in range(68)}}, "68 headers, over the limit of 67"),
        ({"schema_version": "x" * 65}, "schema_version"),
    ],
)
def test_a_row_written_around_event_is_refused_at_publish_by_the_same_rules(
    overrides: dict[str, Any], reason: str
) -> None:
    for broker in ("nats", "kafka", "rabbitmq", "redis", "sqs", "webhook"):
        refused = Guard(broker).refuse(_message(**overrides))
        assert refused is not None, broker
        assert not refused.retryable and refused.error_class == "invalid_event"
        assert refused.error is not None and reason in refused.error
        assert refused.error.startswith(f"{broker}: ")
        assert "the rules of Event()" in refused.error


def test_what_event_builds_passes_the_publish_time_check() -> None:
    """Event() adds traceparent/tracestate/content-type: a full event is still publishable."""
    event = _event(
        key="k" * limits.MAX_KEY_BYTES,
        headers={f"h{i}": "v" * limits.MAX_HEADER_VALUE_BYTES for i in range(limits.MAX_HEADERS)},
        payload=b"raw",
        schema_version="2.1",
    )
    message = _message(
        topic=event.topic,
        key=event.key,
        headers={**event.headers, "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
        schema_version=event.schema_version,
    )
    assert len(message.headers) == limits.MAX_HEADERS + 2
    assert Guard("nats").refuse(message) is None


def test_the_verdict_caches_never_keep_an_oversized_topic_or_header_name() -> None:
    """Rows written by SQL reach the publish-time check with topics and header names of up to
    64 KiB: 4 096 cached verdicts of such strings would hold 256 MiB."""
    big = "t" * (limits.STORE_MAX_TEXT_BYTES - 1)
    refused = Guard("kafka").refuse(_message(topic=big, headers={"n" * 5000: "1"}))
    assert refused is not None and "over the limit of 255" in (refused.error or "")
    assert Guard("kafka").refuse(_message(headers={"n" * 5000: "1"})) is not None
    assert big not in limits._TOPIC_VERDICTS
    assert "n" * 5000 not in limits._NAME_VERDICTS
    nats_publisher = NatsPublisher(["nats://127.0.0.1:4222"])
    assert nats_publisher._problem(_message(topic=big)) is None  # not NATS's rule: the guard's
    assert nats_publisher.guard.refuse(_message(topic=big)) is not None
    assert big not in nats_publisher._seen
    redis_publisher = RedisStreamsPublisher.from_url("redis://127.0.0.1:6379/0?allow=t*")
    assert redis_publisher.destinations.resolve(big) == (big, None)
    assert big not in redis_publisher.destinations._verdicts


# -- the guard's memory: shapes that passed, never verdicts ------------------------------------


_HOSTILE_OF_A_KNOWN_SHAPE = [
    {"key": "customer-1\r\nx"},
    {"key": "k" * (limits.MAX_KEY_BYTES + 1)},
    {"key": "k\ud800"},
    {"aggregate_id": "42\x00"},
    {"aggregate_id": "4" * (limits.MAX_AGGREGATE_ID_BYTES + 1)},
    {"headers": {"tenant": "acme\r\nNats-Rollup: all"}},
    {"headers": {"tenant": "a" * (limits.MAX_HEADER_VALUE_BYTES + 1)}},
    {"headers": {"tenant": "acme", "Nats-Rollup": "sub"}},
    {"headers": {"tenant": "acme", "x y": "1"}},
    {"headers": {"ce_id": "forged"}},
    {"headers": {f"h{i}": "v" for i in range(limits.MAX_HEADERS + limits.ADDED_HEADERS + 1)}},
]


@pytest.mark.parametrize("hostile", _HOSTILE_OF_A_KNOWN_SHAPE)
def test_a_hostile_row_of_a_shape_the_guard_passed_before_is_still_refused(
    hostile: dict[str, Any],
) -> None:
    """The guard skips re-judging what repeats (topic, type, aggregate type, header names)
    once an event with them passed. A cache of verdicts per shape would let a row written by
    SQL with a known topic and a CR LF key through; the guard still checks what varies."""
    guard = Guard("nats")
    for _ in range(3):
        assert guard.refuse(_message()) is None  # the shape and its header names are known
    message = _message(**hostile)
    full_check = Guard("nats").refuse(message)  # a guard that never saw the shape
    assert full_check is not None and not full_check.retryable
    assert guard.refuse(message) == full_check
    assert guard.refuse(_message()) is None


def test_allowing_a_system_destination_later_is_not_masked_by_the_guards_memory() -> None:
    guard = Guard("nats")
    system = _message(topic="$KV.orders.1", headers={})
    assert guard.refuse(system) is not None
    guard.allow_system = ("$KV.orders.*",)
    assert guard.refuse(system) is None
    assert guard.refuse(system) is None  # now a known shape
    guard.allow_system = ()
    refused = guard.refuse(system)
    assert refused is not None and "system" in (refused.error or "")
