"""Broker URLs are parsed at the boundary; headers carry the envelope; errors are classified."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from confluent_kafka import KafkaError

from outboxkit import ConfigurationError, from_url
from outboxkit.publishers.base import OutboundMessage
from outboxkit.publishers.kafka import KafkaPublisher, _classify
from outboxkit.publishers.nats import NatsPublisher
from outboxkit.wire.kafka import encode_headers as kafka_headers
from outboxkit.wire.nats import encode_headers as nats_headers


def _message(**overrides: object) -> OutboundMessage:
    fields: dict[str, object] = {
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
    return OutboundMessage(**fields)  # type: ignore[arg-type]


def test_from_url_picks_the_publisher_by_scheme() -> None:
    assert isinstance(from_url("kafka://127.0.0.1:9092"), KafkaPublisher)
    assert isinstance(from_url("nats://127.0.0.1:4222"), NatsPublisher)


def test_unknown_scheme_names_the_supported_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"use one of amqp://, .*kafka://, .*nats://") as e:
        from_url("ftp://x")
    for scheme in ("sqs", "sns", "kinesis", "eventbridge", "celery+amqp", "celery+redis"):
        assert f"{scheme}://" in str(e.value)


def test_kafka_url_takes_shortcuts_and_librdkafka_properties() -> None:
    p = KafkaPublisher.from_url(
        "kafka://a:9092,b:9092?linger_ms=20&security.protocol=PLAINTEXT&delivery_timeout_ms=9000"
    )
    cfg = p._config
    assert cfg["bootstrap.servers"] == "a:9092,b:9092"
    assert cfg["linger.ms"] == "20"
    assert cfg["delivery.timeout.ms"] == "9000"
    assert cfg["security.protocol"] == "PLAINTEXT"
    assert cfg["enable.idempotence"] is True
    assert cfg["acks"] == "all"


def test_kafka_url_credentials_become_sasl_settings_and_stay_out_of_repr() -> None:
    p = KafkaPublisher.from_url("kafka://app:s3cret@broker:9092")
    assert p._config["sasl.password"] == "s3cret"
    assert "s3cret" not in repr(p)


@pytest.mark.parametrize("url", ["kafka://", "kafka://a:1,,b:2", "kafka://a:1?bogus=1"])
def test_bad_kafka_urls_are_refused_with_a_hint(url: str) -> None:
    with pytest.raises(ConfigurationError, match="kafka"):
        KafkaPublisher.from_url(url)


def test_kafka_headers_carry_idempotency_key_cloudevents_and_user_headers() -> None:
    headers = dict(kafka_headers(_message()))
    assert headers["idempotency-key"] == b"0190a0a0-0000-7000-8000-000000000001"
    assert headers["ce_id"] == headers["idempotency-key"]
    assert headers["ce_specversion"] == b"1.0"
    assert headers["ce_type"] == b"order.placed"
    assert headers["ce_subject"] == b"42"
    assert headers["ce_source"] == b"/outboxkit/order"
    assert headers["content-type"] == b"application/json"
    assert headers["tenant"] == b"acme"


def test_kafka_errors_no_retry_can_fix_are_permanent() -> None:
    assert not _classify(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)).retryable
    assert not _classify(KafkaError(KafkaError.TOPIC_EXCEPTION)).retryable
    assert _classify(KafkaError(KafkaError._MSG_TIMED_OUT)).retryable
    assert _classify(KafkaError(KafkaError._TRANSPORT)).retryable


def test_nats_url_options_and_servers() -> None:
    p = NatsPublisher.from_url("nats://u:pw@a:4222,b:4222?timeout=0.5&stream=S&subjects=x.>,y.>")
    assert p._servers == ["nats://u:pw@a:4222", "nats://u:pw@b:4222"]
    assert p._timeout == 0.5
    assert (p._stream, p._subjects) == ("S", ["x.>", "y.>"])
    assert "pw" not in repr(p)


@pytest.mark.parametrize(
    "url", ["nats://", "nats://a:1?timeout=soon", "nats://a:1?subjects=x.>", "nats://a:1?x=1"]
)
def test_bad_nats_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        NatsPublisher.from_url(url)


def test_nats_headers_cannot_be_overridden_by_user_headers() -> None:
    message = _message(headers={"Nats-Msg-Id": "forged", "ce-id": "forged", "tenant": "acme"})
    headers = nats_headers(message)
    assert headers["Nats-Msg-Id"] == str(message.event_id)
    assert headers["ce-id"] == str(message.event_id)
    assert headers["tenant"] == "acme"


def test_kafka_user_headers_cannot_forge_the_idempotency_key() -> None:
    message = _message(headers={"idempotency-key": "forged", "ce_id": "forged", "tenant": "a"})
    names = [name for name, _ in kafka_headers(message)]
    assert names.count("idempotency-key") == 1
    assert names.count("ce_id") == 1
    assert dict(kafka_headers(message))["idempotency-key"] == str(message.event_id).encode()


@pytest.mark.parametrize(
    ("url", "valid"),
    [
        ("nats://127.0.0.1:4222?stream=X&subject=orders", "timeout, stream, subjects"),
        ("nats://127.0.0.1:4222?streem=X", "timeout, stream, subjects"),
        ("kafka://127.0.0.1:9092?lingr_ms=5", "linger_ms"),
        ("amqp://guest:guest@127.0.0.1:5672/?exchang=e", "exchange, exchange_type"),
        ("redis://127.0.0.1:6379/0?maxln=5", "stream_prefix, allow, maxlen"),
        ("sqs://orders?region=eu-west-1&regoin=x", "region, endpoint_url"),
    ],
)
def test_an_unknown_url_option_is_named_unknown_with_the_valid_ones(url: str, valid: str) -> None:
    """Before: nats answered `option subject='orders' is not a number`.

    ConfigurationError is a ValueError, and an `except ValueError` around the number
    parsing rewrote the "unknown option" message.
    """
    with pytest.raises(ConfigurationError) as caught:
        from_url(url)
    message = str(caught.value)
    assert "unknown" in message and "not a number" not in message, message
    assert valid in message, message


def test_a_nats_number_option_that_is_not_a_number_says_so() -> None:
    with pytest.raises(ConfigurationError, match=r"timeout='soon' is not a number"):
        NatsPublisher.from_url("nats://a:1?timeout=soon")
    assert NatsPublisher.from_url("nats://a:1?stream=S&subjects=x.>&add_subjects=1")._add_subjects
