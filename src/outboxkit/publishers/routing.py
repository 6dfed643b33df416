"""Topic routing: map event types or aggregate types to broker destinations.

For tables whose ``topic`` column holds domain names rather than broker
destinations. A :class:`RoutingPublisher` wraps any publisher and rewrites
each message's topic before delegating, so the relay and the table stay as
they are. Rules are tried in order; the first match wins; an event no rule
matches keeps its topic.

Rule syntax (``outboxkit relay --route RULE``, repeatable)::

    order.*=orders                 event_type glob → destination
    type:invoice.paid=billing      the same, explicit
    aggregate:customer=customers   aggregate_type glob → destination
    topic:legacy.*=archive         topic glob → destination

:class:`Destinations` is the other side: the namespace (prefix) or allow-list a
publisher keeps the topics it is handed in, applied after any route.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from outboxkit.errors import ConfigurationError
from outboxkit.publishers.base import OutboundMessage, Publisher, PublishResult, batch_shape

_FIELDS = {"type": "event_type", "aggregate": "aggregate_type", "topic": "topic"}


@dataclass(frozen=True, slots=True)
class Route:
    """One rule: when ``field`` matches the glob ``pattern``, publish to ``destination``."""

    field: str
    pattern: str
    destination: str

    @classmethod
    def parse(cls, rule: str) -> Route:
        """``[type:|aggregate:|topic:]GLOB=DESTINATION``."""
        selector, sep, destination = rule.partition("=")
        selector, destination = selector.strip(), destination.strip()
        if not sep or not selector or not destination:
            raise ConfigurationError(
                f"route {rule!r} is not PATTERN=DESTINATION; e.g. 'order.*=orders' or"
                " 'aggregate:customer=customers'"
            )
        prefix, colon, pattern = selector.partition(":")
        if colon and prefix in _FIELDS:
            field = _FIELDS[prefix]
        else:
            field, pattern = "event_type", selector
        if not pattern:
            raise ConfigurationError(f"route {rule!r} has an empty pattern")
        return cls(field, pattern, destination)

    def matches(self, message: OutboundMessage) -> bool:
        """Whether the message's event or aggregate type matches this route's pattern."""
        value = getattr(message, self.field)
        return value is not None and fnmatch.fnmatchcase(value, self.pattern)

    def __str__(self) -> str:
        prefix = {v: k for k, v in _FIELDS.items()}[self.field]
        return f"{prefix}:{self.pattern}={self.destination}"


class RoutingPublisher:
    """Rewrites each message's topic by the first matching :class:`Route`, then delegates."""

    def __init__(self, inner: Publisher, routes: Iterable[Route | str]) -> None:
        self.inner = inner
        self.routes = [r if isinstance(r, Route) else Route.parse(r) for r in routes]
        if not self.routes:
            raise ConfigurationError("RoutingPublisher needs at least one route")
        self.name = inner.name
        self.batch_shape = batch_shape(inner)
        self.reachability = getattr(inner, "reachability", None)  # for /readyz, if it has one

    def __repr__(self) -> str:
        return f"RoutingPublisher({self.inner!r}, routes={[str(r) for r in self.routes]!r})"

    def destination(self, message: OutboundMessage) -> str:
        """The topic the message goes to: the first matching route's, else its own."""
        for route in self.routes:
            if route.matches(message):
                return route.destination
        return message.topic

    def route(self, message: OutboundMessage) -> OutboundMessage:
        """The message with its topic rewritten by :meth:`destination`."""
        topic = self.destination(message)
        return message if topic == message.topic else dataclasses.replace(message, topic=topic)

    async def start(self) -> None:
        """Starts the wrapped publisher."""
        await self.inner.start()

    async def publish_batch(self, messages: Sequence[OutboundMessage]) -> list[PublishResult]:
        """Publishes the routed messages through the wrapped publisher."""
        return await self.inner.publish_batch([self.route(m) for m in messages])

    async def close(self) -> None:
        """Closes the wrapped publisher."""
        await self.inner.close()


@dataclass(frozen=True, slots=True)
class Destinations:
    """Which broker destinations a publisher may address: a namespace, an allow-list, or both.

    On Redis a topic is a key name and on RabbitMQ's default exchange a queue name, so
    without either an event can write to (or, with ``maxlen``, trim) any stream, or
    fill any queue, the relay's credentials reach. ``prefix`` is put in front of every
    topic (``orders`` → ``outbox:orders``: nothing outside the namespace is reachable);
    ``allow`` is a list of globs a topic must match (before the prefix). A topic
    refused is dead-lettered with the reason, never published.
    """

    prefix: str = ""
    allow: tuple[str, ...] = ()
    _verdicts: dict[str, tuple[str | None, str | None]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def parse_allow(value: str) -> tuple[str, ...]:
        """``a.*,billing`` → ``("a.*", "billing")``; empty items are ignored."""
        globs = tuple(g.strip() for g in value.split(",") if g.strip())
        if not globs:
            raise ConfigurationError("allow= needs at least one topic glob, e.g. allow=orders.*")
        return globs

    @property
    def restricted(self) -> bool:
        return bool(self.prefix or self.allow)

    def resolve(self, topic: str) -> tuple[str | None, str | None]:
        """``(destination, None)``, or ``(None, why)`` for a topic outside the allow-list."""
        verdict = self._verdicts.get(topic)
        if verdict is None:
            if self.allow and not any(fnmatch.fnmatchcase(topic, g) for g in self.allow):
                verdict = (
                    None,
                    f"topic {topic[:80]!r} is not in the publisher's allow-list"
                    f" (allow={','.join(self.allow)})",
                )
            else:
                verdict = (self.prefix + topic, None)
            if len(topic) <= _VERDICT_KEY_MAX:  # a row's oversized topic: judged, not kept
                if len(self._verdicts) >= _VERDICTS_MAX:  # topics repeat: a small, bounded cache
                    self._verdicts.clear()
                self._verdicts[topic] = verdict
        return verdict


_VERDICTS_MAX = 10_000
_VERDICT_KEY_MAX = 256  # longer topics are refused anyway (outboxkit.limits)


def with_routes(publisher: Publisher, routes: Sequence[str]) -> Publisher:
    """``publisher`` wrapped in a :class:`RoutingPublisher`, or as is without routes."""
    return RoutingPublisher(publisher, routes) if routes else publisher
