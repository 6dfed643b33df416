"""What every consumer runner shares: the received event, the handler call, the bookkeeping.

Each broker module turns its message into a :class:`ReceivedEvent` and calls
:func:`_invoke`, the single place where an event meets the consumer's
database: one transaction holding the inbox record and the handler's effect.
The runner acknowledges the message only after that transaction committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg

from outboxkit._backoff import full_jitter
from outboxkit._redact import redact
from outboxkit.backends.postgres._connection import aconnect
from outboxkit.errors import ConfigurationError, EnvelopeError
from outboxkit.inbox import Inbox
from outboxkit.tracing import consumer_span
from outboxkit.wire.cloudevents import Envelope

log = logging.getLogger("outboxkit.consumer")

DEFAULT_CONTENT_TYPE = "application/json"
# Longest redelivery delay, whatever retry_delay and the delivery count.
MAX_RETRY_DELAY = 60.0


@dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """An event as a consumer receives it, whatever the broker.

    ``headers`` are the application's headers (``traceparent`` included); the
    CloudEvents attributes are decoded into the fields (``time`` into
    ``occurred_at``, the ``schemaversion`` extension into ``schema_version``).
    ``delivery_count`` is the broker's count where it keeps one (1 on the first
    delivery).
    """

    event_id: uuid.UUID
    topic: str
    key: str | None
    event_type: str
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    content_type: str = DEFAULT_CONTENT_TYPE
    #: When the fact happened (``Event.occurred_at``, CloudEvents ``time``).
    occurred_at: dt.datetime | None = None
    delivery_count: int = 1
    #: ``Event.schema_version`` as a string (CloudEvents extension ``schemaversion``), if set.
    schema_version: str | None = None

    def json(self) -> Any:
        """The payload decoded as JSON (the default content type)."""
        return orjson.loads(self.payload)


#: ``async def handler(tx, event)``: runs inside the consumer's transaction, once per event.
Handler = Callable[[psycopg.AsyncConnection[Any], ReceivedEvent], Awaitable[None]]


def from_cloudevents(
    *,
    topic: str,
    payload: bytes,
    attributes: Mapping[str, str],
    headers: Mapping[str, str] | None = None,
    key: str | None = None,
    content_type: str | None = None,
    delivery_count: int = 1,
    fallback_id: str | None = None,
) -> ReceivedEvent:
    """Build a :class:`ReceivedEvent` from CloudEvents attributes (names without a prefix).

    ``fallback_id`` is the broker's own message id (AMQP ``message_id``, NATS
    ``Nats-Msg-Id``), used when the ``id`` attribute is missing.
    """
    raw_id = attributes.get("id") or fallback_id
    if not raw_id:
        raise EnvelopeError(
            f"message on {topic!r} carries no event id (CloudEvents 'id'); it was not"
            " published by an outboxkit relay and cannot be deduplicated"
        )
    try:
        event_id = uuid.UUID(raw_id)
    except ValueError:
        raise EnvelopeError(f"message on {topic!r} has an event id that is not a UUID") from None
    source = attributes.get("source", "")
    aggregate_type = (
        source.removeprefix("/outboxkit/") if source.startswith("/outboxkit/") else None
    )
    occurred_at = None
    if attributes.get("time"):
        with contextlib.suppress(ValueError):
            occurred_at = dt.datetime.fromisoformat(attributes["time"])
    return ReceivedEvent(
        event_id=event_id,
        topic=topic,
        key=attributes.get("partitionkey", key),
        event_type=attributes.get("type", ""),
        payload=payload,
        headers=dict(headers or {}),
        aggregate_type=aggregate_type,
        aggregate_id=attributes.get("subject"),
        content_type=content_type or attributes.get("datacontenttype") or DEFAULT_CONTENT_TYPE,
        occurred_at=occurred_at,
        delivery_count=delivery_count,
        schema_version=attributes.get("schemaversion"),
    )


def from_envelope(topic: str, envelope: Envelope, delivery_count: int = 1) -> ReceivedEvent:
    """The event in a message a broker's wire module (``outboxkit.wire``) took apart."""
    return from_cloudevents(
        topic=topic,
        payload=envelope.payload,
        attributes=envelope.attributes,
        headers=envelope.headers,
        key=envelope.key,
        content_type=envelope.content_type,
        delivery_count=delivery_count,
        fallback_id=envelope.fallback_id,
    )


