"""The Publisher protocol every broker module implements, and the message it receives."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from outboxkit._cloudevents import encode_header_value

DEFAULT_CONTENT_TYPE = "application/json"


@dataclass(slots=True)
class OutboundMessage:
    """An event as the relay hands it to a publisher: claimed, not yet confirmed.

    Treat it as read-only (``dataclasses.replace`` makes a changed copy). It is not
    frozen because the relay builds hundreds of thousands per second and a frozen
    dataclass's ``__init__`` costs five times as much.
    """

    event_id: uuid.UUID
    topic: str
    key: str | None
    event_type: str
    aggregate_type: str | None
    aggregate_id: str | None
    payload: bytes
    headers: dict[str, str]
    created_at: dt.datetime
    attempt: int = 1
    #: When the fact happened (``Event.occurred_at``); None only for rows written before
    #: schema version 2, which fall back to ``created_at``.
    occurred_at: dt.datetime | None = None
    schema_version: str | None = None

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", DEFAULT_CONTENT_TYPE)

    @property
    def time(self) -> dt.datetime:
        """The event's time on every broker (CloudEvents ``time``, message timestamps)."""
        return self.occurred_at if self.occurred_at is not None else self.created_at

    def cloudevents_attributes(self) -> dict[str, str]:
        """CloudEvents 1.0 attributes (binary mode), without a binding's prefix.

        Every broker binding carries the same metadata: Kafka as ``ce_*`` and AMQP
        as ``cloudEvents_*`` headers holding the UTF-8 values as they are; NATS and
        HTTP as percent-encoded ``ce-*`` headers (:meth:`cloudevents_headers`).
        ``schemaversion`` is outboxkit's extension attribute for ``Event.schema_version``.
        """
        attrs = {
            "specversion": "1.0",
            "id": str(self.event_id),
            "type": self.event_type,
            "source": f"/outboxkit/{self.aggregate_type}" if self.aggregate_type else "/outboxkit",
            "time": self.time.isoformat(),
            "datacontenttype": self.content_type,
        }
        if self.aggregate_id is not None:
            attrs["subject"] = self.aggregate_id
        if self.key is not None:
            attrs["partitionkey"] = self.key
        if self.schema_version is not None:
            attrs["schemaversion"] = self.schema_version
        # CloudEvents distributed-tracing extension: the write-time W3C trace context.
        for name in ("traceparent", "tracestate"):
            value = self.headers.get(name)
            if value:
                attrs[name] = value
        return attrs

    def cloudevents_headers(self) -> dict[str, str]:
        """``ce-<attr>`` headers of the HTTP and NATS bindings, values percent-encoded.

        Those bindings allow only printable ASCII in a header: space, ``"``, ``%``
        and anything else are sent as ``%XX`` UTF-8 bytes (HTTP binding 1.0.2
        §3.1.3.2), so the CloudEvents SDKs decode every attribute exactly.
        ``datacontenttype`` is left to the caller (HTTP carries it as ``content-type``).
        """
        # Built directly (the relay's hot path): the id, the version and the RFC 3339 time
        # are printable ASCII without space, '"' or '%', so only free text is encoded.
        encode = encode_header_value
        aggregate_type = self.aggregate_type
        headers = {
            "ce-specversion": "1.0",
            "ce-id": str(self.event_id),
            "ce-type": encode(self.event_type),
            "ce-source": encode(f"/outboxkit/{aggregate_type}") if aggregate_type else "/outboxkit",
            "ce-time": self.time.isoformat(),
        }
        if self.aggregate_id is not None:
            headers["ce-subject"] = encode(self.aggregate_id)
        if self.key is not None:
            headers["ce-partitionkey"] = encode(self.key)
        if self.schema_version is not None:
            headers["ce-schemaversion"] = encode(self.schema_version)
        for name in ("traceparent", "tracestate"):
            value = self.headers.get(name)
            if value:
                headers[f"ce-{name}"] = encode(value)
        return headers

    def user_headers(self) -> dict[str, str]:
        """Headers written by the application (content-type is carried as a CE attribute)."""
        return {k: v for k, v in self.headers.items() if k != "content-type"}


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The broker's verdict on one message.

    ``ok`` only after the broker's durable confirmation. A failure is
    ``retryable`` unless the broker will never accept the message as it is
    (too large, invalid destination): those are dead-lettered at once.
    """

    ok: bool
    error: str | None = None
    retryable: bool = True
    error_class: str = field(default="", compare=False)
    #: Seconds the broker asked us to wait (HTTP ``Retry-After``): the next try is
    #: scheduled no earlier, so a long wait does not burn attempts.
    retry_after: float | None = field(default=None, compare=False)
    #: False when the broker never judged the message because the publisher's own client
    #: failed (a fenced Kafka producer, recreated): the relay hands the row back without
    #: counting the attempt, so a client failure cannot dead-letter healthy events.
    counts_attempt: bool = field(default=True, compare=False)

    @classmethod
    def success(cls) -> PublishResult:
        return _SUCCESS

    @classmethod
    def retry(
        cls, error: str, error_class: str = "transient", *, retry_after: float | None = None
    ) -> PublishResult:
        return cls(
            ok=False, error=error, retryable=True, error_class=error_class, retry_after=retry_after
        )

    @classmethod
    def permanent(cls, error: str, error_class: str = "rejected") -> PublishResult:
        return cls(ok=False, error=error, retryable=False, error_class=error_class)

    @classmethod
    def hand_back(
        cls, error: str, error_class: str = "handed_back", *, retry_after: float | None = None
    ) -> PublishResult:
        """Not tried, through no fault of the message: publish it again, attempt not counted."""
        return cls(
            ok=False,
            error=error,
            retryable=True,
            error_class=error_class,
            retry_after=retry_after,
            counts_attempt=False,
        )


_SUCCESS = PublishResult(ok=True)


#: (batch_size, max_in_flight) a relay uses unless told otherwise.
DEFAULT_BATCH_SHAPE = (500, 2)


def batch_shape(publisher: object) -> tuple[int, int]:
    """The batch shape a publisher suits best: its ``batch_shape`` attribute, if it has one.

    Brokers that confirm a batch in one round trip and keep a deep pipeline (Kafka,
    NATS, Redis) move more events per second with larger, overlapping batches; a
    broker confirming per message at a fixed concurrency (webhooks, SQS, RabbitMQ)
    would only queue them, closer to the publish deadline.
    """
    shape = getattr(publisher, "batch_shape", None)
    if (
        isinstance(shape, tuple)
        and len(shape) == 2
        and all(isinstance(v, int) and v >= 1 for v in shape)
    ):
        return shape[0], shape[1]
    return DEFAULT_BATCH_SHAPE


@runtime_checkable
class Publisher(Protocol):
    """What the relay needs from a broker. One small module per broker implements it.

    ``publish_batch`` returns one result per message, in the same order, and
    must not raise for per-message failures; an exception means "the whole batch
    failed, retry all of it". Implementations must be safe to call
    concurrently (the relay keeps two batches in flight).
    """

    name: str

    async def start(self) -> None:
        """Connect; called once before the first batch."""

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        """Publish and wait for the broker's confirmation of each message."""
        ...

    async def close(self) -> None:
        """Flush what can be flushed and disconnect."""
