"""RabbitMQ, Redis, SQS and webhook publishers: URLs, wire format, signing, routing (no servers)."""

from __future__ import annotations

import base64
import datetime as dt
import time
import uuid
from collections.abc import Sequence

import orjson
import pytest
from click.testing import CliRunner
from standardwebhooks import Webhook

from outboxkit import ConfigurationError, from_url
from outboxkit.ops.cli import main
from outboxkit.publishers.base import OutboundMessage, PublishResult
from outboxkit.publishers.rabbitmq import RabbitMQPublisher
from outboxkit.publishers.rabbitmq import _message as amqp_message
from outboxkit.publishers.redis import RedisStreamsPublisher
from outboxkit.publishers.routing import Route, RoutingPublisher, with_routes
from outboxkit.publishers.sqs import SqsPublisher, _entry
from outboxkit.publishers.webhook import WebhookPublisher, _retry_after, decode_secret, sign
from outboxkit.wire.rabbitmq import encode_headers as amqp_headers
from outboxkit.wire.redis import encode as redis_fields

EVENT_ID = uuid.UUID("0190a0a0-0000-7000-8000-000000000001")


def _message(**overrides: object) -> OutboundMessage:
    fields: dict[str, object] = {
        "event_id": EVENT_ID,
        "topic": "orders",
        "key": "customer-1",
        "event_type": "order.placed",
        "aggregate_type": "order",
        "aggregate_id": "42",
        "payload": b'{"total": 1}',
        "headers": {"tenant": "acme"},
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    }
    fields.update(overrides)
    return OutboundMessage(**fields)  # type: ignore[arg-type]


# -- scheme table ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("amqp://guest:guest@127.0.0.1:5672/", RabbitMQPublisher),
        ("amqps://u:p@mq.example.com/prod?exchange=events", RabbitMQPublisher),
        ("redis://127.0.0.1:6379/0", RedisStreamsPublisher),
        ("rediss://:pw@cache.example.com:6380/1", RedisStreamsPublisher),
        ("sqs://orders?region=eu-west-1", SqsPublisher),
        ("https://hooks.example.com/in/{topic}", WebhookPublisher),
        ("http://127.0.0.1:8080/hooks", WebhookPublisher),
    ],
)
def test_from_url_picks_the_new_publishers_by_scheme(url: str, kind: type) -> None:
    assert isinstance(from_url(url), kind)


# -- RabbitMQ ----------------------------------------------------------------------


def test_rabbitmq_url_options_and_defaults() -> None:
    default = RabbitMQPublisher.from_url("amqp://guest:guest@127.0.0.1/")
    assert (default._exchange_name, default._exchange_type) == ("outboxkit", "topic")
    p = RabbitMQPublisher.from_url(
        "amqp://app:s3cret@mq:5672/shop?exchange=events&exchange_type=direct&timeout=2.5"
        "&heartbeat=30&max_message_bytes=1000"
    )
    assert (p._exchange_name, p._exchange_type, p._timeout) == ("events", "direct", 2.5)
    assert p._max_message_bytes == 1000
    assert p._url == "amqp://app:s3cret@mq:5672/shop?heartbeat=30", "only aiormq's options left"
    assert "s3cret" not in repr(p)


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("amqp:///", "needs a host"),
        ("amqp://h/?exchange_type=weird", "exchange_type"),
        ("amqp://h/?timeout=soon", "not a number"),
        ("amqp://h/?declare=maybe", "true or false"),
        ("amqp://h/?routing=x", "unknown rabbitmq URL option"),
        ("amqp://h:port/", "invalid port"),
    ],
)
def test_bad_rabbitmq_urls_are_refused_with_a_hint(url: str, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=hint):
        RabbitMQPublisher.from_url(url)


def test_amqp_message_carries_properties_idempotency_key_and_cloudevents_headers() -> None:
    message = amqp_message(_message(headers={"tenant": "acme", "traceparent": "00-a-b-01"}))
    assert message.message_id == str(EVENT_ID)
    assert message.content_type == "application/json"
    assert message.type == "order.placed"
    assert message.app_id == "outboxkit"
    assert message.delivery_mode == 2
    assert message.timestamp == dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    headers = message.headers
    assert list(headers)[:3] == ["tenant", "traceparent", "idempotency-key"], "user headers first"
    assert headers["idempotency-key"] == str(EVENT_ID)
    assert headers["cloudEvents_id"] == str(EVENT_ID)
    assert headers["cloudEvents_specversion"] == "1.0"
    assert headers["cloudEvents_source"] == "/outboxkit/order"
    assert headers["cloudEvents_subject"] == "42"
    assert headers["cloudEvents_partitionkey"] == "customer-1"
    assert "cloudEvents_datacontenttype" not in headers


