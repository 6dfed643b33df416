"""The Publisher protocol every broker module implements, and the message it receives."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from outboxkit.tracing import TRACE_HEADERS
from outboxkit.wire.cloudevents import encode_header_value

DEFAULT_CONTENT_TYPE = "application/json"


@dataclass(slots=True)
class OutboundMessage:
    """An event as the relay hands it to a publisher: claimed, not yet confirmed.

    Treat it as read-only (``dataclasses.replace`` makes a changed copy). It is not
    frozen because the relay builds hundreds of thousands per second and a frozen
    dataclass's ``__init__`` costs five times as much.
    """

    # The relay builds it positionally from the claim's RETURNING (store.postgres
    # CLAIM_BATCH): keep the two in one order (tests/unit/test_outbox_columns.py).
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
        for name in TRACE_HEADERS:
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
        for name in TRACE_HEADERS:
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


class Reachability:
    """Whether a publisher can reach its broker, as its client last reported it.

    A publisher that has one as its ``reachability`` attribute lets the relay's
    ``/readyz`` turn 503 within seconds of the broker going away, instead of when a
    publish times out (0.8 x lease). Two ways to feed it, from any thread (plain
    attribute writes, no lock):

    - ``lost(cause)`` / ``restored()`` when the client itself reports its connection
      (librdkafka's all-brokers-down, NATS's disconnected/reconnected callbacks);
    - ``failed(cause)`` / ``succeeded()`` per request for clients that only learn it
      by trying (HTTP, SQS): unreachable once requests have failed for ``grace``
      seconds with no success, forgotten when nothing has failed for ``forget_after``
      (an idle relay sends nothing that could succeed).

    ``cause`` is shown by ``/readyz``: a kind of failure (``disconnected``,
    ``ConnectError``), never a host, port or credential.
    """

    __slots__ = (
        "_clock",
        "_down_since",
        "_failing_since",
        "_last_failure",
        "cause",
        "forget_after",
        "grace",
        "restored_at",
    )

    def __init__(
        self,
        *,
        grace: float = 2.0,
        forget_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace = grace
        self.forget_after = forget_after
        self._clock = clock
        self._down_since: float | None = None
        self._failing_since: float | None = None
        self._last_failure = 0.0
        self.cause = ""
        #: When (clock) it last became reachable again; failures before it are history.
        self.restored_at: float | None = None

    def lost(self, cause: str) -> None:
        """The client says the broker is gone (all connections down)."""
        if self._down_since is None:
            self._down_since = self._clock()
        self.cause = cause

    def restored(self) -> None:
        """The client is connected again, or a publish was confirmed."""
        if self._down_since is not None or self._failing_since is not None:
            self.restored_at = self._clock()
            self._down_since = self._failing_since = None

    def failed(self, cause: str) -> None:
        """One request could not reach the broker (refused, reset, timed out connecting)."""
        now = self._clock()
        if self._failing_since is None or now - self._last_failure > self.forget_after:
            self._failing_since = now
        self._last_failure = now
        self.cause = cause

    succeeded = restored

    def unreachable_for(self) -> float | None:
        """Seconds the broker has been unreachable, or None while it is (believed) reachable."""
        now = self._clock()
        down = self._down_since
        if down is not None:
            return now - down
        failing = self._failing_since
        if (
            failing is not None
            and now - failing >= self.grace
            and now - self._last_failure <= self.forget_after
        ):
            return now - failing
        return None


def unreachable(publisher: object) -> tuple[float, str] | None:
    """(seconds, cause) when ``publisher`` reports its broker unreachable, else None.

    Publishers without a ``reachability`` attribute (user publishers) are never reported:
    the relay then learns of an outage from failing publishes only.
    """
    reach = getattr(publisher, "reachability", None)
    if not isinstance(reach, Reachability):
        return None
    seconds = reach.unreachable_for()
    return None if seconds is None else (seconds, reach.cause)


def restored_since(publisher: object, when: float) -> bool:
    """True if ``publisher`` reported its broker reachable again after ``when`` (monotonic)."""
    reach = getattr(publisher, "reachability", None)
    if not isinstance(reach, Reachability) or reach.restored_at is None:
        return False
    return reach.restored_at > when


@runtime_checkable
class Publisher(Protocol):
    """What the relay needs from a broker. One small module per broker implements it.

    ``publish_batch`` returns one result per message, in the same order, and
    must not raise for per-message failures; an exception means "the whole batch
    failed, retry all of it". Implementations must be safe to call
    concurrently (the relay keeps two batches in flight).

    Optional: a ``reachability`` attribute holding a :class:`Reachability` that the
    publisher updates from its client's connection events; the relay's ``/readyz``
    reads it to answer 503 within seconds of the broker going away. A publisher
    without one keeps working; its outages show once publishes fail.
    """

    name: str

    async def start(self) -> None:
        """Connect; called once before the first batch."""

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        """Publish and wait for the broker's confirmation of each message."""
        ...

    async def close(self) -> None:
        """Flush what can be flushed and disconnect."""