def unwrap(topic: str, decode: Callable[[], Envelope], delivery_count: int = 1) -> ReceivedEvent:
    """``from_envelope`` of ``decode()``; a message it cannot read is an :class:`EnvelopeError`."""
    try:
        envelope = decode()
    except ValueError as exc:
        raise EnvelopeError(f"message on {topic!r}: {exc}") from None
    return from_envelope(topic, envelope, delivery_count)


# -- the database side -------------------------------------------------------------


class _Database:
    """One psycopg async connection to the consumer's database, reopened after a failure."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            await self.close()
            self._conn = await aconnect(
                self._dsn, application_name="outboxkit-consumer", autocommit=False
            )
        return self._conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


async def _invoke(
    db: _Database, inbox: Inbox, consumer: str, event: ReceivedEvent, handler: Handler
) -> bool:
    """Apply ``event`` once: inbox record and handler effect in one committed transaction.

    Returns True if the handler ran (first delivery), False for a duplicate.
    Raises whatever the handler or the database raised; the transaction is
    then rolled back and nothing of this delivery remains.
    """
    conn = await db.connection()
    attributes = {
        "messaging.destination.name": event.topic,
        "messaging.message.id": str(event.event_id),
        "messaging.consumer.group.name": consumer,
    }
    # A CONSUMER span continuing the trace the event carries from its write (no-op without otel).
    with consumer_span(f"{event.topic} process", event.headers, attributes):
        async with conn.transaction(), inbox.ahandle(conn, consumer, event.event_id) as fresh:
            if fresh:
                await handler(conn, event)
    return fresh


# -- runner bookkeeping -----------------------------------------------------------


@dataclass
class ConsumerStats:
    """Counts since the runner started; ``failed`` counts failed deliveries, not events."""

    applied: int = 0
    duplicates: int = 0
    failed: int = 0
    dead_lettered: int = 0


class ConsumerRunner:
    """The broker-independent half of every consumer runner: options, handler call, stop, stats.

    ``KafkaConsumer``, ``NatsConsumer`` and the others subclass it: each turns its
    broker's message into a :class:`ReceivedEvent` and acknowledges it only after
    the handler's transaction committed.
    """

    broker = "broker"

    def __init__(
        self,
        dsn: str,
        handler: Handler,
        *,
        consumer: str,
        inbox: Inbox | None = None,
        max_deliveries: int = 5,
        retry_delay: float = 1.0,
    ) -> None:
        if not isinstance(consumer, str) or not consumer.strip():
            raise ConfigurationError("consumer= must name the consumer, e.g. consumer='billing'")
        if max_deliveries < 1:
            raise ConfigurationError("max_deliveries must be at least 1")
        if retry_delay < 0:
            raise ConfigurationError("retry_delay must be >= 0 seconds")
        self.consumer = consumer
        self.inbox = inbox or Inbox()
        self.max_deliveries = max_deliveries
        self.retry_delay = retry_delay
        self.stats = ConsumerStats()
        self._handler = handler
        self._db = _Database(dsn)
        self._stopping = asyncio.Event()
        # One connection, one transaction at a time: deliveries handled concurrently
        # by a client library (aio-pika callbacks) take turns here.
        self._db_lock = asyncio.Lock()

    def stop(self) -> None:
        """Finish the message in hand, acknowledge what committed, then return from ``run()``."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def _apply(self, event: ReceivedEvent) -> bool:
        """Run the handler through the inbox; True if committed (applied or duplicate)."""
        try:
            async with self._db_lock:
                fresh = await _invoke(self._db, self.inbox, self.consumer, event, self._handler)
        except Exception as exc:
            self.stats.failed += 1
            if isinstance(exc, psycopg.OperationalError):
                await self._db.close()
            log.warning(
                "%s consumer %r: event %s (%s, delivery %d) failed, not acknowledged: %s",
                self.broker,
                self.consumer,
                event.event_id,
                event.event_type,
                event.delivery_count,
                redact(f"{type(exc).__name__}: {exc}"),
                exc_info=not isinstance(exc, psycopg.OperationalError),
            )
            return False
        if fresh:
            self.stats.applied += 1
        else:
            self.stats.duplicates += 1
            log.debug(
                "%s consumer %r: duplicate %s skipped", self.broker, self.consumer, event.event_id
            )
        return True

    def _backoff(self, delivery_count: int) -> float:
        """Delay before the next delivery of a failed event: full jitter, doubling, capped."""
        return full_jitter(delivery_count, base=self.retry_delay, cap=MAX_RETRY_DELAY)

    async def _sleep_or_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _close_db(self) -> None:
        await self._db.close()