def test_amqp_user_headers_cannot_forge_the_ids() -> None:
    headers = amqp_headers(
        _message(headers={"idempotency-key": "forged", "cloudEvents_id": "forged", "x": "1"})
    )
    assert headers["idempotency-key"] == str(EVENT_ID)
    assert headers["cloudEvents_id"] == str(EVENT_ID)
    assert headers["x"] == "1"


# -- Redis ---------------------------------------------------------------------------


def test_redis_url_options() -> None:
    p = RedisStreamsPublisher.from_url(
        "redis://:pw@127.0.0.1:6379/2?maxlen=1000&dedup_window=300&timeout=3"
        "&wait_replicas=1&wait_timeout=0.5&client_name=relay"
    )
    assert (p._maxlen, p._dedup_window, p._timeout) == (1000, 300, 3.0)
    assert (p._wait_replicas, p._wait_ms) == (1, 500)
    assert p._url == "redis://:pw@127.0.0.1:6379/2?client_name=relay"
    assert "pw" not in repr(p)


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("redis://", "needs a host"),
        ("redis://h/x", "database number"),
        ("redis://h/0?maxlen=0", "maxlen"),
        ("redis://h/0?maxlen=many", "not an integer"),
        ("redis://h/0?dedup_window=-1", "dedup_window"),
        ("redis://h/0?stream=x", "unknown redis URL option"),
    ],
)
def test_bad_redis_urls_are_refused_with_a_hint(url: str, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=hint):
        RedisStreamsPublisher.from_url(url)


def test_redis_fields_follow_the_wire_format() -> None:
    fields = redis_fields(_message())
    assert next(iter(fields)) == "data"
    assert fields["data"] == b'{"total": 1}'
    assert fields["ce_id"] == str(EVENT_ID)
    assert fields["ce_datacontenttype"] == "application/json"
    assert fields["ce_partitionkey"] == "customer-1"
    assert orjson.loads(fields["headers"]) == {"tenant": "acme"}
    bare = redis_fields(_message(headers={}, key=None, aggregate_id=None))
    assert "headers" not in bare and "ce_partitionkey" not in bare and "ce_subject" not in bare


# -- SQS -----------------------------------------------------------------------------


def test_sqs_url_options() -> None:
    p = SqsPublisher.from_url(
        "sqs://orders.fifo?region=eu-west-1&endpoint_url=http://127.0.0.1:4566"
        "&timeout=3&concurrency=8&max_message_bytes=1048576"
    )
    assert (p._queue, p._region, p._endpoint_url) == (
        "orders.fifo",
        "eu-west-1",
        "http://127.0.0.1:4566",
    )
    assert (p._timeout, p._concurrency, p._max_message_bytes) == (3.0, 8, 1048576)
    assert SqsPublisher.from_url("sqs://{topic}?region=eu-west-1")._queue == "{topic}"


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("sqs://?region=x", "needs a queue name"),
        ("sqs://bad name?region=x", "invalid SQS queue name"),
        ("sqs://key:secret@orders?region=x", "credentials"),
        ("sqs://orders?region=x&concurrency=0", "concurrency"),
        ("sqs://orders?region=x&visibility=3", "unknown sqs URL option"),
    ],
)
def test_bad_sqs_urls_are_refused_with_a_hint(url: str, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=hint):
        SqsPublisher.from_url(url)


def test_sqs_without_any_region_says_where_to_set_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(ConfigurationError, match=r"\?region="):
        SqsPublisher.from_url("sqs://orders")


