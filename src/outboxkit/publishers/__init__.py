"""Broker publishers behind one protocol; ``from_url`` picks one by URL scheme."""

from __future__ import annotations

import importlib
from typing import Any
from urllib.parse import urlsplit

from outboxkit._redact import remember_secrets
from outboxkit.errors import ConfigurationError, MissingExtraError, missing_extra
from outboxkit.publishers.base import OutboundMessage, Publisher, PublishResult, batch_shape
from outboxkit.publishers.reserved import allow_system_destinations, split_allow_system

__all__ = ["OutboundMessage", "PublishResult", "Publisher", "from_url"]

_SCHEMES = {
    "kafka": "outboxkit.publishers.kafka:KafkaPublisher",
    "nats": "outboxkit.publishers.nats:NatsPublisher",
    "amqp": "outboxkit.publishers.rabbitmq:RabbitMQPublisher",
    "amqps": "outboxkit.publishers.rabbitmq:RabbitMQPublisher",
    "redis": "outboxkit.publishers.redis:RedisStreamsPublisher",
    "rediss": "outboxkit.publishers.redis:RedisStreamsPublisher",
    "sqs": "outboxkit.publishers.sqs:SqsPublisher",
    "sns": "outboxkit.publishers.sns:SnsPublisher",
    "kinesis": "outboxkit.publishers.kinesis:KinesisPublisher",
    "eventbridge": "outboxkit.publishers.eventbridge:EventBridgePublisher",
    "http": "outboxkit.publishers.webhook:WebhookPublisher",
    "https": "outboxkit.publishers.webhook:WebhookPublisher",
    "celery+amqp": "outboxkit.publishers.celery:CeleryAmqpPublisher",
    "celery+amqps": "outboxkit.publishers.celery:CeleryAmqpPublisher",
    "celery+redis": "outboxkit.publishers.celery:CeleryRedisPublisher",
    "celery+rediss": "outboxkit.publishers.celery:CeleryRedisPublisher",
    "memory": "outboxkit.publishers.memory:MemoryPublisher",  # in-process, for tests
}


def from_url(url: str) -> Publisher:
    """Build the publisher for a broker URL such as ``kafka://127.0.0.1:9092``.

    Broker modules are imported lazily, so a deployment needs only the client
    library of the broker it uses. Every broker takes ``allow_system=GLOB,...``: the
    system destinations (``$KV.orders.*``, ``__consumer_offsets``, ...) this deployment
    really publishes to, refused otherwise (``publishers.reserved``).
    """
    remember_secrets(url)  # a client's error may quote its token without the URL
    scheme = urlsplit(url).scheme.lower()
    if scheme not in _SCHEMES:
        known = ", ".join(f"{s}://" for s in sorted(_SCHEMES) if s != "memory")
        raise ConfigurationError(
            f"unsupported broker URL scheme {scheme!r}; use one of {known}"
            " (memory:// in tests: outboxkit.publishers.memory)"
        )
    url, allow_system = split_allow_system(url)
    publisher: Publisher = _publisher_class(scheme).from_url(url)
    if allow_system:
        allow_system_destinations(publisher, allow_system)
    return publisher


def batch_shapes() -> dict[str, tuple[int, int] | None]:
    """Each broker's (batch_size, max_in_flight) by URL scheme; None if its client is missing.

    Read from the publisher classes themselves, for ``outboxkit relay --help``.
    """
    shapes: dict[str, tuple[int, int] | None] = {}
    for scheme in _SCHEMES:
        if scheme == "memory":  # the tests' in-process broker: no deployment's choice
            continue
        try:
            shapes[scheme] = batch_shape(_publisher_class(scheme))
        except MissingExtraError:
            shapes[scheme] = None
    return shapes


def _publisher_class(scheme: str) -> Any:
    """The publisher class for ``scheme``, its module imported now.

    A broker client that is not installed is a one-line :class:`MissingExtraError`
    naming the extra; a missing outboxkit module is a bug and raised as it is.
    """
    module_name, _, class_name = _SCHEMES[scheme].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.startswith("outboxkit"):
            raise
        raise missing_extra(exc, f"the {scheme}:// broker") from exc
    return getattr(module, class_name)
