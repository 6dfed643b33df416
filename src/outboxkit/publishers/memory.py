"""``memory://``: a broker inside the process, for tests (the testing kit's relay publishes here).

It records each message exactly as a real broker binding would carry it (Kafka's ``ce_*``
record headers by default, NATS's or HTTP's ``ce-*`` headers with ``?binding=``), so a test
asserts on the wire shape without a broker, and it fails on cue (``fail(...)``) so a test
sees the relay retry and dead-letter. Brokers are named (``memory://orders``): a relay's
publisher and the test share one through :meth:`MemoryBroker.named`.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal
from urllib.parse import parse_qsl, urlsplit

from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, PublishResult, Reachability
from outboxkit.wire import kafka as kafka_wire
from outboxkit.wire import nats as nats_wire
from outboxkit.wire import webhook as webhook_wire
from outboxkit.wire.cloudevents import Envelope

Binding = Literal["kafka", "nats", "webhook"]
BINDINGS: tuple[Binding, ...] = ("kafka", "nats", "webhook")

__all__ = ["BINDINGS", "MemoryBroker", "MemoryPublisher", "WireMessage"]


@dataclass(frozen=True, slots=True)
class WireMessage:
    """One message as the broker got it: destination, key, headers as sent, payload bytes.

    ``headers`` are the binding's own (``ce_id`` for Kafka, ``ce-id`` for NATS and HTTP),
    values as text; ``attempt`` is the relay's attempt that sent it (a retry sends again).
    """

    binding: Binding
    topic: str
    key: str | None
    headers: dict[str, str]
    payload: bytes
    event_id: uuid.UUID
    event_type: str
    attempt: int

    def envelope(self) -> Envelope:
        """The message taken apart by this binding's decoder, as its consumer runner does
        (``outboxkit.consumers.base.from_envelope`` makes it a ``ReceivedEvent``)."""
        if self.binding == "kafka":
            key = self.key.encode() if self.key is not None else None
            raw: list[tuple[str, bytes | None]] = [(k, v.encode()) for k, v in self.headers.items()]
            return kafka_wire.decode(key, self.payload, raw)
        if self.binding == "nats":
            return nats_wire.decode(self.payload, self.headers)
        return webhook_wire.decode(self.payload, self.headers)


@dataclass(slots=True)
class _Failure:
    times: int
    topic: str | None
    event_type: str | None
    permanent: bool
    error: str

    def matches(self, message: OutboundMessage) -> bool:
        return (self.topic is None or message.topic == self.topic) and (
            self.event_type is None or message.event_type == self.event_type
        )


@dataclass(slots=True)
class MemoryBroker:
    """What a ``memory://NAME`` publisher delivered: ``messages`` in confirmation order."""

    name: str
    messages: list[WireMessage] = field(default_factory=list)
    #: Every failure reported to the relay, as (event_id, error) pairs.
    failures: list[tuple[uuid.UUID, str]] = field(default_factory=list)
    _plans: list[_Failure] = field(default_factory=list)
    #: Reported to the relay's /readyz as a real client's connection events are.
    reachability: Reachability = field(default_factory=Reachability)
    _cut: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    _named: ClassVar[dict[str, MemoryBroker]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def named(cls, name: str = "default") -> MemoryBroker:
        """The process's broker called ``name`` (made on first use)."""
        with cls._named_lock:
            broker = cls._named.get(name)
            if broker is None:
                broker = cls._named[name] = cls(name)
            return broker

    @classmethod
    def forget(cls, name: str) -> None:
        """Drop the broker called ``name`` (a test's own, after it)."""
        with cls._named_lock:
            cls._named.pop(name, None)

    def fail(
        self,
        times: int = 1,
        *,
        topic: str | None = None,
        event_type: str | None = None,
        permanent: bool = False,
        error: str = "memory broker: failure on cue",
    ) -> None:
        """Refuse the next ``times`` matching messages: retryable, or ``permanent`` (dead letter).

        Failures planned in turn apply in turn; a message matching none is confirmed.
        """
        if times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self._plans.append(_Failure(times, topic, event_type, permanent, error))

    def cut(self) -> None:
        """The broker goes away: every publish is handed back untried (no attempt counted),
        as a real publisher does when its connection drops, until :meth:`restore`."""
        self._cut = True
        self.reachability.lost("disconnected")

    def restore(self) -> None:
        """The broker is back after :meth:`cut`."""
        self._cut = False
        self.reachability.restored()

    def clear(self) -> None:
        """Forget what was delivered and every failure still planned."""
        with self._lock:
            self.messages.clear()
            self.failures.clear()
            self._plans.clear()

    def on(self, topic: str) -> list[WireMessage]:
        """The messages delivered to ``topic``."""
        return [m for m in self.messages if m.topic == topic]

    def _take(self, binding: Binding, message: OutboundMessage) -> PublishResult:
        if self._cut:
            return PublishResult.hand_back("memory broker: cut", "connection_lost")
        with self._lock:
            for plan in self._plans:
                if plan.matches(message):
                    plan.times -= 1
                    if plan.times == 0:
                        self._plans.remove(plan)
                    self.failures.append((message.event_id, plan.error))
                    if plan.permanent:
                        return PublishResult.permanent(plan.error, "memory_rejected")
                    return PublishResult.retry(plan.error, "memory_failure")
            self.messages.append(_wire(binding, message))
        return PublishResult.success()


def _wire(binding: Binding, message: OutboundMessage) -> WireMessage:
    headers: dict[str, str]
    if binding == "kafka":
        headers = {k: v.decode() for k, v in kafka_wire.encode_headers(message)}
    elif binding == "nats":
        headers = nats_wire.encode_headers(message)
    else:
        headers = webhook_wire.encode_headers(message)
    return WireMessage(
        binding=binding,
        topic=message.topic,
        key=message.key,
        headers=headers,
        payload=message.payload,
        event_id=message.event_id,
        event_type=message.event_type,
        attempt=message.attempt,
    )


class MemoryPublisher:
    """A :class:`~outboxkit.publishers.Publisher` that delivers into a :class:`MemoryBroker`."""

    def __init__(self, broker: MemoryBroker | None = None, *, binding: Binding = "kafka") -> None:
        if binding not in BINDINGS:
            raise ConfigurationError(
                f"memory:// binding {binding!r} is not known; use one of {', '.join(BINDINGS)}"
            )
        self.broker = broker if broker is not None else MemoryBroker.named()
        self.binding: Binding = binding
        self.name = f"memory:{self.broker.name}"
        self.reachability = self.broker.reachability

    @classmethod
    def from_url(cls, url: str) -> MemoryPublisher:
        """``memory://[NAME][?binding=kafka|nats|webhook]``: the broker ``NAME`` (``default``)."""
        parts = urlsplit(url)
        binding: str = "kafka"
        for key, value in parse_qsl(parts.query):
            if key != "binding":
                raise ConfigurationError(
                    f"memory:// URL option {key!r} is not known; the only one is binding="
                )
            binding = value
        if binding not in BINDINGS:
            raise ConfigurationError(
                f"memory:// binding {binding!r} is not known; use one of {', '.join(BINDINGS)}"
            )
        return cls(MemoryBroker.named(parts.netloc or "default"), binding=binding)

    async def start(self) -> None:
        """Nothing to connect to."""

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        """Takes each message into the broker (or fails it as planned with ``fail``)."""
        return [self.broker._take(self.binding, m) for m in messages]

    async def close(self) -> None:
        """Nothing to disconnect."""