def test_sqs_entry_attributes_and_fifo_ids() -> None:
    entry, size = _entry(3, _message(), fifo=True)
    attrs = {k: v["StringValue"] for k, v in entry["MessageAttributes"].items()}
    assert entry["Id"] == "3"
    assert entry["MessageBody"] == '{"total": 1}'
    assert entry["MessageGroupId"] == "customer-1"
    assert entry["MessageDeduplicationId"] == str(EVENT_ID)
    assert set(attrs) == {
        "ce_id",
        "ce_type",
        "ce_source",
        "ce_time",
        "ce_specversion",
        "content-type",
        "ce_subject",
        "ce_partitionkey",
        "headers",
    }
    assert all(v["DataType"] == "String" for v in entry["MessageAttributes"].values())
    assert size > len(entry["MessageBody"])
    keyless, _ = _entry(0, _message(key=None), fifo=True)
    assert keyless["MessageGroupId"] == "orders", "no key: grouped by topic"
    standard, _ = _entry(0, _message(), fifo=False)
    assert "MessageGroupId" not in standard and "MessageDeduplicationId" not in standard


@pytest.mark.parametrize(
    ("payload", "encoded"),
    [
        (b'{"a": "\xc3\xa9"}', False),  # UTF-8 text SQS allows
        (b"\xff\xfe", True),  # not UTF-8
        (b"bell \x07", True),  # UTF-8, but a character SQS refuses
        (b"\xef\xbf\xbf", True),  # U+FFFF, outside SQS's character set
    ],
)
def test_sqs_body_is_text_when_sqs_allows_it_else_base64(payload: bytes, encoded: bool) -> None:
    entry, _ = _entry(0, _message(payload=payload), fifo=False)
    attrs = entry["MessageAttributes"]
    assert ("content-transfer-encoding" in attrs) is encoded
    if encoded:
        assert base64.b64decode(entry["MessageBody"]) == payload
    else:
        assert entry["MessageBody"].encode() == payload


# -- webhooks --------------------------------------------------------------------------


def test_webhook_signature_verifies_with_standardwebhooks() -> None:
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    timestamp = str(int(time.time()))
    body = b'{"total": 1}'
    signature = sign(decode_secret(secret), "evt-1", timestamp, body)
    headers = {
        "webhook-id": "evt-1",
        "webhook-timestamp": timestamp,
        "webhook-signature": signature,
    }
    assert Webhook(secret).verify(body, headers) == {"total": 1}
    assert decode_secret(secret.removeprefix("whsec_")) == decode_secret(secret)


def test_webhook_secret_comes_from_the_environment_never_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigurationError, match="never put the webhook secret in the URL"):
        WebhookPublisher.from_url("https://h/x?secret=abc")
    monkeypatch.delenv("HOOK_SECRET", raising=False)
    with pytest.raises(ConfigurationError, match="HOOK_SECRET .* is not set"):
        WebhookPublisher.from_url("https://h/x?secret_env=HOOK_SECRET")
    monkeypatch.setenv("HOOK_SECRET", "not base64!")
    with pytest.raises(ConfigurationError, match="base64"):
        WebhookPublisher.from_url("https://h/x?secret_env=HOOK_SECRET")
    monkeypatch.setenv("HOOK_SECRET", "whsec_c2VjcmV0LXNlY3JldA==")
    p = WebhookPublisher.from_url("https://h/x?secret_env=HOOK_SECRET&timeout=3&concurrency=4")
    assert p._secret == b"secret-secret"
    assert (p._timeout, p._concurrency) == (3.0, 4)
    assert "c2Vj" not in repr(p)


def test_webhook_url_template_is_filled_and_quoted_per_event() -> None:
    p = WebhookPublisher.from_url("https://h/in/{topic}/{event_type}?k={key}&v=1")
    url = p.url_for(_message(topic="orders/eu west", key="a&b"))
    assert url == "https://h/in/orders%2Feu%20west/order.placed?k=a%26b&v=1"
    with pytest.raises(ValueError, match="no key"):
        p.url_for(_message(key=None))


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("https://h/{tenant}", "unknown placeholder"),
        ("https://{topic}.example.com/", "path and query"),
        ("https://h/{topic", "malformed"),
        ("https://h/x?timeout=0", "positive"),
        ("ftp://h/x", "not an http"),
    ],
)
def test_bad_webhook_urls_are_refused_with_a_hint(url: str, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=hint):
        WebhookPublisher.from_url(url)


def test_webhook_headers_keep_outboxkit_ids_over_user_headers() -> None:
    p = WebhookPublisher.from_url("https://h/x")
    message = _message(
        headers={"webhook-id": "forged", "CE-ID": "forged", "Idempotency-Key": "f", "x": "é"}
    )
    headers = {k.decode(): v.decode() for k, v in p._headers(message, message.payload)}
    assert headers["webhook-id"] == headers["Idempotency-Key"] == str(EVENT_ID)
    assert headers["ce-id"] == str(EVENT_ID)
    assert "CE-ID" not in headers
    assert headers["x"] == "é"
    assert headers["content-type"] == "application/json"
    assert "webhook-signature" not in headers, "unsigned without a secret"
    with pytest.raises(ValueError, match="cannot be sent over HTTP"):
        p._headers(_message(headers={"x": "a\r\nInjected: 1"}), b"")


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert _retry_after("2") == 2.0
    assert _retry_after(None) is None
    assert _retry_after("soon") is None
    in_a_minute = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=60)
    parsed = _retry_after(in_a_minute.strftime("%a, %d %b %Y %H:%M:%S GMT"))
    assert parsed is not None and 55 < parsed <= 60


# -- routing ---------------------------------------------------------------------------


class _Recorder:
    """A publisher that records what it was given (a pure unit: no broker involved)."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[OutboundMessage] = []
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        self.seen += messages
        return [PublishResult.success() for _ in messages]

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("rule", "route"),
    [
        ("order.*=orders", Route("event_type", "order.*", "orders")),
        ("type:invoice.paid=billing", Route("event_type", "invoice.paid", "billing")),
        ("aggregate:customer=customers", Route("aggregate_type", "customer", "customers")),
        ("topic:legacy.*=archive", Route("topic", "legacy.*", "archive")),
        (" order.* = orders ", Route("event_type", "order.*", "orders")),
    ],
)
def test_route_rules_parse(rule: str, route: Route) -> None:
    assert Route.parse(rule) == route


@pytest.mark.parametrize("rule", ["orders", "=x", "order.*=", "aggregate:=x"])
def test_bad_route_rules_are_refused_with_an_example(rule: str) -> None:
    with pytest.raises(ConfigurationError, match="route"):
        Route.parse(rule)


async def test_routing_publisher_rewrites_topics_first_match_wins() -> None:
    inner = _Recorder()
    publisher = RoutingPublisher(
        inner, ["order.cancelled=cancellations", "order.*=orders", "aggregate:cust*=customers"]
    )
    assert publisher.name == "recorder"
    await publisher.start()
    results = await publisher.publish_batch(
        [
            _message(event_type="order.placed"),
            _message(event_type="order.cancelled"),
            _message(event_type="customer.moved", aggregate_type="customer"),
            _message(event_type="invoice.paid", topic="billing", aggregate_type=None),
        ]
    )
    await publisher.close()
    assert [m.topic for m in inner.seen] == ["orders", "cancellations", "customers", "billing"]
    assert [m.event_id for m in inner.seen] == [EVENT_ID] * 4, "only the topic changes"
    assert all(r.ok for r in results)
    assert inner.started and inner.closed


def test_with_routes_wraps_only_when_there_are_routes() -> None:
    inner = _Recorder()
    assert with_routes(inner, []) is inner
    assert isinstance(with_routes(inner, ["a=b"]), RoutingPublisher)


def test_relay_command_refuses_a_bad_route_before_starting() -> None:
    result = CliRunner().invoke(
        main,
        [
            "relay",
            "--dsn",
            "postgresql://nobody@127.0.0.1:1/none",
            "--broker",
            "redis://127.0.0.1:6379/0",
            "--route",
            "order.*",
        ],
    )
    assert result.exit_code == 2
    assert "PATTERN=DESTINATION" in result.output


def test_relay_batch_shape_follows_the_publisher_unless_given() -> None:
    from outboxkit import Relay
    from outboxkit.publishers.kafka import KafkaPublisher
    from outboxkit.publishers.routing import with_routes
    from outboxkit.publishers.webhook import WebhookPublisher

    kafka = KafkaPublisher({"bootstrap.servers": "127.0.0.1:9"})
    relay = Relay("postgresql://x", kafka)
    assert (relay.batch_size, relay.max_in_flight) == (1000, 4)
    routed = Relay("postgresql://x", with_routes(kafka, ["order.*=orders"]))
    assert (routed.batch_size, routed.max_in_flight) == (1000, 4)
    hook = Relay("postgresql://x", WebhookPublisher.from_url("http://127.0.0.1:9/{topic}"))
    assert (hook.batch_size, hook.max_in_flight) == (500, 2)
    given = Relay("postgresql://x", kafka, batch_size=50, max_in_flight=1)
    assert (given.batch_size, given.max_in_flight) == (50, 1)
